"""Reinforcement learning of diffusion models: stochastic steps with log-probabilities (DDIM with ``eta > 0`` as
DDPO, the reverse-time SDE of a rectified flow as Flow-GRPO), a sampling loop that records them, group-relative
advantages, the clipped ratio objective and the Diffusion-DPO loss. A step's log-probability is the Gaussian
log-density averaged over the non-batch dims (as both references: ratios stay near 1). Flat tensors in, float32
math (bf16 overflows in the mean), randomness only through an explicit generator or ``noise``. See
docs/diffusion-rl.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from multiengine.engines.settings import Choice, FieldError, Range, Settings, setting

from ..rlhf.losses import PolicyLossInputs, register_policy_loss
from .math import PREDICTION_TYPES

__all__ = ["DDIMSampler", "DPOStats", "DenoiseStep", "Denoiser", "DiffusionDPOSettings", "DiffusionGRPOSettings",
           "FlowSDESampler", "PromptStatTracker", "Trajectory", "clipped_policy_loss", "ddim_step_with_logprob",
           "ddim_timesteps", "diffusion_dpo_loss", "diffusion_dpo_loss_from_losses", "diffusion_grpo_loss",
           "flow_inference_sigmas", "flow_sampler", "gaussian_logprob", "group_advantages", "grpo_step_loss",
           "kl_to_reference", "paired", "rescore", "sample_with_logprobs", "sde_step_with_logprob",
           "train_step_indices"]


@dataclass(frozen=True)
class DiffusionGRPOSettings(Settings):
    """Sampling and the policy objective of DDPO / Flow-GRPO."""

    resolution: int = setting(16, "image side in pixels", Range(8))
    num_inference_steps: int = setting(4, "sampler steps per image", Range(1))
    eta: float = setting(1.0, "unet families: DDIM noise (> 0; DDPO uses 1.0)", Range(0, min_exclusive=True))
    noise_level: float = setting(0.7, "flow families: SDE noise level (> 0; Flow-GRPO uses 0.7)",
                                 Range(0, min_exclusive=True))
    guidance_scale: float = setting(1.0, "CFG scale while sampling (1 = none); FLUX: its guidance input", Range(0))
    group_size: int = setting(8, "images per prompt (advantages are relative to the group)", Range(2))
    advantage_std: str = setting("global", "group | global (the batch's std, Flow-GRPO's base config) | none "
                                           "(Dr. GRPO)", Choice("group", "global", "none"))
    clip_range: float = setting(1e-4, "importance-ratio clip (DDPO, Flow-GRPO)", Range(0, min_exclusive=True))
    adv_clip_max: float = setting(5.0, "advantages clamped to [-x, x]", Range(0, min_exclusive=True))
    kl_coef: float = setting(0.01, "weight of the KL to roles.ref, Flow-GRPO's beta: mean((mean - ref_mean)^2) / "
                             "(2 std_dev_t^2) per trained step (flow: the exact KL times the step's -dt; DDIM: "
                             "the exact KL); 0 = no ref role", Range(0))
    drop_zero_advantages: bool = setting(False, "average the loss over the rows whose advantage is not 0, as "
                                         "Flow-GRPO filters them (its loss is B/B_kept larger); off: DDPO's mean "
                                         "over every row")
    prompt_buffer: int = setting(0, "DDPO's per-prompt stat tracker: advantages against each prompt's last N "
                                    "rewards across steps, gathered over the ranks (DDPO: 16, with advantage_std="
                                    "group); 0 = the group's statistics", Range(0))
    prompt_min_count: int = setting(16, "the tracker uses the rollout's statistics until a prompt has this many "
                                        "rewards buffered (DDPO: 16)", Range(1), when="prompt_buffer")
    train_timestep_fraction: float = setting(0.5, "fraction of each trajectory's steps trained on",
                                             Range(0, 1, min_exclusive=True))
    train_noisiest: bool = setting(True, "true: the noisiest steps first; false: a random subset per image (DDPO)")

    def check(self) -> None:
        if self.trained_steps < 1:
            raise FieldError("train_timestep_fraction", self.train_timestep_fraction, f"of {self.num_inference_steps} "
                             "steps trains on no step", f"use at least {1 / self.num_inference_steps:.3g}")
        if self.prompt_buffer and self.prompt_min_count > self.prompt_buffer:
            raise FieldError("prompt_min_count", self.prompt_min_count, f"exceeds prompt_buffer={self.prompt_buffer}"
                             " (a buffer never holds that many)", f"set it to at most {self.prompt_buffer}")

    @property
    def trained_steps(self) -> int:
        """Denoising steps each image trains on."""
        return int(self.num_inference_steps * self.train_timestep_fraction)


@dataclass(frozen=True)
class DiffusionDPOSettings(Settings):
    beta: float = setting(5000.0, "Diffusion-DPO's beta (diffusers' script: 2500 for SD 1.5, 5000 for SDXL)",
                          Range(0, min_exclusive=True))
    guidance_scale: float = setting(1.0, "FLUX only: its guidance input while training", Range(0))
    max_sequence_length: int = setting(0, "SD3/FLUX: T5 tokens per prompt (0 = the family's)", Range(0))


_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``denoiser_fn(latents [B, ...], timesteps [B]) -> model_output [B, ...]``: the caller closes over the prompt
embeddings (and classifier-free guidance), so the loop and the re-scoring never see the model's other inputs. Latents
arrive in float32 (the trajectory is kept in float32 so re-scoring is exact): a bf16 model casts inside the closure."""


