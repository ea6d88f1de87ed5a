"""RLHF step 3 on 2 ranks, several registries in one process group (one launch keeps the test short):

  zero2     actor/critic ZeRO-2 (ref/reward follow: stage 0), 2 PPO steps
  zero3     actor/critic/ref/reward ZeRO-3 (ref gathered once per forward), the same 2 steps (same seed);
            then greedy generation gathered once vs per token (synced_gpus), a PPO step timed in each
            mode, and exports of actor + critic
  mixed     actor ZeRO-3, critic ZeRO-2, reward ZeRO-2 (built at stage 0), ref ZeRO-3 with parameter
            offload, EMA at stage 3, pretraining (ptx) loss, critic warm-up, gradient checkpointing
  lora      LoRA actor (ZeRO-3) and LoRA critic (ZeRO-2): base weights stay equal to ref's; LoRA exports
  resume    the rlhf_ppo recipe: 4 steps with a checkpoint at 2, then a second run resumed from it

argv: out_dir
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch
from common import dump, gathered_state_dict, out_dir
from multiengine.engines import (
    EngineRegistry,
    LoraSpec,
    OptimSpec,
    Placement,
    ShardedBatches,
    apply_lora,
    barrier,
    frozen_role,
    save_role,
    trainable_role,
)
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PromptCollator, SFTCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.generation import GenerationSettings, generate
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer
from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model
from multiengine.pipelines.rlhf.rollout import RolloutSpec
from multiengine.recipes import rlhf_ppo
from multiengine.recipes.language.config import load_config
from transformers import AutoTokenizer

ROOT = out_dir()
ASSETS = os.path.join(ROOT, "assets")
KEYS = ("reward/mean", "reward/std", "kl", "policy_loss", "value_loss", "approx_kl", "clip_frac", "entropy",
        "response_length", "judge/mean")

registry0 = EngineRegistry()  # the process group; rank 0 writes the tiny assets
if registry0.is_main:
    tiny.prepare_builtin(ASSETS, seed=0, hidden=32, layers=2, n_sft=256, n_reward=64, n_ppo=256, n_eval=32)
barrier()
MODEL = os.path.join(ASSETS, "model")
TOKENIZER = AutoTokenizer.from_pretrained(MODEL)
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
PROMPTS = load_rlhf_dataset(os.path.join(ASSETS, "data"), "ppo")
COLLATE = PromptCollator(TOKENIZER, 16)


LORA = LoraSpec(rank=4, target_modules=("q_proj", "k_proj", "v_proj", "out_proj"))


def stream(rows, collate, batch_size: int, registry: EngineRegistry, seed: int) -> ShardedBatches:
    return ShardedBatches(rows, collate, batch_size, registry.world_size, registry.rank, seed=seed)


def decode(ids: torch.Tensor) -> list[str]:
    return TOKENIZER.batch_decode(ids.cpu(), skip_special_tokens=True)


def build(actor_stage: int, critic_stage: int, ref: Placement | None = None, reward: Placement | None = None,
          ema: bool = False, lora: bool = False, settings: PPOSettings | None = None, lr: float = 1e-3,
          mode: str = "gather", checkpointing: bool = False) -> tuple[EngineRegistry, PPOTrainer]:
    registry = EngineRegistry()
    opt = OptimSpec(lr=lr, betas=(0.9, 0.95), total_steps=10)
    lora_cfg = LORA if lora else None
    actor, critic = Placement(actor_stage, "fp32"), Placement(critic_stage, "fp32")
    reward = reward or critic
    trained = {"micro_batch_size": 2, "lora": lora_cfg, "gradient_checkpointing": checkpointing, "seed": 0}
    registry.add(trainable_role("actor", causal_lm(MODEL), actor, opt, **trained))
    registry.add(frozen_role("ref", causal_lm(MODEL), ref or actor))
    registry.add(trainable_role("critic", scalar_model(MODEL, zero3=critic_stage == 3), critic, opt, **trained))
    registry.add(frozen_role("reward", scalar_model(MODEL, zero3=reward.stage == 3), reward))
    if ema:
        registry.add(frozen_role("ema", causal_lm(MODEL), actor, stateful=True, lora=lora_cfg, seed=0))
    registry.build()
    settings = settings or PPOSettings(rollout_batch_size=4, epochs=2)
    spec = RolloutSpec(GenerationSettings(max_new_tokens=6, mode=mode), EOS, PAD, decode=decode, judge=tiny.judge,
                       critic="critic")
    trainer = PPOTrainer(registry, settings, spec, 2, ema_decay=0.992 if ema else None)
    return registry, trainer


def run_steps(registry: EngineRegistry, trainer: PPOTrainer, n: int, ptx=None,
              start: int = 0) -> list[dict[str, float]]:
    prompts = stream(PROMPTS, COLLATE, trainer.settings.rollout_batch_size, registry, seed=start)
    out = []
    for step in range(start, start + n):
        metrics = trainer.step(next(prompts), step, ptx)
        out.append({k: metrics[k] for k in KEYS if k in metrics} | {"time/step_s": metrics["time/step_s"]})
    return out


def free(*objs) -> None:
    del objs
    gc.collect()
    barrier()


result: dict = {}

# --- zero2 vs zero3: same seed, same rewards and losses --------------------------------------------------
registry, trainer = build(2, 2)
result["zero2"] = {"steps": run_steps(registry, trainer, 2),
                   "stages": {r.name: r.stage for r in registry.roles()}}
free(registry, trainer)

registry, trainer = build(3, 3, ref=Placement(3, "fp32", gather_forward=True))
result["zero3"] = {"steps": run_steps(registry, trainer, 2),
                   "stages": {r.name: r.stage for r in registry.roles()}}

# --- gathered once vs per token (synced_gpus), greedy --------------------------------------------------
batch = COLLATE([PROMPTS[i] for i in range(registry.rank * 8, registry.rank * 8 + 8)])
ids, mask = batch["input_ids"].to(registry.device), batch["attention_mask"].to(registry.device)
tokens, timing = {}, {}
for mode in ("gather", "per_token", "gather"):
    gen = GenerationSettings(max_new_tokens=12, do_sample=False, mode=mode)
    t0 = time.perf_counter()
    out = generate(registry, ids, mask, gen, EOS, PAD)
    timing[mode] = (time.perf_counter() - t0) / out.shape[1]  # the second "gather" run is the warm one
    tokens[mode] = out.tolist()
    # sampled with the same seed: a random tiny model's greedy answers repeat one token, samples do not
    torch.manual_seed(7 + registry.rank)
    tokens[f"{mode}_sampled"] = generate(registry, ids, mask, GenerationSettings(12, mode=mode), EOS, PAD).tolist()
step_times = {}
prompts = stream(PROMPTS, COLLATE, 4, registry, seed=0)
for mode in ("gather", "per_token"):
    trainer.spec = dataclasses.replace(trainer.spec, generation=GenerationSettings(max_new_tokens=6, mode=mode))
    step_times[mode] = trainer.step(next(prompts), 10, None)["time/step_s"]
result["generation"] = {"tokens": tokens, "s_per_token": timing, "ppo_step_s": step_times,
                        "partitioned": all(hasattr(p, "ds_tensor") for p in registry["actor"].module.parameters())}
# still partitioned after the gathered generation (hooks re-attached, shards released)
result["generation"]["shard_numel_after"] = [p.ds_tensor.numel() for p in registry["actor"].module.parameters()][:4]
result["generation"]["full_numel"] = [p.ds_numel for p in registry["actor"].module.parameters()][:4]

# --- exports of a ZeRO-3 actor and critic, and reference outputs to compare a reload against ------------
probe = torch.tensor([[TOKENIZER.bos_token_id] + TOKENIZER("list 3 fruits :", add_special_tokens=False)["input_ids"]])
with torch.no_grad(), registry.gathered("actor", "critic"):
    logits = registry.role("actor").module(input_ids=probe.to(registry.device)).logits[0, -1].tolist()
    values = registry.role("critic").module(probe.to(registry.device), torch.ones_like(probe)).tolist()
export_root = os.path.join(ROOT, "export_zero3")
result["export"] = {
    "actor": save_role(registry, "actor", os.path.join(export_root, "actor"), tokenizer=TOKENIZER),
    "critic": save_role(registry, "critic", os.path.join(export_root, "critic"), tokenizer=TOKENIZER),
    "probe": probe.tolist(), "logits": logits, "values": values,
}
free(registry, trainer)

# --- mixed placements: actor Z3, critic Z2, reward Z2 (-> 0), ref Z3 + param offload; EMA, ptx, warm-up -----
settings = PPOSettings(rollout_batch_size=4, epochs=1, ptx_coef=0.5, critic_warmup_steps=1, dual_clip=3.0,
                       adaptive_kl=True, kl_target=0.1, kl_horizon=100)
registry, trainer = build(3, 2, ref=Placement(3, "fp32", offload_params=True), reward=Placement(2, "fp32"),
                          ema=True, settings=settings, checkpointing=True)
sft_rows = load_rlhf_dataset(os.path.join(ASSETS, "data"), "sft")
ptx = stream(sft_rows, SFTCollator(TOKENIZER, 16, 16), 2, registry, seed=1)
actor_before = gathered_state_dict(registry, "actor")
steps = run_steps(registry, trainer, 1, ptx)  # critic warm-up: the actor must not move
actor_warm = gathered_state_dict(registry, "actor")
steps += run_steps(registry, trainer, 1, ptx, start=1)
actor_after = gathered_state_dict(registry, "actor")
ema_after = gathered_state_dict(registry, "ema")
mixed = {"steps": steps, "describe": {k: {"stage": v["stage"], "requested_stage": v["requested_stage"],
                                          "offload": v["config"]["zero_optimization"].get("offload_param", {})}
                                      for k, v in registry.describe().items()},
         "memory": {row["role"]: row for row in registry.memory_report()},
         "kl_coef": trainer.kl_ctl.value,
         "checkpointing": {name: any(getattr(m, "gradient_checkpointing", False) is True
                                     for m in registry.role(name).module.modules()) for name in ("actor", "critic")}}
if registry.is_main:
    diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    mixed["actor_change_warmup"] = diff(actor_before, actor_warm)
    mixed["actor_change_after"] = diff(actor_warm, actor_after)
    mixed["ema_minus_actor"] = diff(ema_after, actor_after)
    mixed["ema_minus_before"] = diff(ema_after, actor_before)
result["mixed"] = mixed
free(registry, trainer, actor_before, actor_warm, actor_after, ema_after)

# --- LoRA actor (ZeRO-3) and critic (ZeRO-2): only adapters (and the value head) train ----------------------
registry, trainer = build(3, 2, lora=True, lr=1e-2)
trainable = {name: [n for n, p in registry.role(name).module.named_parameters() if p.requires_grad]
             for name in ("actor", "critic")}
lora_before = gathered_state_dict(registry, "actor")
lora_steps = run_steps(registry, trainer, 2)
lora_after = gathered_state_dict(registry, "actor")
ref_state = gathered_state_dict(registry, "ref")
lora = {"steps": lora_steps, "trainable": trainable,
        "export_actor": save_role(registry, "actor", os.path.join(ROOT, "export_lora", "actor"), tokenizer=TOKENIZER),
        "export_critic": save_role(registry, "critic", os.path.join(ROOT, "export_lora", "critic"),
                                   tokenizer=TOKENIZER)}
if registry.is_main:
    base = {k: v for k, v in lora_after.items() if "lora_" not in k}
    lora["base_change"] = max((lora_before[k] - base[k]).abs().max().item() for k in base)
    lora["lora_change"] = max((lora_before[k] - lora_after[k]).abs().max().item() for k in lora_after if "lora_" in k)
    # actor base weights vs ref: "base_model.model.<name>.base_layer.weight" -> "<name>.weight"
    ref_diff, matched = 0.0, 0
    for key, value in base.items():
        plain = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if plain in ref_state:
            ref_diff = max(ref_diff, (ref_state[plain] - value).abs().max().item())
            matched += 1
    lora["base_vs_ref"] = ref_diff
    lora["matched"] = matched
    lora["ref_tensors"] = len(ref_state)
    with torch.no_grad():
        from multiengine.pipelines.rlhf.roles import load_causal_lm

        twin = apply_lora(load_causal_lm(MODEL), LORA, seed=0)
        twin.load_state_dict(lora_after, strict=False)
        lora["twin_logits"] = twin(input_ids=probe).logits[0, -1].tolist()
result["lora"] = lora
free(registry, trainer, lora_before, lora_after, ref_state)

# --- resume through the recipe: stage-3 actor and critic, EMA, adaptive KL, ptx ------------------------------
COMMON = [
    f"roles.actor.model={MODEL}", f"roles.reward.model={MODEL}", f"data.source={os.path.join(ASSETS, 'data')}",
    "max_steps=4", "checkpoint.every=2", "eval.every=0", "eval.size=8", "eval.batch_size=4", "eval.greedy=false",
    "ppo.rollout_batch_size=4", "roles.actor.micro_batch_size=2", "roles.critic.micro_batch_size=2",
    "ppo.epochs=1", "ppo.adaptive_kl=true", "ppo.kl_target=0.05",
    "ppo.ptx_coef=0.1", "roles.actor.stage=3", "roles.critic.stage=3", "roles.actor.lr=1e-3",
    "roles.critic.lr=1e-3", "roles.actor.scheduler=cosine", "ema.enabled=true", "export.enabled=false", "plot=false",
    "generation.max_new_tokens=6",
]


def recipe_run(name: str, *overrides: str) -> dict:
    """A run of the recipe through its main (summary.json and the key reads written), probed at its end."""
    probe: dict = {}

    class Probed(rlhf_ppo.RLHFPPO):
        def train(self) -> None:
            probe["start"] = self.step
            super().train()

        def close(self) -> None:
            probe.update(steps=[{k: m[k] for k in (*KEYS, "kl_coef") if k in m} for m in self.step_metrics],
                         prompts=self.prompts.state_dict(), kl_coef=self.trainer.kl_ctl.value,
                         lr=self.registry["actor"].get_lr()[0], eval_after=self.history[-1]["judge"],
                         out_dir=self.output_dir)
            super().close()

    Probed.main(load_config("rlhf_ppo", None, [*COMMON, f"output_dir={os.path.join(ROOT, name)}", *overrides]))
    free()
    return probe


full = recipe_run("full")
ckpt = os.path.join(ROOT, "full", "checkpoints", "step_00000002")
result["resume"] = {"full": full, "resumed": recipe_run("resumed", f"resume_from={ckpt}")}
dump(result)
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown
