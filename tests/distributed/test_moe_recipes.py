"""Tiny mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) through rlhf_sft, rlhf_reward, rlhf_dpo,
rlhf_grpo and rlhf_ppo on 2 ranks, every role MoE and at ZeRO-3, the ranks given different rows (workers/
moe_recipes.py, one launch with a timeout: a hang fails it): every run finishes and logs the router's auxiliary loss
and the experts' load; Qwen3-MoE's config asks for router logits (``output_router_logits: true``) through every
recipe's generation and scoring; GRPO on an SFT'd Mixtral raises the judge; GRPO with router replay trains on the
rollout's routing and, in fp32, to the same figures; the exports load in plain transformers and answer and score as
the trained engines did. In the same launch: Mixtral's SFT and LoRA GRPO at ZeRO-2 (the adapter loads with peft and
moved only the attention projections); PPO with router replay in the actor and the ref; on-policy distillation of
a smaller OLMoE student, its routing replayed; GRPO with replay resumed from its step-2 checkpoint, bit-equal to
the uninterrupted run; bf16 GRPO with and without replay (its rollout log-prob mismatch printed)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import launch
from test_packed_passes import long_tailed_data

pytestmark = pytest.mark.distributed
FAMILIES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}
ROUTER_LOGITS = "qwen3_moe"  # its saved config has output_router_logits: true
RECIPES = ("sft", "reward", "dpo", "grpo", "ppo")
LAUNCH_TIMEOUT = 600  # a hang fails the test here
TOL = 1e-4


def runs_of(family: str) -> tuple[str, ...]:
    return tuple(r for r in RECIPES if not (family == "olmoe" and r == "reward"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("moe_recipes")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok", chat_template=True)
    folders = {f: str(tiny.build_tiny_causal_lm(root / f, root / "tok", family=f)) for f in FAMILIES}
    # distill's student: a smaller OLMoE (32 wide, 1 layer) on the teacher's tokenizer
    folders["olmoe_student"] = str(tiny.build_tiny_causal_lm(root / "olmoe_student", root / "tok", hidden=32,
                                                             layers=1, seed=1, family="olmoe"))
    config = root / ROUTER_LOGITS / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "output_router_logits": True}))
    (root / "dense").mkdir()
    (root / "dense" / "moe_env.py").write_text("def distinct_words(prompts, responses):\n"
                                               "    return [len(set(r.split())) / 6.0 for r in responses]\n")
    folders.update(data=str(long_tailed_data(root / "data")), dense=str(root / "dense"))
    (root / "folders.json").write_text(json.dumps(folders))
    t0 = time.perf_counter()
    ranks = launch("moe_recipes", root / "out", str(root / "folders.json"), timeout=LAUNCH_TIMEOUT)
    print(f"moe_recipes launch: {time.perf_counter() - t0:.0f} s")
    return {"ranks": ranks, "folders": folders, "out": root / "out"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_recipe_runs_at_zero3_on_every_moe_role(runs, family):
    r, name = runs["ranks"][0], FAMILIES[family]
    expected_roles = {"sft": {"actor"}, "reward": {"reward"}, "dpo": {"actor", "ref"}, "grpo": {"actor", "ref"},
                      "ppo": {"actor", "critic", "ref", "reward"}}
    for recipe in runs_of(family):
        run = r[f"{family}/{recipe}"]
        assert run["stages"] == dict.fromkeys(expected_roles[recipe], 3), (recipe, run["stages"])
        assert run["metrics"]["steps"] == run["steps"] == (3 if recipe == "reward" else 2), recipe
    classes = {f"{recipe}/{role}": e["class"] for recipe in runs_of(family) for role, e in
               r[f"{family}/{recipe}"]["exports"].items()}
    lm, seq_cls = f"{name}ForCausalLM", f"{name}ForSequenceClassification"
    expected = {"sft/actor": lm, "dpo/actor": lm, "grpo/actor": lm, "ppo/actor": lm}
    if family != "olmoe":  # transformers has no OlmoeForSequenceClassification: the critic is not exported
        expected.update({"reward/reward": seq_cls, "ppo/critic": seq_cls})
    assert classes == expected
    assert r[f"{family}/ppo"]["metrics"]["eval/after/kl"] > 0  # the actor moved


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_aux_loss_and_expert_load_are_logged(runs, family):
    for recipe in ("sft", "dpo", "grpo", "ppo"):
        last = runs["ranks"][0][f"{family}/{recipe}"]["last_moe"]  # the last step's
        assert last.keys() >= {"train/moe/aux_loss", "train/moe/load_max", "train/moe/load_min"}, (recipe, last)
        # top 2 of 4 experts: the loss is about 2 at an even load and at most 4 (every token on the same 2); each
        # expert's share of the choices over the even share (1) lies in [0, 2]
        assert 1 < last["train/moe/aux_loss"] <= 4, (recipe, last)
        assert 0 <= last["train/moe/load_min"] <= 1 <= last["train/moe/load_max"] <= 2, (recipe, last)


def test_router_logits_in_the_config_through_every_recipes_generation_and_scoring(runs):
    r, folder = runs["ranks"][0], runs["folders"][ROUTER_LOGITS]
    assert json.loads(open(f"{folder}/config.json").read())["output_router_logits"] is True
    # generation: evaluation answers (sft, dpo) and rollouts (grpo, ppo) to left-padded prompts of other lengths
    for recipe in ("sft", "dpo", "grpo", "ppo"):
        metrics = r[f"{ROUTER_LOGITS}/{recipe}"]["metrics"]
        assert metrics["eval/after/response_length"] > 0, (recipe, metrics)
    # scoring: the reward model's pair accuracy, PPO's critic values and reward scores, DPO's and GRPO's ref
    assert 0 <= r[f"{ROUTER_LOGITS}/reward"]["metrics"]["heldout_accuracy"] <= 1
    assert r[f"{ROUTER_LOGITS}/ppo"]["metrics"]["eval/after/kl"] > 0
    assert r[f"{ROUTER_LOGITS}/grpo"]["metrics"]["eval/after/kl"] > 0


def test_grpo_on_an_moe_actor_raises_the_judge(runs):
    sft, grpo = (runs["ranks"][0][f"judge/{r}"]["metrics"] for r in ("sft", "grpo"))
    assert sft["eval/after/judge"] > sft["eval/before/judge"] + 0.2, sft
    assert grpo["eval/before/judge"] == pytest.approx(sft["eval/after/judge"])  # GRPO starts from the SFT export
    assert grpo["eval/after/judge"] > grpo["eval/before/judge"] + 0.03, grpo


def test_router_replay_in_fp32_changes_nothing(runs):
    # the rollout's routing imposed on the trainer's passes: in fp32 they route alike, so the run's figures are the
    # unreplayed run's
    replayed, plain = (runs["ranks"][0][name] for name in ("replay/grpo", "qwen2_moe/grpo"))
    assert replayed["steps"] == 2 and replayed["stages"] == {"actor": 3, "ref": 3}
    # the trained tokens routed as recorded: all but each answer's last (sampled, never fed back: no record)
    assert 0.5 < replayed["last_moe"]["train/moe/replayed"] < 1, replayed["last_moe"]
    assert "train/moe/replayed" not in plain["last_moe"]
    figures = {k: v for k, v in plain["metrics"]["final"].items() if not k.startswith(("time/", "gen/", "step_time"))}
    assert {"policy_loss", "kl", "moe/aux_loss", "rollout/logprob_mismatch"} <= figures.keys()
    assert replayed["metrics"]["final"] == pytest.approx({**replayed["metrics"]["final"], **figures}, rel=1e-5,
                                                         abs=1e-7)


def _exported(runs) -> list[tuple[str, str]]:
    return [(f"{family}/{recipe}", role) for family in FAMILIES for recipe in runs_of(family)
            for role in {"reward": ("reward",), "ppo": ("actor", "critic")}.get(recipe, ("actor",))
            if not (family == "olmoe" and role == "critic")] + [("judge/sft", "actor"), ("judge/grpo", "actor")]


@pytest.mark.parametrize(("run", "role"), _exported(None))
def test_exports_load_in_plain_transformers_and_answer_as_in_training(runs, run, role):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ranks = [r[run]["record"][role] for r in runs["ranks"]]
    assert ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:  # the ranks' gathered weights answer alike
        assert torch.allclose(torch.tensor(ranks[0][key]).float(), torch.tensor(ranks[1][key]).float(), atol=TOL), key
    trained, path = ranks[0], runs["ranks"][0][run]["exports"][role]["path"]
    ids, mask = torch.tensor(trained["input_ids"]), torch.tensor(trained["attention_mask"])
    if role in ("reward", "critic"):
        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        with torch.no_grad():
            scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        assert (scores - torch.tensor(trained["scores"])).abs().max() < TOL, (scores, trained["scores"])
        return
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    # transformers' load_balancing_loss_func fails in generate's cached steps on left-padded rows: a user of a
    # config with output_router_logits: true turns it off to generate
    off = {"output_router_logits": False} if model.config.to_dict().get("output_router_logits") else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, **off)
    answers, answer_mask = out[:, ids.shape[1]:], torch.tensor(trained["answer_mask"]).bool()
    assert answers.shape[1] == answer_mask.shape[1]
    assert (answers * answer_mask).tolist() == (torch.tensor(trained["answers"]) * answer_mask).tolist()
    logprobs = torch.tensor(trained["logprobs"])
    gap = (answer_logprobs(model, ids, mask, answers, answer_mask) - logprobs).abs().max()
    assert gap < TOL, gap
    # the model trained on gives other log-probs: the comparison tells the export from its base
    family = run.split("/")[0]
    base = AutoModelForCausalLM.from_pretrained(runs["folders"]["mixtral" if family == "judge" else family]).eval()
    assert (answer_logprobs(base, ids, mask, answers, answer_mask) - logprobs).abs().max() > 10 * TOL


def answer_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, answers: torch.Tensor,
                    answer_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probs of the answers' tokens after the left-padded prompts (0 after an answer's EOS), positions
    counting real tokens as the trainer's."""
    seq, seq_mask = torch.cat([ids, answers], 1), torch.cat([mask, answer_mask.long()], 1)
    off = {"output_router_logits": False}  # no auxiliary loss of routers (transformers computes it for the config)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=seq_mask, position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0),
                       **off).logits
    logprobs = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), -1).gather(2, answers.unsqueeze(2))[..., 0]
    return logprobs * answer_mask


def _assert_moe_figures(last: dict, replayed: bool) -> None:
    assert last.keys() >= {"train/moe/aux_loss", "train/moe/load_max", "train/moe/load_min"}, last
    assert 1 < last["train/moe/aux_loss"] <= 4, last  # top 2 of 4 experts, as above
    assert 0 <= last["train/moe/load_min"] <= 1 <= last["train/moe/load_max"] <= 2, last
    if replayed:  # every trained token but a full-length answer's last routed as recorded
        assert 0.5 < last["train/moe/replayed"] <= 1, last
    else:
        assert "train/moe/replayed" not in last, last


def test_zero2_sft_and_lora_grpo_on_an_moe_actor(runs):
    r = runs["ranks"][0]
    sft, grpo = r["zero2/sft"], r["zero2/grpo"]
    assert sft["stages"] == {"actor": 2} and grpo["requested"] == {"actor": 2, "ref": 2}
    assert grpo["stages"] == {"actor": 2, "ref": 0}  # a frozen role has no grads or optimizer states to split
    assert sft["steps"] == grpo["steps"] == 2
    _assert_moe_figures(sft["last_moe"], replayed=False)
    _assert_moe_figures(grpo["last_moe"], replayed=False)
    assert sft["exports"]["actor"]["class"] == grpo["exports"]["actor"]["class"] == "MixtralForCausalLM"


def test_the_zero2_lora_grpo_export_loads_with_peft_and_answers_as_in_training(runs):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, base_path = runs["ranks"][0]["zero2/grpo"], runs["folders"]["mixtral"]
    path = run["exports"]["actor"]["path"]
    trained = run["record"]["actor"]
    ids, mask = torch.tensor(trained["input_ids"]), torch.tensor(trained["attention_mask"])
    answers, answer_mask = torch.tensor(trained["answers"]), torch.tensor(trained["answer_mask"]).bool()
    merged = AutoModelForCausalLM.from_pretrained(path).eval()
    # the merged export's log-probs of the engine's greedy answers are the trained engine's
    logprobs = answer_logprobs(merged, ids, mask, answers, answer_mask)
    assert (logprobs - torch.tensor(trained["logprobs"])).abs().max() < TOL
    # base + the peft adapter = the merged export
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), f"{path}/adapter").eval()
    assert (answer_logprobs(adapted, ids, mask, answers, answer_mask) - logprobs).abs().max() < TOL
    # only the attention projections the adapters sit on moved: the routers and the experts are the base's
    merged_w = {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(path, f)).items()}
    base_w = {k: v for f in sorted(os.listdir(base_path)) if f.endswith(".safetensors")
              for k, v in load_file(os.path.join(base_path, f)).items()}
    assert merged_w.keys() == base_w.keys()
    moved = {k for k in merged_w if not torch.equal(merged_w[k], base_w[k])}
    assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved), moved
    assert any(".experts." in k or "experts" in k.split(".")[-2] for k in base_w)