class DenoiseStep(NamedTuple):
    """One denoising step: ``prev_sample``, ``log_prob`` ``[B]`` (None when deterministic), ``prev_sample_mean``
    (differentiable), ``std_dev_t`` (DDIM's ``eta * sigma_t``, Flow-GRPO's ``noise_level * sqrt(sigma / (1 -
    sigma))``) and ``noise_std``, the std of the step's Gaussian (flow: ``std_dev_t * sqrt(sigma - sigma_prev)``)."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    noise_std: torch.Tensor


# --- shared helpers -------------------------------------------------------------------------------
def _rows(value: int | torch.Tensor, batch: int, device: torch.device, name: str) -> torch.Tensor:
    """``value`` as a ``[B]`` tensor (an int or 0-d tensor is repeated)."""
    t = torch.as_tensor(value, device=device)
    if t.ndim == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape [B]=[{batch}], got {tuple(t.shape)}")
    return t


def _bcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.reshape((like.shape[0],) + (1,) * (like.ndim - 1))


def _draw(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Drawn on the generator's device and moved (as diffusers' randn_tensor does): the same numbers on any device.
    draw_on = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=draw_on, dtype=torch.float32).to(device)


def _check_exclusive(prev_sample: torch.Tensor | None, generator: torch.Generator | None,
                     noise: torch.Tensor | None) -> None:
    if prev_sample is not None and (generator is not None or noise is not None):
        raise ValueError("pass prev_sample (to score a given step) or generator/noise (to sample one), not both.")
    if generator is not None and noise is not None:
        raise ValueError("pass generator or noise, not both.")


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` averaged over every dim but the first, ``[B]``; ``x`` detached (the gradient
    reaches the policy through ``mean`` only)."""
    std = _bcast(std, mean) if std.ndim == 1 else std
    lp = -((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def _finish(mean: torch.Tensor, std_dev_t: torch.Tensor, noise_std: torch.Tensor, deterministic: bool,
            prev_sample: torch.Tensor | None, generator: torch.Generator | None,
            noise: torch.Tensor | None) -> DenoiseStep:
    if deterministic:
        if prev_sample is not None:
            raise ValueError("a deterministic step (eta == 0 / noise_level == 0) has no density to score "
                             "prev_sample with; use eta > 0 or noise_level > 0.")
        return DenoiseStep(mean, None, mean, std_dev_t, noise_std)
    if prev_sample is None:
        if noise is not None and noise.shape != mean.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != sample shape {tuple(mean.shape)}")
        eps = noise.float() if noise is not None else _draw(mean.shape, generator, mean.device)
        prev_sample = mean + _bcast(noise_std, mean) * eps
    else:
        if prev_sample.shape != mean.shape:
            raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(mean.shape)}")
        prev_sample = prev_sample.float()
    return DenoiseStep(prev_sample, gaussian_logprob(prev_sample, mean, noise_std), mean, std_dev_t, noise_std)


# --- DDIM (DDPO) ------------------------------------------------------------------------------------
def ddim_timesteps(num_inference_steps: int, num_train_timesteps: int = 1000, steps_offset: int = 0) -> torch.Tensor:
    """DDIM's sampling timesteps with diffusers' default ``"leading"`` spacing: ``arange(n) * (T // n) +
    steps_offset``, descending, ``[n]`` long (SD's config has ``steps_offset=1``)."""
    if not 1 <= num_inference_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be in [1, {num_train_timesteps}].")
    ratio = num_train_timesteps // num_inference_steps
    return (torch.arange(num_inference_steps - 1, -1, -1, dtype=torch.long) * ratio) + steps_offset


def ddim_step_with_logprob(model_output: torch.Tensor, sample: torch.Tensor, timestep: int | torch.Tensor,
                           prev_timestep: int | torch.Tensor, sampler: DDIMSampler, *,
                           prev_sample: torch.Tensor | None = None, generator: torch.Generator | None = None,
                           noise: torch.Tensor | None = None) -> DenoiseStep:
    """One DDIM step ``x_t -> x_prev`` and its log-probability, DDPO's ``ddim_step_with_logprob``: ``mean =
    sqrt(a_prev) x0 + sqrt(1 - a_prev - std^2) eps``, ``std = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t /
    a_prev))``; a negative ``prev_timestep`` uses the sampler's ``final_alpha_cumprod``. Draws ``x_prev`` (from
    ``generator`` or ``noise``) or scores a given ``prev_sample``; ``log_prob`` None at ``eta == 0``."""
    _check_exclusive(prev_sample, generator, noise)
    x, out = sample.float(), model_output.float()
    if out.shape != x.shape:
        raise ValueError(f"model_output shape {tuple(out.shape)} != sample shape {tuple(x.shape)}")
    b, dev = x.shape[0], x.device
    ac = sampler.alphas_cumprod.to(device=dev, dtype=torch.float32)
    t = _rows(timestep, b, dev, "timestep").long()
    tp = _rows(prev_timestep, b, dev, "prev_timestep").long()
    a_t = ac[t]
    a_prev = ac[tp.clamp(0, ac.shape[0] - 1)]
    if sampler.final_alpha_cumprod is not None:
        a_prev = torch.where(tp >= 0, a_prev, torch.full_like(a_prev, float(sampler.final_alpha_cumprod)))
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std = sampler.eta * variance.sqrt()
    a_t_, a_prev_, std_ = _bcast(a_t, x), _bcast(a_prev, x), _bcast(std, x)
    beta_t = 1 - a_t_
    if sampler.prediction_type == "epsilon":
        x0, eps = (x - beta_t.sqrt() * out) / a_t_.sqrt(), out
    elif sampler.prediction_type == "sample":
        x0 = out
        eps = (x - a_t_.sqrt() * x0) / beta_t.sqrt()
    else:
        x0 = a_t_.sqrt() * x - beta_t.sqrt() * out
        eps = a_t_.sqrt() * out + beta_t.sqrt() * x
    if sampler.clip_sample_range is not None:
        x0 = x0.clamp(-sampler.clip_sample_range, sampler.clip_sample_range)
    mean = a_prev_.sqrt() * x0 + (1 - a_prev_ - std_**2).sqrt() * eps
    return _finish(mean, std, std, sampler.eta == 0, prev_sample, generator, noise)


# --- rectified flow (Flow-GRPO) ------------------------------------------------------------------------
def flow_inference_sigmas(num_inference_steps: int, num_train_timesteps: int = 1000, shift: float = 1.0,
                          mu: float | None = None) -> torch.Tensor:
    """The sampling sigmas of diffusers' pipelines plus a final 0, ``[n + 1]`` float32: SD3's shifted
    ``set_timesteps(n)`` or, with ``mu``, FluxPipeline's ``set_timesteps(sigmas=linspace(1, 1/n, n), mu=mu)``."""
    import numpy as np

    from .flow import flow_match_schedule

    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1.")
    n_train = int(num_train_timesteps)
    if mu is not None:
        s = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).astype(np.float32)
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    else:  # the scheduler's smallest training sigma (float32, shifted), the start shifted again as diffusers does
        sigma_min = flow_match_schedule(n_train, shift)[1][-1].item()
        s = np.linspace(1.0 * n_train, sigma_min * n_train, num_inference_steps) / n_train
        s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([torch.from_numpy(np.asarray(s)).float(), torch.zeros(1)])


def sde_step_with_logprob(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int | torch.Tensor,
    noise_level: float,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> DenoiseStep:
    """One reverse-SDE step of a rectified flow and its log-probability (Flow-GRPO's ``sde_step_with_logprob``):
    ``dt = sigmas[i + 1] - sigma``, ``std_dev_t = noise_level * sqrt(sigma / (1 - sigma))`` (``sigmas[1]`` where
    ``sigma == 1``), ``mean = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt``,
    ``x_prev = mean + std_dev_t sqrt(-dt) noise``; the Euler step at ``noise_level == 0`` (``log_prob`` None)."""
    if not noise_level >= 0:
        raise ValueError(f"noise_level={noise_level} must be >= 0 (Flow-GRPO uses 0.7).")
    _check_exclusive(prev_sample, generator, noise)
    x, v = sample.float(), model_output.float()
    if v.shape != x.shape:
        raise ValueError(f"model_output shape {tuple(v.shape)} != sample shape {tuple(x.shape)}")
    if sigmas.ndim != 1 or sigmas.shape[0] < 2:
        raise ValueError(f"sigmas must be [N + 1] with N >= 1 (ending in 0), got shape {tuple(sigmas.shape)}")
    sig = sigmas.to(device=x.device, dtype=torch.float32)
    i = _rows(step_index, x.shape[0], x.device, "step_index").long()
    if bool((i < 0).any()) or bool((i >= sig.shape[0] - 1).any()):
        raise ValueError(f"step_index must be in [0, {sig.shape[0] - 2}] (N = {sig.shape[0] - 1} steps), "
                         f"got {i.tolist()}")
    sigma, sigma_prev = sig[i], sig[i + 1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sig[1], sigma))) * noise_level
    s_, dt_, std_ = _bcast(sigma, x), _bcast(dt, x), _bcast(std_dev_t, x)
    mean = x * (1 + std_**2 / (2 * s_) * dt_) + v * (1 + std_**2 * (1 - s_) / (2 * s_)) * dt_
    noise_std = std_dev_t * torch.sqrt(-dt)
    return _finish(mean, std_dev_t, noise_std, noise_level == 0, prev_sample, generator, noise)


