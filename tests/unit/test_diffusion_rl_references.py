"""diffusion_grpo's advantages and loss against the references' formulas, written out here from the published code
(Flow-GRPO's sde_step_with_logprob, loss and sample filtering in train_sd3.py; DDPO's PerPromptStatTracker): flat
groups get exactly 0, the recipe's whole loss at the SD3 and FLUX configs' schedules is Flow-GRPO's, the
zero-advantage filter and DDPO's per-prompt tracker (and its checkpointed state) are the references'."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch
from multiengine.pipelines.diffusion.rl import (
    PromptStatTracker,
    clipped_policy_loss,
    flow_sampler,
    group_advantages,
    grpo_step_loss,
    kl_to_reference,
    train_step_indices,
)
from multiengine.pipelines.diffusion.rl_runs import rollout_advantages
from multiengine.recipes.language.config import load_config

# the scheduler configs of the two models' scheduler/scheduler_config.json (SD3-medium, FLUX.1-dev)
SCHEDULERS = {"sd3_medium": {"num_train_timesteps": 1000, "shift": 3.0},
              "flux_lora": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                            "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                            "max_image_seq_len": 4096}}
VAE_SCALE = 8  # both vaes: 4 down blocks


# --- the references, written out ---------------------------------------------------------------------------
def flow_grpo_step(v, x, sigmas, j, noise_level, prev=None, noise=None):
    """Flow-GRPO's sde_step_with_logprob (sde_type 'sde') at step index j: (prev, log_prob, mean, std_dev_t)."""
    sigma, sigma_prev, sigma_max = sigmas[j], sigmas[j + 1], sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev is None:
        prev = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    log_prob = (-((prev.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev, log_prob.mean(dim=(1, 2, 3)), mean, std_dev_t


def flow_grpo_loss(log_prob, old_log_prob, adv, mean, ref_mean, std_dev_t, train):
    """train_sd3.py's loss on one timestep (train = config.train); returns (loss, kl_loss)."""
    advantages = torch.clamp(adv, -train["adv_clip_max"], train["adv_clip_max"])
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - train["clip_range"], 1.0 + train["clip_range"])
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    kl_loss = ((mean - ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    kl_loss = torch.mean(kl_loss)
    return policy_loss + train["beta"] * kl_loss, kl_loss


def flow_grpo_global_std_advantages(prompts, rewards):
    """Flow-GRPO's PerPromptStatTracker(global_std=True).update, type 'grpo' (cleared every epoch)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        mean = np.mean(rewards[prompts == prompt], axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (rewards[prompts == prompt] - mean) / std
    return advantages


def ddpo_ppo_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max):
    """DDPO's train.py loss on one timestep."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


class DDPOTracker:
    """DDPO's PerPromptStatTracker.update (ddpo_pytorch/stat_tracking.py)."""

    def __init__(self, buffer_size, min_count):
        self.buffer_size, self.min_count, self.stats = buffer_size, min_count, {}

    def update(self, prompts, rewards):
        prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
        advantages = np.empty_like(rewards)
        for prompt in np.unique(prompts):
            prompt_rewards = rewards[prompts == prompt]
            if prompt not in self.stats:
                self.stats[prompt] = deque(maxlen=self.buffer_size)
            self.stats[prompt].extend(prompt_rewards)
            if len(self.stats[prompt]) < self.min_count:
                mean, std = np.mean(rewards), np.std(rewards) + 1e-6
            else:
                mean, std = np.mean(self.stats[prompt]), np.std(self.stats[prompt]) + 1e-6
            advantages[prompts == prompt] = (prompt_rewards - mean) / std
        return advantages


# --- flat groups ------------------------------------------------------------------------------------------
FLAT = (0.7, 0.1, 1e6, -3.0)


def _mixed_batch(dtype):
    """Groups of 8: each flat value, each followed by a non-flat group around it."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for v in FLAT:
        groups.append(torch.full((8,), v))
        groups.append(v + (abs(v) + 1) * 0.1 * torch.rand(8, generator=g))
    return torch.cat(groups).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_a_flat_group_gets_exactly_zero(dtype, std):
    r = _mixed_batch(dtype)
    adv = group_advantages(r, 8, std=std)
    flat = torch.arange(r.numel()) // 8 % 2 == 0
    assert adv.dtype == torch.float32 and torch.equal(adv[flat], torch.zeros(int(flat.sum())))
    # the other groups: the formula, on the float32 values of the rewards
    g = r.float().view(-1, 8)
    s = {"group": g.std(dim=1, unbiased=False, keepdim=True) + 1e-4, "global": r.float().std(unbiased=False) + 1e-4,
         "none": torch.tensor(1.0)}[std]
    torch.testing.assert_close(adv[~flat], ((g - g.mean(dim=1, keepdim=True)) / s).view(-1)[~flat])
    assert bool((adv[~flat] != 0).all())
    # the same through the recipe's function, and DDPO's tracker once a prompt's buffer is flat
    d = load_config("diffusion_grpo", "tiny", [f"diffusion.advantage_std={std}"]).diffusion
    assert torch.equal(rollout_advantages(r, [str(i // 8) for i in range(r.numel())], d), adv)
    tracker = PromptStatTracker(8, 8, std)
    tracked = tracker.update([str(i // 8) for i in range(r.numel())], r)
    assert torch.equal(tracked[flat], torch.zeros(int(flat.sum()))) and bool((tracked[~flat] != 0).all())
    # float64 rewards too: the mean of a buffer of twelve 0.7s is not exactly 0.7
    tracker, prompts = PromptStatTracker(12, 12, std), ["a"] * 8 + ["b"] * 8
    for _ in range(2):
        tracked = tracker.update(prompts, torch.cat([torch.full((8,), 0.7, dtype=torch.float64), r[8:16].double()]))
    assert torch.equal(tracked[:8], torch.zeros(8)) and bool((tracked[8:] != 0).all())


# --- the recipe's whole loss is Flow-GRPO's at the shipped configs' schedules -----------------------------------
def _reference_sigmas(config_name, n, resolution):
    """What Flow-GRPO samples with: SD3 set_timesteps(n); FLUX its pipeline's linspace(1, 1/n, n) and mu."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = SCHEDULERS[config_name]
    sched = FlowMatchEulerDiscreteScheduler(**c)
    if c.get("use_dynamic_shifting"):
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift((resolution // VAE_SCALE // 2) ** 2))
    else:
        sched.set_timesteps(n)
    return sched.sigmas


@pytest.mark.parametrize("config_name", ["sd3_medium", "flux_lora"])
@pytest.mark.parametrize("drop", [True, False])
def test_the_recipes_loss_is_flow_grpos_at_the_configs_schedules(config_name, drop):
    d = load_config("diffusion_grpo", config_name, [f"diffusion.drop_zero_advantages={str(drop).lower()}"]).diffusion
    assert d.kl_coef == 0.04 and d.noise_level == 0.7 and d.train_noisiest
    assert load_config("diffusion_grpo", config_name, []).diffusion.drop_zero_advantages  # as shipped: Flow-GRPO's
    sampler = flow_sampler(SCHEDULERS[config_name], d.num_inference_steps, d.noise_level, d.resolution, VAE_SCALE)
    sigmas = _reference_sigmas(config_name, d.num_inference_steps, d.resolution)
    torch.testing.assert_close(sampler.sigmas, sigmas, rtol=0, atol=0)
    train = {"clip_range": d.clip_range, "adv_clip_max": d.adv_clip_max, "beta": d.kl_coef}
    g = torch.Generator().manual_seed(1)
    b = 2 * d.group_size
    rewards = torch.cat([torch.rand(d.group_size, generator=g), torch.full((d.group_size,), 0.5)])  # one flat group
    adv = group_advantages(rewards, d.group_size, std=d.advantage_std)
    keep = adv != 0 if drop else torch.ones(b, dtype=torch.bool)
    assert keep.sum() == (d.group_size if drop else b)
    factors, clipfracs = [], []
    for j in range(d.trained_steps):  # the noisiest steps (train_noisiest), as Flow-GRPO's range(num_train_timesteps)
        x, v_old = torch.randn(b, 16, 8, 8, generator=g), torch.randn(b, 16, 8, 8, generator=g)
        # the updated policy: rows from 1e-3 to 0.3 away, so that some ratios are clipped and some are not
        scale = torch.logspace(-3, -0.5, b).view(2, -1).t().reshape(-1, 1, 1, 1)  # both groups small and large
        v = v_old + scale * torch.randn(b, 16, 8, 8, generator=g)
        v_ref = v_old + torch.randn(b, 16, 8, 8, generator=g)
        noise = torch.randn(b, 16, 8, 8, generator=g)
        idx = torch.full((b,), j)
        old = sampler.step(v_old, x, idx, noise=noise)  # the rollout
        now = sampler.step(v, x, idx, prev_sample=old.prev_sample)
        ref = sampler.step(v_ref, x, idx, prev_sample=old.prev_sample)
        ours, stats = grpo_step_loss(now, ref, old.log_prob, adv, d)
        # Flow-GRPO: the same draws, its rollout, its filter (samples[mask]), its re-scoring and loss
        prev, old_lp, _, _ = flow_grpo_step(v_old, x, sigmas, j, d.noise_level, noise=noise)
        _, lp, mean, std_dev_t = flow_grpo_step(v[keep], x[keep], sigmas, j, d.noise_level, prev=prev[keep])
        _, _, ref_mean, _ = flow_grpo_step(v_ref[keep], x[keep], sigmas, j, d.noise_level, prev=prev[keep])
        theirs, kl = flow_grpo_loss(lp, old_lp[keep], adv[keep], mean, ref_mean, std_dev_t, train)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)  # measured: bit for bit
        torch.testing.assert_close(stats["kl"], kl, rtol=1e-6, atol=0)
        assert kl * d.kl_coef > 1e-3 * abs(stats["policy_loss"])  # both terms count
        clipfracs.append(float(stats["clipfrac"]))
        # the exact KL of the two Gaussian steps (what the recipe used to weight) is Flow-GRPO's over -dt
        exact = kl_to_reference(now.prev_sample_mean, ref.prev_sample_mean, now.noise_std)
        factor = exact / kl_to_reference(now.prev_sample_mean, ref.prev_sample_mean, now.std_dev_t)
        torch.testing.assert_close(factor, (1 / (sigmas[j] - sigmas[j + 1])).expand(b), rtol=1e-5, atol=0)
        factors.append(float(factor[0]))
    assert any(0 < c < 1 for c in clipfracs), clipfracs  # clipped and unclipped ratios in one step
    # measured: SD3 (shift 3) 25.08 -> 9.51, FLUX at 512 px (mu 0.63) 17.90 -> 10.35 over the 6 trained steps
    span = {"sd3_medium": (25.08, 9.51), "flux_lora": (17.9, 10.35)}[config_name]
    assert (round(factors[0], 2), round(factors[-1], 2)) == span, factors


def test_dropping_zero_advantages_is_flow_grpos_mean_over_the_kept_rows():
    d = load_config("diffusion_grpo", "tiny", ["diffusion.drop_zero_advantages=true", "diffusion.kl_coef=0"]).diffusion
    g = torch.Generator().manual_seed(3)
    rewards = torch.cat([torch.full((8,), 0.2), torch.rand(8, generator=g), torch.full((8,), 1.0)])
    adv = group_advantages(rewards, 8, std=d.advantage_std)
    lp, old = torch.randn(24, generator=g) * 1e-4, torch.randn(24, generator=g) * 1e-4
    step = type("Step", (), {"log_prob": lp, "prev_sample_mean": None, "std_dev_t": None})
    ours, _ = grpo_step_loss(step, None, old, adv, d)
    mask = adv.abs() != 0  # Flow-GRPO: samples = {k: v[mask]} before the loss' mean
    train = {"clip_range": d.clip_range, "adv_clip_max": d.adv_clip_max, "beta": 0.0}
    theirs, _ = flow_grpo_loss(lp[mask], old[mask], adv[mask], torch.zeros(8, 1, 1, 1), torch.zeros(8, 1, 1, 1),
                               torch.ones(1), train)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # the mean over all rows (DDPO's, the default) is B_kept / B of it: the flat rows add 0 to the sum
    kept, _ = grpo_step_loss(step, None, old, adv, d.replace(drop_zero_advantages=False))
    torch.testing.assert_close(kept, theirs * mask.sum() / 24, rtol=1e-6, atol=0)
    nothing, _ = grpo_step_loss(step, None, old, torch.zeros(24), d)  # every row flat: 0, not NaN
    assert nothing.item() == 0


def test_global_std_is_flow_grpos_and_ddpos_loss_and_steps_are_the_references():
    g = torch.Generator().manual_seed(7)
    r = torch.rand(24, generator=g)
    expected = flow_grpo_global_std_advantages([f"p{i // 4}" for i in range(24)], r.tolist())
    torch.testing.assert_close(group_advantages(r, 4, std="global"), torch.from_numpy(expected).float())
    # DDPO: each row trains on its own random permutation's first K timesteps; the loss of K steps per row
    # ([B, K]) is the mean of the K per-step losses the references accumulate
    b, n, k = 6, 10, 4
    g3 = torch.Generator().manual_seed(3)
    perms = torch.stack([torch.randperm(n, generator=g3) for _ in range(b)])
    assert torch.equal(train_step_indices(b, n, k / n, torch.Generator().manual_seed(3)), perms[:, :k])
    lp, old = 1e-3 * torch.randn(b, k, generator=g), 1e-3 * torch.randn(b, k, generator=g)
    adv = 4 * torch.randn(b, generator=g)
    ours, _ = clipped_policy_loss(lp, old, adv, 1e-4, 5.0)
    theirs = torch.stack([ddpo_ppo_loss(lp[:, j], old[:, j], adv, 1e-4, 5.0) for j in range(k)]).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


# --- DDPO's per-prompt stat tracker ------------------------------------------------------------------------
def _updates(n):
    g = torch.Generator().manual_seed(5)
    for _ in range(n):
        picks = torch.randint(0, 3, (3,), generator=g).tolist()
        yield [f"prompt {p}" for p in picks for _ in range(4)], torch.rand(12, generator=g)


def test_the_prompt_tracker_is_ddpos_and_its_state_resumes_exactly():
    ours, theirs = PromptStatTracker(16, 16), DDPOTracker(16, 16)
    updates = list(_updates(8))
    for i, (prompts, rewards) in enumerate(updates):
        if i == 4:  # a tracker rebuilt from the state (as a resumed run) continues exactly
            state = ours.state_dict()
            ours = PromptStatTracker(16, 16)
            ours.load_state_dict(state)
        expected = torch.from_numpy(theirs.update(prompts, rewards.double().numpy())).float()
        torch.testing.assert_close(ours.update(prompts, rewards), expected, rtol=1e-6, atol=1e-6)
    assert any(len(v) == 16 for v in ours.buffers.values())  # some prompts used their buffer, the others the batch
    with pytest.raises(ValueError, match="not finite"):
        ours.update(["a"], torch.tensor([float("nan")]))


def test_prompt_tracker_keys():
    d = load_config("diffusion_grpo", "tiny", ["diffusion.prompt_buffer=16", "diffusion.advantage_std=group"]).diffusion
    tracker = PromptStatTracker(d.prompt_buffer, d.prompt_min_count, d.advantage_std)
    prompts, rewards = next(_updates(1))
    torch.testing.assert_close(rollout_advantages(rewards, prompts, d, tracker),
                               torch.from_numpy(DDPOTracker(16, 16).update(prompts, rewards.double().numpy())).float())
    for overrides, words in ((["diffusion.prompt_min_count=4"], "applies only when diffusion.prompt_buffer is set"),
                             (["diffusion.prompt_buffer=8"], "exceeds prompt_buffer=8")):
        with pytest.raises(Exception, match=words):
            load_config("diffusion_grpo", "tiny", overrides)
