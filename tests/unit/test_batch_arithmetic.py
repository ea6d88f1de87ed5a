"""The batch arithmetic is checked before any rank starts: the training rows left after the held-out split, dealt
over the requested ranks the way the run's sampler deals them, must fill the batch each rank draws (micro batch x
accumulation, a GRPO rollout's prompts, DPO pairs, SD images). Each case goes through the real CLI in this process
(`multiengine validate --nproc-per-node N`, `multiengine run --nproc-per-node N`, a rank started without the
pre-check) and no rank is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiengine.engines.settings import SettingsError
from multiengine.pipelines.checks import check_rows_per_rank
from multiengine.recipes.language import cli


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch):
    """Not the rank variables an in-process registry of another test left behind."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "MULTIENGINE_VALIDATED"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from PIL import Image

    d = tmp_path_factory.mktemp("batch_arithmetic")

    def jsonl(name: str, rows: list[dict]) -> None:
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("pairs52.jsonl", [{"prompt": f"list {i} fruits :", "chosen": "apple pear", "rejected": "car"}
                            for i in range(52)])
    for n in (33, 34, 48):
        jsonl(f"sft{n}.jsonl", [{"prompt": f"list {i} fruits :", "response": "apple pear"} for i in range(n)])
    images = d / "images20"
    images.mkdir()
    for i in range(20):
        Image.new("RGB", (16, 16), (i * 10, 0, 0)).save(images / f"{i}.png")
    (images / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "text": "a red square"})
                                                   + "\n" for i in range(20)))
    return d


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _validate(d: Path, recipe: str, *args: str) -> list[str]:
    return ["validate", recipe, "--config", "tiny", *args, f"output_dir={d / 'out' / recipe}"]