# --- samplers and the loop ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DDIMSampler:
    """DDIM with ``eta`` over descending ``timesteps``, step ``i`` to ``timesteps[i] - T // N``;
    ``final_alpha_cumprod``: ``a_prev`` below timestep 0; ``clip_sample_range``: clamp the predicted x0."""

    timesteps: torch.Tensor
    alphas_cumprod: torch.Tensor
    eta: float = 1.0
    prediction_type: str = "epsilon"
    final_alpha_cumprod: float | None = None
    clip_sample_range: float | None = None

    def __post_init__(self) -> None:
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type={self.prediction_type!r}; use one of {list(PREDICTION_TYPES)}.")
        if not self.eta >= 0:
            raise ValueError(f"eta={self.eta} must be >= 0 (DDPO uses 1.0).")

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def model_timesteps(self, index: torch.Tensor) -> torch.Tensor:
        """The timestep the denoiser sees at step ``index [B]``."""
        return self.timesteps.to(index.device)[index]

    def step(self, model_output: torch.Tensor, sample: torch.Tensor, index: torch.Tensor, **kwargs) -> DenoiseStep:
        t = self.model_timesteps(index).long()
        return ddim_step_with_logprob(model_output, sample, t, t - self.alphas_cumprod.shape[0] // self.num_steps,
                                      self, **kwargs)


@dataclass(frozen=True)
class FlowSDESampler:
    """Flow-GRPO's SDE over ``sigmas`` (``[N + 1]``, :func:`flow_inference_sigmas`); the denoiser sees
    ``sigma * num_train_timesteps`` as diffusers' SD3 pipeline passes it (a FLUX denoiser divides by 1000)."""

    sigmas: torch.Tensor
    noise_level: float = 0.7
    num_train_timesteps: int = 1000

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1

    def model_timesteps(self, index: torch.Tensor) -> torch.Tensor:
        return self.sigmas.to(index.device)[index] * self.num_train_timesteps

    def step(self, model_output: torch.Tensor, sample: torch.Tensor, index: torch.Tensor, **kwargs) -> DenoiseStep:
        return sde_step_with_logprob(model_output, sample, self.sigmas, index, self.noise_level, **kwargs)


def flow_sampler(scheduler_config: dict[str, Any], num_steps: int, noise_level: float, resolution: int,
                 vae_scale: int) -> FlowSDESampler:
    """The SDE over a ``FlowMatchEulerDiscreteScheduler`` config's sigmas: its ``shift`` (SD3), or with
    ``use_dynamic_shifting`` FLUX's shift for ``(resolution / vae_scale / 2)^2`` image tokens."""
    from .flow import dynamic_shift_mu

    c, mu = scheduler_config, None
    n_train = int(c.get("num_train_timesteps", 1000))
    if c.get("use_dynamic_shifting"):
        mu = dynamic_shift_mu((resolution // vae_scale // 2) ** 2, c.get("base_image_seq_len", 256),
                              c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    return FlowSDESampler(flow_inference_sigmas(num_steps, n_train, float(c.get("shift", 1.0)), mu=mu),
                          noise_level=noise_level, num_train_timesteps=n_train)


Sampler = DDIMSampler | FlowSDESampler


@dataclass
class Trajectory:
    """A sampled batch: ``latents`` ``[B, N + 1, ...]`` (``x_T`` first, the final sample last), ``log_probs``
    ``[B, N]`` (``None`` for a deterministic sampler), ``timesteps`` ``[B, N]`` (what the denoiser saw); float32."""

    latents: torch.Tensor
    log_probs: torch.Tensor | None
    timesteps: torch.Tensor

    @property
    def final(self) -> torch.Tensor:
        """The generated latents ``[B, ...]``."""
        return self.latents[:, -1]


@torch.no_grad()
def sample_with_logprobs(denoiser_fn: Denoiser, latents: torch.Tensor, sampler: Sampler,
                         generator: torch.Generator | None = None) -> Trajectory:
    """Run ``sampler`` from ``latents`` with ``denoiser_fn`` without autograd, each step's noise from ``generator``
    (same state -> same trajectory): a :class:`Trajectory` of latents, log-probabilities and timesteps."""
    x = latents.float()
    b = x.shape[0]
    stochastic = (sampler.eta if isinstance(sampler, DDIMSampler) else sampler.noise_level) > 0
    states, log_probs, timesteps = [x], [], []
    for i in range(sampler.num_steps):
        index = torch.full((b,), i, dtype=torch.long, device=x.device)
        t = sampler.model_timesteps(index)
        step = sampler.step(denoiser_fn(x, t), x, index, generator=generator if stochastic else None)
        x = step.prev_sample
        states.append(x)
        timesteps.append(t)
        if step.log_prob is not None:
            log_probs.append(step.log_prob)
    return Trajectory(torch.stack(states, dim=1), torch.stack(log_probs, dim=1) if log_probs else None,
                      torch.stack(timesteps, dim=1))


def rescore(denoiser_fn: Denoiser, sampler: Sampler, trajectory: Trajectory, step: int | torch.Tensor) -> DenoiseStep:
    """The log-probability under ``denoiser_fn`` of the stored transition ``latents[:, j] -> latents[:, j + 1]``
    (``j = step``, an int or ``[B]``), with autograd; the sampling denoiser reproduces the sampled values."""
    b = trajectory.latents.shape[0]
    j = _rows(step, b, trajectory.latents.device, "step").long()
    if bool((j < 0).any()) or bool((j >= sampler.num_steps).any()):
        raise ValueError(f"step must be in [0, {sampler.num_steps - 1}], got {j.tolist()}")
    rows = torch.arange(b, device=j.device)
    x, x_prev = trajectory.latents[rows, j], trajectory.latents[rows, j + 1]
    t = sampler.model_timesteps(j)
    return sampler.step(denoiser_fn(x, t), x, j, prev_sample=x_prev)


def train_step_indices(batch_size: int, num_steps: int, fraction: float, generator: torch.Generator | None = None,
                       shuffle: bool = True) -> torch.Tensor:
    """The ``K = int(num_steps * fraction)`` denoising steps each row trains on, ``[batch_size, K]``: a random
    subset per row with ``shuffle`` (DDPO), else the first ``K``."""
    k = int(num_steps * fraction)
    if not shuffle:
        return torch.arange(k).expand(batch_size, k).clone()
    return torch.stack([torch.randperm(num_steps, generator=generator)[:k] for _ in range(batch_size)])


# --- advantages and the policy loss -----------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, *, std: str = "group", unbiased: bool = False,
                     eps: float = 1e-4, clip: float | None = None) -> torch.Tensor:
    """Group-relative advantages of ``[B]`` rewards in consecutive groups of ``group_size``: ``(r - mean_group) /
    (s + eps)`` with ``s`` the group's std (``"group"``), the batch's (``"global"``) or 1 (``"none"``, Dr. GRPO);
    ``unbiased=False`` as Flow-GRPO and DDPO. Equal rewards give exactly 0; ``clip`` clamps to ``[-clip, clip]``."""
    if std not in ("group", "global", "none"):
        raise ValueError(f"std={std!r}; use 'group', 'global' or 'none'.")
    r = rewards.reshape(-1).float()
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of diffusion.group_size={group_size}.")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    g = r.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    flat = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)).expand_as(g)
    if std == "group":
        s = g.std(dim=1, unbiased=unbiased, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        adv = centred / (s + eps)
    elif std == "global":
        s = r.std(unbiased=unbiased) if r.numel() > 1 else torch.zeros(())
        adv = centred / (s + eps)
    else:
        adv = centred
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.reshape(-1)


def _mean(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x.mean()``, or with ``keep`` (``[B]`` bool) the mean over the kept rows (0 if none; the graph stays)."""
    if keep is None:
        return x.mean()
    k = keep.reshape((-1,) + (1,) * (x.ndim - 1)).expand_as(x)
    return torch.where(k, x, torch.zeros_like(x)).sum() / k.sum().clamp(min=1)


class PromptStatTracker:
    """DDPO's per-prompt stat tracker: advantages ``(r - mean) / (std + 1e-6)`` over each prompt's last
    ``buffer_size`` rewards once it holds ``min_count``, over the update's rewards before; the buffers are state."""

    def __init__(self, buffer_size: int, min_count: int, std: str = "group") -> None:
        self.buffer_size, self.min_count, self.std = buffer_size, min_count, std
        self.buffers: dict[str, list[float]] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Advantages ``[B]`` float32 of ``[B]`` rewards of ``prompts``, after adding them to the buffers."""
        r = rewards.reshape(-1).double()
        if len(prompts) != r.numel() or not bool(torch.isfinite(r).all()):
            raise ValueError(f"{r.numel()} rewards for {len(prompts)} prompts, or not finite: {r.tolist()}")
        adv = torch.zeros_like(r)
        for p in dict.fromkeys(prompts):
            rows = torch.tensor([i for i, q in enumerate(prompts) if q == p])
            self.buffers[p] = (self.buffers.get(p, []) + r[rows].tolist())[-self.buffer_size:]
            stats = torch.tensor(self.buffers[p], dtype=torch.float64) if len(self.buffers[p]) >= self.min_count else r
            if stats.max() == stats.min():
                continue
            s = {"group": stats, "global": r}.get(self.std)
            adv[rows] = (r[rows] - stats.mean()) / (1.0 if s is None else s.std(unbiased=False) + 1e-6)
        return adv.float()

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {p: list(v) for p, v in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {p: [float(x) for x in v] for p, v in state["buffers"].items()}


def clipped_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        clip_range: float, adv_clip_max: float | None = None, keep: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped importance-ratio loss on denoising steps (DDPO, Flow-GRPO): ``mean(max(-A ratio, -A
    clamp(ratio, 1 - clip_range, 1 + clip_range)))`` over ``[B]`` or ``[B, K]`` log-probs and the rows in ``keep``.
    Returns ``(loss, stats)`` with ``approx_kl``, ``clipfrac`` and ``ratio_mean``."""
    if not clip_range > 0:
        raise ValueError(f"diffusion.clip_range={clip_range} must be > 0 (DDPO and Flow-GRPO default to 1e-4).")
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(f"log_prob shape {tuple(log_prob.shape)} != old_log_prob shape {tuple(old_log_prob.shape)}")
    adv = advantages.float().reshape(-1)
    if adv.shape[0] != log_prob.shape[0]:
        raise ValueError(f"{adv.shape[0]} advantages for {log_prob.shape[0]} rows")
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    adv = adv.reshape((-1,) + (1,) * (log_prob.ndim - 1))
    diff = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(diff)
    loss = _mean(torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)), keep)
    stats = {"approx_kl": 0.5 * _mean(diff.detach() ** 2, keep),
             "clipfrac": _mean(((ratio.detach() - 1.0).abs() > clip_range).float(), keep),
             "ratio_mean": _mean(ratio.detach(), keep)}
    return loss, stats


@register_policy_loss("diffusion_grpo")
def _diffusion_grpo_policy_loss(x: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`clipped_policy_loss` as the policy loss ``diffusion_grpo`` (``x.mask`` and the aggregation do not
    apply; ``settings.adv_clip_max`` 0 = no clamp)."""
    return clipped_policy_loss(x.logprobs, x.old_logprobs, x.advantages, settings.clip_range,
                               settings.adv_clip_max or None)


def kl_to_reference(prev_sample_mean: torch.Tensor, ref_prev_sample_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """Per-row KL penalty towards the reference step, ``mean_dims((mean - ref_mean)^2) / (2 std^2)`` ``[B]``: the
    Gaussians' KL with ``std = noise_std``; Flow-GRPO's (``std_dev_t``) is that times ``-dt`` on a flow step."""
    if prev_sample_mean.shape != ref_prev_sample_mean.shape:
        raise ValueError(f"mean shape {tuple(prev_sample_mean.shape)} != reference mean shape "
                         f"{tuple(ref_prev_sample_mean.shape)}")
    sq = (prev_sample_mean.float() - ref_prev_sample_mean.float()) ** 2
    return sq.mean(dim=tuple(range(1, sq.ndim))) / (2 * std.float().reshape(-1) ** 2)


def diffusion_grpo_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float, *,
    adv_clip_max: float | None = None, kl_coef: float = 0.0, prev_sample_mean: torch.Tensor | None = None,
    ref_prev_sample_mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step's Flow-GRPO objective, :func:`clipped_policy_loss` ``+ kl_coef * mean(kl_to_reference)`` over the
    rows in ``keep``; ``(loss, stats)`` with ``policy_loss`` and ``kl`` added."""
    policy, stats = clipped_policy_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max, keep)
    stats["policy_loss"] = policy.detach()
    if kl_coef == 0:
        return policy, stats
    if prev_sample_mean is None or ref_prev_sample_mean is None or std is None:
        raise ValueError("diffusion.kl_coef > 0 needs prev_sample_mean, ref_prev_sample_mean and std "
                         "(a roles.ref denoiser re-scoring the same step).")
    kl = _mean(kl_to_reference(prev_sample_mean, ref_prev_sample_mean, std), keep)
    stats["kl"] = kl.detach()
    return policy + kl_coef * kl, stats


def grpo_step_loss(now: DenoiseStep, ref: DenoiseStep | None, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   settings: DiffusionGRPOSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The diffusion_grpo loss on one trained step (policy ``now`` vs reference ``ref``, ``std = std_dev_t``),
    without zero-advantage rows when ``settings.drop_zero_advantages``."""
    keep = advantages != 0 if settings.drop_zero_advantages else None
    return diffusion_grpo_loss(now.log_prob, old_log_prob, advantages, settings.clip_range,
                               adv_clip_max=settings.adv_clip_max, kl_coef=settings.kl_coef,
                               prev_sample_mean=now.prev_sample_mean, std=now.std_dev_t, keep=keep,
                               ref_prev_sample_mean=None if ref is None else ref.prev_sample_mean)


# --- Diffusion-DPO ---------------------------------------------------------------------------------------
class DPOStats(NamedTuple):
    """Detached: ``implicit_acc`` (pairs ranked correctly relative to the reference), ``model_mse`` / ``ref_mse``
    and ``margin`` ``[B]`` (the logit inside the sigmoid)."""

    implicit_acc: torch.Tensor
    model_mse: torch.Tensor
    ref_mse: torch.Tensor
    margin: torch.Tensor


def diffusion_dpo_loss_from_losses(model_losses_w: torch.Tensor, model_losses_l: torch.Tensor,
                                   ref_losses_w: torch.Tensor, ref_losses_l: torch.Tensor,
                                   beta: float) -> tuple[torch.Tensor, DPOStats]:
    """Diffusion-DPO (Wallace et al., 2024) from per-pair denoising losses ``[B]``:
    ``-mean(logsigmoid(-beta / 2 * ((l_w - l_l) - (ref_w - ref_l))))``."""
    if not beta > 0:
        raise ValueError(f"dpo.beta={beta} must be > 0 (diffusers' script uses 2500 for SD 1.5, 5000 for SDXL).")
    shapes = {tuple(t.shape) for t in (model_losses_w, model_losses_l, ref_losses_w, ref_losses_l)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"the four per-pair losses must all have shape [B], got {sorted(shapes)}")
    model_diff = model_losses_w.float() - model_losses_l.float()
    ref_diff = (ref_losses_w.float() - ref_losses_l.float()).detach()
    inside = -0.5 * beta * (model_diff - ref_diff)
    loss = -F.logsigmoid(inside).mean()
    stats = DPOStats(
        implicit_acc=(inside.detach() > 0).float().mean(),
        model_mse=0.5 * (model_losses_w.detach().float().mean() + model_losses_l.detach().float().mean()),
        ref_mse=0.5 * (ref_losses_w.detach().float().mean() + ref_losses_l.detach().float().mean()),
        margin=inside.detach(),
    )
    return loss, stats


def diffusion_dpo_loss(model_pred: torch.Tensor, ref_pred: torch.Tensor, target: torch.Tensor,
                       beta: float) -> tuple[torch.Tensor, DPOStats]:
    """Diffusion-DPO on a ``[2B, ...]`` batch laid out as diffusers' ``train_diffusion_dpo.py`` (chosen first,
    pairs sharing noise and timestep); per-sample ``mean_dims((pred - target)^2)`` for any regression target
    (epsilon, v, flow velocity), ``ref_pred`` constant. Returns ``(loss, DPOStats)``."""
    if not (model_pred.shape == ref_pred.shape == target.shape):
        raise ValueError(f"shapes differ: model_pred {tuple(model_pred.shape)}, ref_pred {tuple(ref_pred.shape)}, "
                         f"target {tuple(target.shape)}")
    if model_pred.shape[0] % 2:
        raise ValueError(f"a DPO batch is [2B, ...] (chosen then rejected); got {model_pred.shape[0]} rows")
    dims = tuple(range(1, model_pred.ndim))
    model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=dims)
    ref_losses = F.mse_loss(ref_pred.detach().float(), target.float(), reduction="none").mean(dim=dims)
    mw, ml = model_losses.chunk(2)
    rw, rl = ref_losses.chunk(2)
    return diffusion_dpo_loss_from_losses(mw, ml, rw, rl, beta)


def paired(x: torch.Tensor) -> torch.Tensor:
    """The first half of ``x`` ``[2B, ...]`` repeated twice: the noise and timesteps a chosen image and its rejected
    partner share in Diffusion-DPO (``x.chunk(2)[0].repeat(2, ...)``)."""
    if x.shape[0] % 2:
        raise ValueError(f"paired needs an even batch ([2B, ...]), got {x.shape[0]} rows")
    half = x[: x.shape[0] // 2]
    return torch.cat([half, half], dim=0)