def test_ppo_with_router_replay_in_the_actor_and_the_ref(runs):
    replayed, plain = (runs["ranks"][0][name] for name in ("replay/ppo", "qwen3_moe/ppo"))
    assert replayed["steps"] == 2
    assert replayed["stages"] == {"actor": 3, "critic": 3, "ref": 3, "reward": 3}
    _assert_moe_figures(replayed["last_moe"], replayed=True)
    # in fp32 the rollout routes as the trainer would: the first step's experience (rewards, the ref's KL, the old
    # log-probs' mismatch, the critic's values) is the unreplayed run's; its update is not, as the second minibatch
    # runs on weights the first one moved, routed as recorded
    a, b = (_train_lines(runs["out"] / name)[0] for name in ("replay/ppo", "qwen3_moe/ppo"))
    experience = ("train/reward/total_mean", "train/reward/std", "train/kl", "train/rollout/logprob_mismatch",
                  "train/value_loss", "train/values/mean", "train/response_length")
    assert {k: a[k] for k in experience} == pytest.approx({k: b[k] for k in experience}, rel=1e-6, abs=1e-9)


def test_on_policy_distillation_of_an_moe_student_replays_its_routing(runs):
    run = runs["ranks"][0]["replay/distill"]
    assert run["steps"] == 2 and run["stages"] == {"teacher": 3, "student": 3}
    assert run["metrics"]["train/on_policy_share"] == 1.0
    _assert_moe_figures(run["last_moe"], replayed=True)
    assert run["exports"]["student"]["class"] == "OlmoeForCausalLM"


RESUME_TIMING = ("train/time/", "train/step_time_s", "train/gen/")  # timings (generation's tokens per second too)


def _train_lines(folder) -> list[dict]:
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in x.items() if not k.startswith(RESUME_TIMING)}
            for x in lines if any(k.startswith("train/") for k in x)]


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_grpo_with_router_replay_resumes_bit_equal(runs):
    full, resumed = runs["out"] / "resume" / "full", runs["out"] / "resume" / "resumed"
    assert (full / "checkpoints" / "step_00000002" / "manifest.json").is_file()
    a, b = _train_lines(full), _train_lines(resumed)
    assert [x["step"] for x in a] == [1, 2, 3, 4] and [x["step"] for x in b] == [3, 4]
    assert all(0.5 < x["train/moe/replayed"] <= 1 for x in a)
    assert a[2:] == b  # losses, grad norms, the aux loss, the load: equal, not close
    assert len({x["train/policy_loss"] for x in a}) > 1  # it trained
    s_full, s_res = (json.loads((f / "summary.json").read_text())["metrics"] for f in (full, resumed))
    assert {k: v for k, v in s_full["final"].items() if not k.startswith(("time/", "gen/", "step_time"))} == {
        k: v for k, v in s_res["final"].items() if not k.startswith(("time/", "gen/", "step_time"))}
    assert s_full["steps"] == s_res["steps"] == 4
    w_full, w_res = _weights(full / "export" / "actor"), _weights(resumed / "export" / "actor")
    assert w_full and w_full.keys() == w_res.keys()
    assert all(torch.equal(w_full[k], w_res[k]) for k in w_full)


def test_bf16_grpo_with_and_without_router_replay(runs):
    off, on = (runs["ranks"][0][f"bf16/{replay}"] for replay in ("off", "rollout"))
    for run in (off, on):
        assert run["steps"] == 2 and run["stages"] == {"actor": 3, "ref": 3}
        assert run["metrics"]["final"]["rollout/logprob_mismatch"] >= 0
    _assert_moe_figures(off["last_moe"], replayed=False)
    _assert_moe_figures(on["last_moe"], replayed=True)
    print("bf16 rollout/logprob_mismatch: replay off", off["metrics"]["final"]["rollout/logprob_mismatch"],
          "rollout", on["metrics"]["final"]["rollout/logprob_mismatch"])