CASES = {
    # the cases: the default micro batch of the tiny DPO config (32 pairs) with 52 pairs (3 held out) on 2
    # ranks; 12 training images left after sd_finetune's 8 held out, on 2 ranks; 48 rows on 4 ranks
    "dpo-52-pairs-2-ranks": ("rlhf_dpo", ("data.source={d}/pairs52.jsonl", "--nproc-per-node", "2"),
                             ("'roles.actor.micro_batch_size'", "value 32", "49 training pairs",
                              "24 per rank on 2 ranks", "roles.actor.micro_batch_size=24 or less", "run on 1 rank")),
    "sd-12-images-2-ranks": ("sd_finetune", ("data.source={d}/images20", "--nproc-per-node", "2"),
                             ("'roles.unet.micro_batch_size'", "value 8", "12 training images", "8 held out",
                              "6 per rank", "hold out fewer rows (eval.heldout_size; 8 now)")),
    "sft-48-rows-4-ranks": ("rlhf_sft", ("data.source={d}/sft48.jsonl", "--nproc-per-node", "4"),
                            ("'roles.actor.micro_batch_size'", "value 16", "11 per rank on 4 ranks",
                             "2 ranks or fewer")),
    "sft-2-nodes": ("rlhf_sft", ("data.source={d}/sft48.jsonl", "--nproc-per-node", "2", "--nnodes", "2"),
                    ("11 per rank on 4 ranks",)),
    # GRPO: a rollout's prompts per rank (the SFT run it trains its actor with first fits: micro batch 4)
    "grpo-rollout-4-ranks": ("rlhf_grpo", ("data.source={d}/sft48.jsonl", "--nproc-per-node", "4",
                                           "grpo.rollout_batch_size=16",
                                           "actor_sft.overrides=[roles.actor.micro_batch_size=4]"),
                             ("'grpo.rollout_batch_size'", "value 16", "46 training prompts", "11 per rank",
                              "each sampled grpo.n_samples_per_prompt=8 times")),
    # ... and that SFT run itself, before the actor it trains exists
    "grpo-sft-run-4-ranks": ("rlhf_grpo", ("data.source={d}/sft48.jsonl", "--nproc-per-node", "4"),
                             ("actor_sft: roles.actor.micro_batch_size", "value 16",
                              "actor_sft.overrides=[roles.actor.micro_batch_size=11] or less")),
    # DPO draws micro_batch_size x grad_accum pairs per step from one stream
    "dpo-grad-accum": ("rlhf_dpo", ("data.source={d}/pairs52.jsonl", "roles.actor.micro_batch_size=16",
                                    "roles.actor.grad_accum=4"),
                       ("asks for 64 pairs", "roles.actor.grad_accum=4", "roles.actor.micro_batch_size=12 or less")),
    # rlhf_e2e: each step's config as it will run, before step 1 starts
    "e2e-dpo-step": ("rlhf_e2e", ("data.source={d}/pairs52.jsonl", "algorithm=dpo", "--nproc-per-node", "2",
                                  "sft.overrides=[roles.actor.micro_batch_size=8]"),
                     ("step dpo (rlhf_dpo --config tiny)", "'roles.actor.micro_batch_size'",
                      "dpo.overrides=[roles.actor.micro_batch_size=24] or less")),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_validate_refuses_a_batch_the_rows_cannot_fill(data, case, capsys):
    recipe, args, words = CASES[case]
    code = cli.main(_validate(data, recipe, *[a.replace("{d}", str(data)) for a in args]))
    line = _error(capsys)
    assert code == 2, line
    for word in words:
        assert word in line, line
    assert not (data / "out" / recipe).exists()


@pytest.mark.timeout(600)
def test_just_enough_rows_pass_and_one_fewer_is_refused(data, capsys):
    # 34 rows, 2 held out: 32 training rows = 16 per rank on 2 ranks, exactly the tiny config's micro batch
    args = ["--nproc-per-node", "2", "data.eval_split=2"]
    assert cli.main(_validate(data, "rlhf_sft", f"data.source={data}/sft34.jsonl", *args)) == 0
    assert "valid on 2 ranks" in capsys.readouterr().out
    assert cli.main(_validate(data, "rlhf_sft", f"data.source={data}/sft33.jsonl", *args)) == 2
    line = _error(capsys)
    assert "31 training rows" in line and "15 per rank on 2 ranks" in line
    assert "hold out fewer rows (data.eval_split; 2 now)" in line  # 33 rows would give 16 per rank
    # the same data on one rank (the default of validate) is fine
    assert cli.main(_validate(data, "rlhf_sft", f"data.source={data}/sft33.jsonl", "data.eval_split=2")) == 0


@pytest.mark.timeout(600)
def test_run_refuses_before_launching_any_rank(data, capsys):
    out = data / "out" / "run"
    code = cli.main(["run", "rlhf_dpo", "--config", "tiny", "--nproc-per-node", "2",
                     f"data.source={data}/pairs52.jsonl", f"output_dir={out}"])
    line = _error(capsys)
    assert code == 2 and "24 per rank on 2 ranks" in line
    assert not out.exists()  # no rank started, nothing written


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_started_without_the_pre_check_fails_before_building(data, capsys, monkeypatch, rank):
    """torchrun started directly: every rank runs the checks for the job's WORLD_SIZE; rank 0 alone reports."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = data / "out" / f"rank{rank}"
    code = cli.main(["run", "rlhf_sft", "--config", "tiny", f"data.source={data}/sft48.jsonl", f"output_dir={out}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if rank:
        assert errors == [], err
    else:
        assert len(errors) == 1 and "11 per rank on 4 ranks" in errors[0], err
    assert not out.exists()  # no model built, no log file


def test_the_message_names_every_fix_that_would_work():
    with pytest.raises(SettingsError) as info:
        check_rows_per_rank(30, 4, key="train.micro_batch_size", value=4, factor=2, unit="pairs",
                            what="train.micro_batch_size x train.grad_accum=2", heldout=10)
    text = str(info.value)
    assert text.startswith("config key 'train.micro_batch_size' asks for 8 pairs per rank per step (train.micro")
    assert "the 30 training pairs (left after 10 held out for evaluation) give 7 per rank on 4 ranks" in text
    # 7 // 2 = 3 pairs per micro batch; 30 // 8 = 3 ranks; 40 rows would give 10 per rank
    assert info.value.fix == ("set train.micro_batch_size=3 or less, run on 3 ranks or fewer (--nproc-per-node x "
                              "--nnodes), hold out fewer rows (data.eval_split; 10 now) or give evaluation rows of "
                              "their own (data.eval_source), or add training pairs")
    check_rows_per_rank(32, 4, key="k", value=4, factor=2)  # exactly 8 per rank
    with pytest.raises(SettingsError) as info:
        check_rows_per_rank(3, 4, key="k", value=1)  # fewer rows than ranks: no batch size fits
    assert info.value.fix == "run on 3 ranks or fewer (--nproc-per-node x --nnodes), or add training rows"
