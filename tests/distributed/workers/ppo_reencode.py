"""rlhf_ppo through the recipe with a reward model on another tokenizer: a *ForSequenceClassification folder (as
TRL saves one) with a sub-word BPE tokenizer is the reward (ZeRO-3, frozen) and the critic (ZeRO-3, trained)
of a word-level actor. Checks that the rollout's reward scores are those of the same texts encoded directly with
the reward model's tokenizer (and not those of the actor's ids), that the critic reads those re-encoded rows, and
that two PPO steps train; the critic is exported with its own tokenizer."""

import os

import torch
import torch.distributed as dist
from common import dump, out_dir
from multiengine.engines import EngineRegistry, write_summary
from multiengine.engines.settings import track_reads
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PairCollator, _pad
from multiengine.pipelines.rlhf.scoring import eval_mode, sequence_scores
from multiengine.recipes.language.config import load_config
from multiengine.recipes.rlhf_ppo import RLHFPPO

root = out_dir()
assets_dir, rm_dir = os.path.join(root, "assets"), os.path.join(root, "trl_reward")
EngineRegistry()  # the process group, so rank 0 can build the folders first
if int(os.environ.get("RANK", "0")) == 0:
    from transformers import OPTConfig, OPTForSequenceClassification

    tiny.prepare_builtin(assets_dir, hidden=32, layers=1, n_sft=16, n_reward=16, n_ppo=64, n_eval=16)
    bpe = tiny.train_bpe_tokenizer(tiny.task_vocabulary() * 3, rm_dir)
    config = OPTConfig(vocab_size=len(bpe), hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.0, num_labels=1,
                       pad_token_id=bpe.pad_token_id, bos_token_id=bpe.bos_token_id, eos_token_id=bpe.eos_token_id)
    torch.manual_seed(0)
    model = OPTForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores that differ clearly between sequences
    model.save_pretrained(rm_dir)
dist.barrier()

cfg = load_config("rlhf_ppo", "tiny", [
    f"output_dir={os.path.join(root, 'run')}", f"roles.actor.model={assets_dir}/model", f"roles.reward.model={rm_dir}",
    f"data.source={assets_dir}/data", "max_steps=2", "ppo.rollout_batch_size=4", "roles.actor.micro_batch_size=2",
    "roles.critic.micro_batch_size=2", "ppo.epochs=1", "generation.max_new_tokens=6", "roles.actor.stage=2",
    "roles.critic.stage=3",
    "eval.size=8", "eval.batch_size=4", "eval.every=0", "eval.greedy=false", "checkpoint.every=0", "plot=false",
    "tensorboard=false", "export.ema=false"])
track_reads()  # the run's key reads, written at its end (Recipe.main's record, step by step here)
run = RLHFPPO(cfg)
run.setup()
registry = run.registry
result = {"reencoded": {k: v is not None for k, v in run.retokenizers.items()},
          "stages": {name: registry.describe()[name]["stage"] for name in ("reward", "critic")}}

# 1. one rollout, then the same texts scored directly in the reward model's own encoding
exp = run.trainer.make_experience(next(run.prompts), 0)
reward_tok = run.tokenizers["reward"]
budget = run.retokenizers["reward"].encoder.max_prompt_len
direct = PairCollator(reward_tok, budget, budget)
eos = run.tokenizer.eos_token_id
rows = []
for b in range(exp.sequences.shape[0]):
    actions = exp.response_ids[b][exp.action_mask[b]]
    ended = bool(actions.numel()) and int(actions[-1]) == eos
    rows.append(direct.pair_ids(exp.prompts[b], exp.responses[b], eos=ended))
ids = _pad(rows, direct.pad_id, left=False)
mask = _pad([[1] * len(r) for r in rows], 0, left=False)
with eval_mode(registry, "reward") as engine:
    direct_scores = sequence_scores(engine, ids, mask).float()
    raw_scores = sequence_scores(engine, exp.sequences, exp.attention_mask).float()  # the actor's ids, unconverted
got = exp.reward_parts["reward"]
result["score_diff"] = (got - direct_scores).abs().max().item()
result["raw_diff"] = (got - raw_scores).abs().max().item()
result["scores"] = got.tolist()
result["texts"] = list(zip(exp.prompts, exp.responses))
result["critic_rows_equal"] = exp.critic_sequences is not None and torch.equal(exp.critic_sequences.cpu(), ids)
result["critic_index_ok"] = exp.critic_index is not None and bool(
    (exp.critic_index < exp.critic_attention_mask.sum(-1, keepdim=True)).all())
result["values_finite"] = bool(torch.isfinite(exp.values).all())

# 2. two PPO steps through the recipe (the critic trains on the re-encoded rows), export and summary
import deepspeed  # noqa: E402

with deepspeed.zero.GatheredParameters(list(registry.role("critic").module.value_head.parameters())):
    head_before = registry.role("critic").module.value_head.weight.detach().clone()
run.train()
with deepspeed.zero.GatheredParameters(list(registry.role("critic").module.value_head.parameters())):
    head_after = registry.role("critic").module.value_head.weight.detach().clone()
result["critic_head_moved"] = (head_after - head_before).abs().max().item()
result["steps"] = [{k: m[k] for k in ("reward/mean", "value_loss", "policy_loss") if k in m} for m in run.step_metrics]
export = run.export()
summary = run.summary(export)
summary["plot"] = run.plot()
if registry.is_main:
    write_summary(run.path("summary.json"), summary)
run.close()
run.write_key_reads()
result["export"] = {k: v["model"] for k, v in export.items()}
result["reward_vocab"] = len(reward_tok)
result["actor_vocab"] = len(run.tokenizer)
dump(result)
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown
