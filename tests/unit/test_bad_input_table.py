"""Bad inputs that used to run or fail late, each refused up front with the key, the value and the fix."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from multiengine.recipes.language.config import (
    DuplicateKeyError,
    RecipeConfigError,
    check_output_dir_writable,
    configs_dir,
    load_config,
    yaml_load,
)


# --- a YAML key set twice ---------------------------------------------------------------------------------
def test_a_yaml_key_set_twice_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("# my run\nmax_steps: 3\ntrain:\n  lr: 1.0e-3\n  micro_batch_size: 2\n  lr: 2.0e-3\n")
    with pytest.raises(RecipeConfigError) as err:
        load_config("rlhf_sft", str(path))
    assert str(err.value) == (f"config file {path}: key 'train.lr' is set twice, on line 4 and on line 6; YAML would "
                              "keep only the second value; fix: delete one of the two lines")


def test_duplicate_keys_are_found_in_lists_and_overrides_but_merge_keys_pass():
    with pytest.raises(DuplicateKeyError) as err:
        yaml_load("a:\n  - {x: 1}\n  - {x: 1,\n     x: 3}\n")
    assert (err.value.key, err.value.first_line, err.value.second_line) == ("a[1].x", 3, 4)
    # the same name in two sections, and a merge key overridden beside it, are not duplicates
    assert yaml_load("a: {x: 1}\nb: {x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}
    assert yaml_load("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n")["other"] == {"x": 2}
    with pytest.raises(RecipeConfigError, match=r"malformed override 'validation=\{a: 1, a: 2\}': key 'validation.a' "
                                                r"is set twice"):
        load_config("rlhf_sft", "tiny", ["validation={a: 1, a: 2}"])


# --- an output_dir that cannot be written ------------------------------------------------------------------
@contextlib.contextmanager
def unprivileged():
    """Permission bits bind only a user who is not root: as root, act as `nobody` for the block (the effective
    uid alone, restored after; modules it needs must be imported before)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def locked_folder() -> Path:
    """A folder nobody but root may write in, under a parent anyone may enter."""
    root = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    root.chmod(0o755)
    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked


def test_output_dir_that_is_a_file_or_under_one_or_not_writable_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    with pytest.raises(RecipeConfigError, match=r"'output_dir' is an existing file, not a folder .*fix: point"):
        check_output_dir_writable(str(afile))
    with pytest.raises(RecipeConfigError, match=rf"'output_dir' cannot be created: {afile} is a file"):
        check_output_dir_writable(str(afile / "run"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RecipeConfigError, match=r"is a link to .*nowhere, which does not exist"):
        check_output_dir_writable(str(tmp_path / "dangling"))
    locked = locked_folder()
    try:
        for target, where in ((locked / "run" / "a", f"in {locked}, where it would be created"), (locked, "in it")):
            with unprivileged(), pytest.raises(RecipeConfigError) as err:
                check_output_dir_writable(str(target))
            assert f"is not writable: cannot create files {where} (Permission denied)" in str(err.value)
        assert list(locked.iterdir()) == []  # the probe file is gone, the folder was not created
    finally:
        shutil.rmtree(locked.parent)
    check_output_dir_writable(str(tmp_path / "new" / "run"))  # a folder that can be created passes, untouched
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling"]


# --- an image folder without images ------------------------------------------------------------------------
def test_an_image_folder_without_images_or_with_an_empty_metadata_file_is_a_data_error(tmp_path):
    from multiengine.pipelines.diffusion.data import check_image_caption_data
    from multiengine.pipelines.sources import DataSourceError
    from PIL import Image

    empty, meta_only, rowless, hidden = (tmp_path / n for n in ("empty", "meta_only", "rowless", "hidden"))
    for folder in (empty, meta_only, rowless, hidden / ".cache"):
        folder.mkdir(parents=True)
    (meta_only / "metadata.jsonl").write_text("")  # datasets raised IndexError on these two
    Image.new("RGB", (8, 8)).save(rowless / "0.png")
    (rowless / "metadata.csv").write_text("file_name,text\n")
    Image.new("RGB", (8, 8)).save(hidden / ".cache" / "0.png")  # hidden, as datasets skips it
    cases = [(empty, "is an image folder with no images (it is empty)"),
             (meta_only, "is an image folder with no images (it holds only metadata.jsonl)"),
             (rowless, "its metadata.csv has no rows; write one line per image with its file_name and caption"),
             (hidden, "is an image folder with no images (it is empty)")]
    for folder, message in cases:
        with pytest.raises(DataSourceError) as err:
            check_image_caption_data(str(folder), key="data.eval_source")
        assert str(err.value).startswith(f"data.eval_source='{folder}'") and message in str(err.value)


# --- NVMe offload without its folder, through the Python API -------------------------------------------------
@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_offload_without_nvme_path_is_a_config_error_before_the_model_is_built(section):
    import torch
    from multiengine.engines import ConfigError, EngineRegistry, RoleSpec, train_ds_config

    built = []

    def model():
        built.append(1)
        return torch.nn.Linear(4, 1)

    config = train_ds_config(stage=3, dtype="fp32", micro_batch_size=1, offload_params=section == "offload_param",
                             offload_optimizer=section == "offload_optimizer")
    config["zero_optimization"][section] = {"device": "nvme"}
    registry = EngineRegistry(backend="deepspeed")
    registry.add(RoleSpec("actor", model, config, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    with pytest.raises(ConfigError) as err:
        registry.build()
    assert str(err.value) == (f"role 'actor': zero_optimization.{section}.device='nvme' needs zero_optimization."
                              f"{section}.nvme_path, a folder on a local NVMe drive to swap to; set it, or use "
                              "device='cpu'.")
    assert built == []  # refused before the role's model factory ran (it used to be blamed for the failure)
    config["zero_optimization"][section] = {"device": "disk"}
    with pytest.raises(ConfigError, match=rf"zero_optimization.{section}.device='disk'; use 'none', 'cpu' or 'nvme'"):
        registry = EngineRegistry(backend="deepspeed")
        registry.add(RoleSpec("actor", model, config, optimizer=torch.optim.SGD))
        registry.build()
    assert built == []


# --- a chat message whose role the chat template does not take -------------------------------------------
def test_chat_roles_the_template_does_not_take_are_refused_naming_the_ones_it_takes(tmp_path):
    import json

    from multiengine.pipelines.rlhf import tiny
    from multiengine.pipelines.rlhf.data import SFTCollator, chat_template_roles, check_rlhf_data
    from multiengine.pipelines.sources import DataSourceError
    from transformers import AutoTokenizer

    tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "tok", chat_template=True)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))  # as a recipe loads it (named by its folder)
    assert chat_template_roles(tok) == {"system": True, "user": True, "assistant": True, "tool": False,
                                       "developer": False}
    chat = [{"role": "user", "content": "list 3 fruits :"}, {"role": "tool", "content": "kiwi"},
            {"role": "assistant", "content": "kiwi lemon plum"}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tok.unk_token_id) == 1  # what training would have seen: "<|tool|>" is an unknown word
    rows = [{"messages": chat[::2]}] * 3 + [{"messages": chat}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataSourceError) as err:
        check_rlhf_data(str(path), "sft", tokenizer=tok)
    assert str(err.value) == (
        f"data.source: chat messages of {path} (row 4) have role 'tool', which the chat template of roles.actor.model "
        f"({tmp_path / 'tok'}) does not take (it takes system, user, assistant); rename those messages' role to one "
        "it takes, or use a tokenizer whose chat template has role 'tool'")
    path.write_text("".join(json.dumps({"messages": chat[::2]}) + "\n" for _ in range(4)))
    assert check_rlhf_data(str(path), "sft", tokenizer=tok)["rows"] == 4
    with pytest.raises(DataSourceError, match=r"the data: chat messages have role 'tool', which the chat template of "
                                              r"the collator .* takes system, user, assistant"):
        SFTCollator(tok, 16, 16)([{"messages": chat}])  # the Python API refuses it too
    # a template that raises on roles it does not know (as several chat models' templates do)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                         "{{ raise_exception('only user and assistant roles') }}{% endif %}"
                         "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}")
    assert chat_template_roles(tok) == {"system": False, "user": True, "assistant": True, "tool": False,
                                       "developer": False}


# --- an OLMoE reward model or critic (transformers has no OLMoE sequence classifier) ---------------------------
def test_an_olmoe_scalar_head_model_is_refused_only_where_it_would_be_exported(tmp_path):
    from multiengine.pipelines.rlhf import tiny
    from multiengine.recipes.language.cli import main

    tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "tok")
    olmoe = tiny.build_tiny_causal_lm(tmp_path / "olmoe", tmp_path / "tok", hidden=16, layers=1, family="olmoe")
    out = f"output_dir={tmp_path / 'out'}"
    refused = [["rlhf_reward", f"roles.reward.model={olmoe}"], ["rlhf_ppo", f"roles.reward.model={olmoe}"],
               ["rlhf_ppo", f"roles.critic.model={olmoe}"], ["rlhf_e2e", f"model.pretrained={olmoe}"]]
    passed = [["rlhf_reward", f"roles.reward.model={olmoe}", "export.enabled=false"],  # trained, not exported
              ["rlhf_ppo", f"roles.reward.model={olmoe}", "export.critic=false", f"roles.actor.model={olmoe}"],
              ["rlhf_grpo", f"roles.reward.model={olmoe}", "reward.models=[{role: reward}]",  # a frozen scorer
               f"roles.actor.model={olmoe}"],
              ["rlhf_e2e", f"model.pretrained={olmoe}", "algorithm=dpo"]]  # no reward model
    for args in refused + passed:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = main(["validate", args[0], "--config", "tiny", *args[1:], out])
        errors = [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]
        assert (code, len(errors)) == ((2, 1) if args in refused else (0, 0)), (args, stderr.getvalue()[-2000:])
        if args in refused:
            assert "olmoe family" in errors[0] and "*ForSequenceClassification" in errors[0], errors


# =============================================================================================================
# The table of bad inputs (docs/bad-inputs.md): every row is run here, in this process, and the docs table must be
# what these runs print. A `multiengine` row must exit 2 with exactly one `error:` line naming its key or file and
# leave nothing new under the data folder (so no output_dir, no logs); a Python API row must raise a ValueError
# (ConfigError, DataSourceError, ...) naming what it names. `python tests/unit/test_bad_input_table.py` rewrites
# the docs table from the runs.
# =============================================================================================================
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "bad-inputs.md"
BEGIN, END = "<!-- bad-input table: begin -->", "<!-- bad-input table: end -->"
AREAS = ("CLI", "config", "data", "models", "rewards", "Python API")


@dataclass(frozen=True)
class Row:
    id: str
    area: str
    what: str  # the bad input, in words
    command: str  # `multiengine` arguments, or (Python API) an expression evaluated in api_namespace(); {d}: data
    names: tuple[str, ...]  # each must appear in the message ({d} and {locked} as in command)

    @property
    def api(self) -> bool:
        return self.area == "Python API"


def cli(id: str, area: str, what: str, command: str, *names: str) -> Row:
    return Row(id, area, what, command, names)


def api(id: str, what: str, code: str, *names: str) -> Row:
    return Row(id, "Python API", what, code, names)


ROWS = [
    # --- the command line ------------------------------------------------------------------------------------
    cli("no-recipe", "CLI", "no recipe named", "validate --config tiny", "needs a recipe name"),
    cli("unknown-recipe", "CLI", "a recipe name with a typo", "validate rlhf_sftt --config tiny", "rlhf_sftt",
        "rlhf_sft"),
    cli("unknown-config", "CLI", "a shipped config name that does not exist", "validate rlhf_sft --config tinyy",
        "tinyy", "tiny"),
    cli("missing-config-file", "CLI", "a config file that does not exist", "validate distill --config {d}/nope.yaml",
        "nope.yaml"),
    cli("nproc-0", "CLI", "zero ranks per node", "validate rlhf_sft --config tiny --nproc-per-node 0",
        "--nproc-per-node", "0"),
    cli("nnodes-no-master", "CLI", "several nodes without rank 0's address",
        "run rlhf_sft --config tiny --nproc-per-node 1 --nnodes 2 --node-rank 0", "--master-addr"),
    cli("node-rank-out-of-range", "CLI", "a node rank past the number of nodes",
        "run rlhf_sft --config tiny --nproc-per-node 1 --nnodes 2 --node-rank 2 --master-addr node0 "
        "--master-port 29500", "--node-rank 2"),
    cli("nnodes-without-nproc", "CLI", "node options without --nproc-per-node", "run rlhf_sft --config tiny --nnodes 2",
        "--nproc-per-node"),
    cli("c10d-node-rank", "CLI", "a node rank with the c10d rendezvous (nodes are numbered as they join)",
        "run rlhf_sft --config tiny --nproc-per-node 1 --nnodes 2 --node-rank 1 --master-addr node0 "
        "--master-port 29500 --rdzv-backend c10d", "--node-rank", "c10d"),
    cli("batch-on-too-many-ranks", "CLI", "more ranks than the data can fill a micro batch on",
        "validate rlhf_reward --config tiny --nproc-per-node 4 --nnodes 64 data.source={d}/pairs.jsonl",
        "roles.reward.micro_batch_size"),
    cli("run-2ranks-stage", "CLI", "`run` on 2 ranks with a bad value: checked before launching",
        "run rlhf_sft --config tiny --nproc-per-node 2 roles.actor.stage=7", "roles.actor.stage", "7"),
    cli("run-2ranks-missing-data", "CLI", "`run` on 2 ranks with a missing data file",
        "run rlhf_reward --config tiny --nproc-per-node 2 data.source={d}/nope.jsonl", "data.source", "nope.jsonl"),
    cli("run-2ranks-bad-choice", "CLI", "`run` on 2 ranks with a wrong choice",
        "run sd_finetune --config tiny --nproc-per-node 2 mode=foo", "mode", "foo"),
    cli("run-here-max-steps", "CLI", "`run` in this process with a bad value", "run registry_demo --config tiny "
        "max_steps=0", "max_steps", "0"),
    cli("plan-gpus-0", "CLI", "a plan for 0 GPUs", "plan rlhf_sft --config tiny --gpus 0 --gpu-mem 80GiB", "--gpus 0"),
    cli("plan-gpu-mem", "CLI", "GPU memory without a unit the planner reads", "plan rlhf_sft --config tiny --gpus 8 "
        "--gpu-mem lots", "--gpu-mem", "lots"),
    cli("plan-nodes", "CLI", "GPUs that do not split evenly over nodes", "plan rlhf_sft --config tiny --gpus 6 "
        "--gpu-mem 80GiB --nodes 4", "--gpus 6", "--nodes 4"),
    cli("plan-assume", "CLI", "--assume without ROLE=MODEL", "plan rlhf_ppo --config tiny --gpus 8 --gpu-mem 80GiB "
        "--assume actor", "--assume", "ROLE=MODEL"),
    cli("cp-no-slash", "CLI", "`cp` of a recipe without a config name", "cp registry_demo {d}/my.yaml",
        "registry_demo", "RECIPE/CONFIG"),
    # --- config keys, values and files -----------------------------------------------------------------------
    cli("sft-unknown-key", "config", "a key with a typo", "validate rlhf_sft --config tiny roles.actor.lrr=1e-3",
        "roles.actor.lrr", "roles.actor.lr"),
    cli("sft-unknown-section", "config", "a section that does not exist", "validate rlhf_sft --config tiny "
        "optimizer.lr=1e-3", "optimizer"),
    cli("reward-unknown-role", "config", "a role the recipe does not have", "validate rlhf_reward --config tiny "
        "roles.critic.stage=2", "roles.critic"),
    cli("dpo-typo-in-yaml", "config", "a typo in a YAML file", "validate rlhf_dpo --config {d}/dpo_typo.yaml",
        "dpo.betta", "dpo_typo.yaml"),
    cli("distill-unknown-key", "config", "a key that is not in its section", "validate distill --config tiny "
        "distill.temp=2", "distill.temp"),
    cli("sd-removed-key", "config", "a key of an earlier version", "validate sd_finetune --config tiny "
        "model.tiny_text_encoders=2", "model.tiny_text_encoders", "model.tiny_family"),
    cli("sd-other-denoiser", "config", "the denoiser role the model's family does not have",
        "validate sd_finetune --config tiny roles.transformer.lr=1e-4", "roles.transformer.lr", "roles.unet.lr"),
    cli("demo-old-lr", "config", "a top-level key of an earlier version", "validate registry_demo --config tiny "
        "lr=1e-3", "'lr'", "roles.actor.lr"),
    cli("yaml-duplicate-key", "config", "a YAML file setting one key twice", "validate rlhf_sft --config "
        "{d}/dup.yaml", "train.lr", "line 4", "line 6"),
    cli("override-duplicate-key", "config", "an override value setting one key twice",
        "validate rlhf_grpo --config tiny "
        "'reward.functions=[{fn: builtin:judge, fn: builtin:judge}]'", "'reward.functions[0].fn' is set twice"),
    cli("yaml-not-a-mapping", "config", "a YAML file that is a list", "validate rlhf_sft --config {d}/list.yaml",
        "list.yaml", "mapping"),
    cli("yaml-syntax", "config", "a YAML file that does not parse", "validate rlhf_sft --config {d}/broken.yaml",
        "broken.yaml", "line 3, column 2"),
    cli("bad-interpolation", "config", "an interpolation of a key that does not exist",
        "validate rlhf_sft --config tiny 'data.source=${nope}'", "nope"),
    cli("sft-max-steps-0", "config", "0 steps", "validate rlhf_sft --config tiny max_steps=0", "max_steps", "0"),
    cli("sft-max-steps-neg", "config", "a negative step count", "validate rlhf_sft --config tiny max_steps=-1",
        "max_steps", "-1"),
    cli("sft-stage-5", "config", "a ZeRO stage that does not exist", "validate rlhf_sft --config tiny "
        "roles.actor.stage=5", "roles.actor.stage", "5"),
    cli("sd-unet-stage-5", "config", "a ZeRO stage that does not exist (diffusion)", "validate sd_finetune --config "
        "tiny roles.unet.stage=5", "roles.unet.stage", "5"),
    cli("sd-unet-packing", "config", "packing for a role that runs no token sequences (diffusion)",
        "validate sd_finetune --config tiny roles.unet.packing=packed", "roles.unet.packing", "no token-sequence"),
    cli("sft-token-budget", "config", "a token budget where micro-batches are the data loader's rows",
        "validate rlhf_sft --config tiny roles.actor.token_budget=512", "roles.actor.token_budget",
        "micro_batch_size rows"),
    cli("ppo-old-key", "config", "a key of the old dialect", "validate rlhf_ppo --config tiny ppo.mini_batch_size=4",
        "ppo.mini_batch_size", "roles.actor.micro_batch_size"),
    cli("ppo-rollout-0", "config", "an empty rollout", "validate rlhf_ppo --config tiny ppo.rollout_batch_size=0",
        "ppo.rollout_batch_size", "0"),
    cli("grpo-top-p-0", "config", "top_p 0", "validate rlhf_grpo --config tiny generation.top_p=0", "generation.top_p"),
    cli("dpo-label-smoothing", "config", "label smoothing of 0.5", "validate rlhf_dpo --config tiny "
        "dpo.label_smoothing=0.5", "dpo.label_smoothing", "0.5"),
    cli("reward-lr-0", "config", "a learning rate of 0", "validate rlhf_reward --config tiny roles.reward.lr=0",
        "roles.reward.lr"),
    cli("demo-seq-len", "config", "a sequence longer than the model's positions",
        "validate registry_demo --config tiny "
        "seq_len=1000", "seq_len", "1000"),
    cli("distill-alpha", "config", "a mixing weight above 1", "validate distill --config tiny distill.alpha=2",
        "distill.alpha", "2"),
    cli("sd-resolution", "config", "an image side below the minimum", "validate sd_finetune --config tiny "
        "data.resolution=4", "data.resolution", "4"),
    cli("grpo-timeout-0", "config", "a collective timeout of 0", "validate rlhf_grpo --config tiny dist_timeout_s=0",
        "dist_timeout_s"),
    cli("e2e-timeout-0", "config", "a collective timeout of 0 (rlhf_e2e)", "validate rlhf_e2e --config tiny "
        "dist_timeout_s=0", "dist_timeout_s", "0"),
    cli("nonfinite-max-skips", "config", "a negative skip budget", "validate registry_demo --config tiny "
        "nonfinite.max_skips=-2", "nonfinite.max_skips"),
    cli("sd-mode-foo", "config", "a mode that does not exist", "validate sd_finetune --config tiny mode=foo", "mode",
        "foo"),
    cli("ppo-generation-mode", "config", "a generation mode that does not exist", "validate rlhf_ppo --config tiny "
        "generation.mode=beam", "generation.mode", "beam"),
    cli("dpo-loss", "config", "a DPO loss that does not exist", "validate rlhf_dpo --config tiny dpo.loss=hinge2",
        "dpo.loss", "hinge2"),
    cli("e2e-algorithm", "config", "an RL algorithm that does not exist", "validate rlhf_e2e --config tiny "
        "algorithm=a2c", "algorithm", "a2c"),
    cli("grpo-loss-aggregation", "config", "a loss aggregation that does not exist", "validate rlhf_grpo --config "
        "tiny grpo.loss_aggregation=foo", "grpo.loss_aggregation", "foo", "token_mean"),
    cli("grpo-clip-high", "config", "a negative upper clip range", "validate rlhf_grpo --config tiny "
        "grpo.clip_high=-1", "clip_high=-1", ">= 0"),
    cli("grpo-overlong-buffer", "config", "an overlong buffer longer than the answers may be",
        "validate rlhf_grpo --config tiny grpo.overlong_buffer=100", "grpo.overlong_buffer",
        "generation.max_new_tokens"),
    cli("grpo-env", "config", "a multi-turn environment that does not exist", "validate rlhf_grpo --config "
        "tiny_multiturn grpo.env=chess", "grpo.env", "chess", "builtin:arithmetic"),
    cli("distill-on-policy", "config", "an on-policy share above 1", "validate distill --config tiny "
        "distill.on_policy_fraction=1.5", "distill.on_policy_fraction", "1.5"),
    cli("diffusion-grpo-group", "config", "a GRPO group of one image (no advantage to compute)",
        "validate diffusion_grpo --config tiny diffusion.group_size=1", "diffusion.group_size", "1"),
    cli("diffusion-dpo-beta", "config", "a Diffusion-DPO beta of 0", "validate diffusion_dpo --config tiny "
        "dpo.beta=0", "dpo.beta", "0"),
    cli("gan-d-steps", "config", "no discriminator step per generator step", "validate gan --config tiny "
        "gan.d_steps=0", "gan.d_steps", "0"),
    cli("sft-scheduler", "config", "a scheduler name with a typo", "validate rlhf_sft --config tiny "
        "roles.actor.scheduler=cosyne", "roles.actor.scheduler", "cosyne"),
    cli("demo-backend", "config", "a backend that does not exist", "validate registry_demo --config tiny backend=jax",
        "backend", "jax"),
    cli("nonfinite-policy", "config", "a non-finite policy that does not exist", "validate rlhf_reward --config tiny "
        "nonfinite.policy=ignore", "nonfinite.policy", "ignore"),
    cli("sft-steps-not-int", "config", "a word for a number", "validate rlhf_sft --config tiny max_steps=ten",
        "max_steps", "ten"),
    cli("sd-offload-needs-z3", "config", "parameter offload below ZeRO-3", "validate sd_finetune --config tiny "
        "roles.unet.stage=2 roles.unet.offload_params=true", "roles.unet.offload_params"),
    cli("sd-unclosed-list", "config", "a list without its closing bracket", "validate sd_finetune --config tiny "
        "'validation.prompts=[a cat, a dog'", "validation.prompts"),
    cli("sft-list-for-int", "config", "a list for a number", "validate rlhf_sft --config tiny "
        "roles.actor.micro_batch_size=[1,2]", "roles.actor.micro_batch_size"),
    cli("override-no-equals", "config", "an override without '='", "validate rlhf_reward --config tiny max_steps",
        "max_steps"),
    cli("lora-alpha-without-r", "config", "a LoRA alpha without a LoRA rank", "validate rlhf_sft --config tiny "
        "roles.actor.lora.alpha=32", "roles.actor.lora.alpha", "roles.actor.lora.r"),
    cli("seed-too-large", "config", "a seed above 2^32-1", "validate rlhf_sft --config tiny seed=8589934592", "seed",
        "8589934592"),
    cli("keep-last-zero", "config", "keeping no checkpoint", "validate rlhf_sft --config tiny checkpoint.keep_last=0",
        "checkpoint.keep_last", "0"),
    cli("resume-empty-folder", "config", "resuming from a folder that holds no checkpoint",
        "validate rlhf_sft --config tiny resume_from={d}/empty", "resume_from", "empty"),
    cli("frozen-gradient-checkpointing", "config", "gradient checkpointing on a frozen role",
        "validate rlhf_grpo --config tiny roles.ref.gradient_checkpointing=true", "roles.ref.gradient_checkpointing"),
    cli("ema-offload-below-z3", "config", "parameter offload for an EMA at ZeRO-2", "validate sd_finetune --config "
        "tiny roles.unet.stage=2 roles.ema.offload_params=true", "roles.ema.offload_params"),
    cli("resume-missing", "config", "resuming from a folder that does not exist", "validate rlhf_sft --config tiny "
        "resume_from={d}/no_ckpt", "resume_from", "no_ckpt"),
    cli("overwrite-and-resume", "config", "overwrite=true and resume_from=latest together",
        "validate rlhf_sft --config "
        "tiny overwrite=true resume_from=latest", "overwrite", "resume_from"),
    cli("output-dir-other-run", "config", "an output_dir holding another recipe's run",
        "validate rlhf_sft --config tiny "
        "output_dir={d}/reward_run", "output_dir", "rlhf_reward"),
    cli("output-dir-is-a-file", "config", "an output_dir that is an existing file", "validate rlhf_sft --config tiny "
        "output_dir={d}/afile", "output_dir", "afile", "existing file"),
    cli("output-dir-under-a-file", "config", "an output_dir under a file", "validate sd_finetune --config tiny "
        "output_dir={d}/afile/run", "output_dir", "afile"),
    cli("output-dir-dangling-link", "config", "an output_dir that is a link to nowhere",
        "validate rlhf_grpo --config tiny "
        "output_dir={d}/dangling", "output_dir", "dangling"),
    cli("output-dir-not-writable", "config", "an output_dir in a folder this user cannot write",
        "validate registry_demo --config tiny output_dir={locked}/run", "output_dir", "not writable", "{locked}"),
    cli("output-dir-not-writable-run", "config", "the same with `run` on 2 ranks: refused before launching",
        "run rlhf_e2e --config tiny --nproc-per-node 2 output_dir={locked}/e2e", "output_dir", "not writable"),
    cli("moe-aux-dense", "config", "the router's aux-loss coefficient for a dense model",
        "validate rlhf_sft --config tiny roles.actor.router_aux_loss_coef=0.01", "roles.actor.router_aux_loss_coef",
        "dense"),
    cli("moe-aux-negative", "config", "a negative aux-loss coefficient other than -1 (the model's)",
        "validate rlhf_sft --config tiny roles.actor.model={d}/moe_model roles.actor.router_aux_loss_coef=-0.5",
        "roles.actor.router_aux_loss_coef", "-0.5", "neither -1"),
    cli("moe-aux-critic", "config", "the router's aux loss for a role whose loss has none (the critic)",
        "validate rlhf_ppo --config tiny roles.critic.router_aux_loss_coef=0.01", "roles.critic.router_aux_loss_coef",
        "no router auxiliary loss"),
    cli("replay-no-rollouts", "config", "router replay in a recipe that samples no rollouts (not a key there)",
        "validate rlhf_sft --config tiny generation.router_replay=rollout", "unknown config key",
        "generation.router_replay"),
    cli("replay-ref-none", "config", "replaying the routing in a ref the run does not build",
        "validate rlhf_grpo --config tiny roles.actor.model={d}/moe_model generation.router_replay=rollout "
        "generation.replay_ref=true grpo.kl_coef=0", "generation.replay_ref", "builds none"),
    cli("replay-vllm", "config", "router replay with the vLLM engine (it records no routing)",
        "validate rlhf_grpo --config tiny roles.actor.model={d}/moe_model generation.router_replay=rollout "
        "generation.engine=vllm", "generation.router_replay", "generation.engine=hf"),
    cli("replay-dense", "config", "router replay for a dense actor", "validate rlhf_grpo --config tiny "
        "generation.router_replay=rollout", "generation.router_replay", "dense"),
    cli("replay-multiturn", "config", "router replay of multi-turn episodes", "validate rlhf_grpo --config "
        "tiny_multiturn roles.actor.model={d}/moe_model generation.router_replay=rollout", "generation.router_replay",
        "grpo.env"),
    cli("rollout-ranks-not-last", "config", "rollout ranks that are not the job's last ones",
        "validate rlhf_grpo --config tiny --nproc-per-node 3 roles.rollout.ranks=[0]", "roles.rollout.ranks",
        "last ranks"),
    cli("rollout-ranks-all", "config", "every rank a rollout rank: none left to train",
        "validate rlhf_grpo --config tiny --nproc-per-node 2 roles.rollout.ranks=[0,1]", "roles.rollout.ranks",
        "no rank to train"),
    cli("rollout-ranks-alone", "config", "a rollout rank in a job of one rank",
        "validate rlhf_grpo --config tiny roles.rollout.ranks=[1]", "roles.rollout.ranks", "at least 2 ranks"),
    cli("rollout-ranks-divide", "config", "rollout ranks that do not divide the trainer ranks",
        "validate rlhf_grpo --config tiny --nproc-per-node 5 roles.rollout.ranks=[3,4]", "roles.rollout.ranks",
        "do not divide"),
    cli("rollout-ranks-multiturn", "config", "rollout ranks for multi-turn episodes",
        "validate rlhf_grpo --config tiny_multiturn --nproc-per-node 2 roles.rollout.ranks=[1]",
        "roles.rollout.ranks", "grpo.env"),
    cli("rollout-ranks-distill", "config", "rollout ranks for distill's on-policy steps (lockstep only)",
        "validate distill --config tiny --nproc-per-node 2 roles.rollout.ranks=[1]", "roles.rollout.ranks",
        "every rank"),
    cli("schedule-distill", "config", "a schedule ahead of training in distill (lockstep only)",
        "validate distill --config tiny generation.schedule=one_step_off", "generation.schedule", "lockstep"),
    cli("staleness-sync", "config", "max_staleness without the async schedule",
        "validate rlhf_grpo --config tiny generation.max_staleness=3", "generation.max_staleness",
        "generation.schedule=async"),
    cli("rollout-is-lockstep", "config", "the rollout correction where every rollout comes from the trained weights",
        "validate rlhf_grpo --config tiny grpo.rollout_is_cap=2", "grpo.rollout_is_cap", "schedule=sync"),
    # --- data ------------------------------------------------------------------------------------------------
    cli("sft-missing-data", "data", "a data file that does not exist", "validate rlhf_sft --config tiny "
        "data.source={d}/nope.jsonl", "data.source", "nope.jsonl"),
    cli("sd-missing-folder", "data", "an image folder that does not exist", "validate sd_finetune --config tiny "
        "data.source={d}/no_images", "data.source", "no_images"),
    cli("unsupported-file", "data", "a data file of a type datasets cannot read", "validate rlhf_sft --config tiny "
        "data.source={d}/notes.txt", "data.source", "notes.txt", ".txt"),
    cli("sft-wrong-columns", "data", "columns of no accepted format", "validate rlhf_sft --config tiny "
        "data.source={d}/qa.jsonl", "qa.jsonl"),
    cli("sft-bad-column-map", "data", "a column mapping to a column the file lacks", "validate rlhf_sft --config tiny "
        "data.source={d}/qa.jsonl data.columns.prompt=query", "query"),
    cli("unknown-column-field", "data", "a column mapping for a field that does not exist",
        "validate rlhf_sft --config "
        "tiny data.source={d}/qa.jsonl data.columns.question=prompt", "data.columns", "question"),
    cli("reward-no-rejected", "data", "preference rows without a rejected answer", "validate rlhf_reward --config tiny "
        "data.source={d}/chosen_only.jsonl", "chosen_only.jsonl"),
    cli("dpo-empty-jsonl", "data", "an empty JSONL file", "validate rlhf_dpo --config tiny data.source={d}/empty.jsonl",
        "empty.jsonl"),
    cli("heldout-too-big", "data", "a held-out split larger than the data", "validate rlhf_sft --config tiny "
        "data.source={d}/sft.jsonl data.eval_split=1000", "data.eval_split", "1000"),
    cli("eval-split-fraction", "data", "a held-out fraction of 1.5", "validate rlhf_sft --config tiny "
        "data.source={d}/sft.jsonl data.eval_split=1.5", "data.eval_split", "1.5"),
    cli("eval-source-missing", "data", "evaluation rows from a file that does not exist", "validate rlhf_sft --config "
        "tiny data.source={d}/sft.jsonl data.eval_source={d}/nope_eval.jsonl", "data.eval_source", "nope_eval.jsonl"),
    cli("blend-negative-weight", "data", "a blend with a negative weight", "validate rlhf_sft --config tiny "
        "'data.sources=[{path: {d}/sft.jsonl, weight: 1}, {path: {d}/sft.jsonl, weight: -1}]'",
        "data.sources[1].weight", "-1"),
    cli("blend-unknown-key", "data", "a blend entry with a key a source does not have",
        "validate rlhf_sft --config tiny "
        "'data.sources=[{path: {d}/sft.jsonl, wieght: 2}]'", "data.sources[0]", "wieght"),
    cli("blend-mixed-formats", "data", "a blend of conversational and standard rows", "validate rlhf_sft --config tiny "
        "roles.actor.model={d}/chat_model 'data.sources=[{d}/sft.jsonl, {d}/chats.jsonl]'", "data.sources",
        "conversational"),
    cli("chat-without-template", "data", "conversations for a tokenizer without a chat template", "validate rlhf_sft "
        "--config tiny roles.actor.model={d}/plain_model data.source={d}/chats.jsonl", "data.source",
        "no chat template"),
    cli("chat-unknown-role", "data", "a chat message whose role the chat template does not take", "validate rlhf_sft "
        "--config tiny roles.actor.model={d}/chat_model data.source={d}/chats_tool.jsonl", "data.source",
        "chats_tool.jsonl", "row 4", "'tool'", "system, user, assistant"),
    cli("chat-unknown-role-ppo", "data", "the same in PPO prompts", "validate rlhf_grpo --config tiny "
        "roles.actor.model={d}/chat_model data.source={d}/chats_tool.jsonl", "data.source", "'tool'"),
    cli("sd-no-images", "data", "an image folder holding no images", "validate sd_finetune --config tiny "
        "data.source={d}/text_only", "text_only", "no images"),
    cli("sd-empty-folder", "data", "an empty image folder", "validate sd_finetune --config tiny "
        "data.source={d}/empty_images", "empty_images", "no images"),
    cli("sd-only-metadata", "data", "an image folder with only an empty metadata.jsonl (was IndexError)",
        "validate sd_finetune --config tiny data.source={d}/meta_only", "meta_only", "no images"),
    cli("sd-rowless-metadata", "data", "images with a metadata.csv of no rows (was IndexError)",
        "validate sd_finetune --config tiny data.source={d}/rowless", "rowless", "metadata.csv", "no rows"),
    cli("controlnet-no-images", "data", "ControlNet data: an image folder without images",
        "validate controlnet --config "
        "tiny data.source={d}/empty_images", "empty_images", "no images"),
    cli("sd-corrupt-image", "data", "an image that does not decode", "validate sd_finetune --config tiny "
        "data.source={d}/corrupt", "broken.png"),
    cli("sd-eval-no-images", "data", "held-out images from a folder without images",
        "validate sd_finetune --config tiny "
        "data.source={d}/corrupt data.check_images=false data.eval_source={d}/empty_images", "data.eval_source",
        "empty_images"),
    # --- models and tokenizers -------------------------------------------------------------------------------
    cli("ppo-missing-actor", "models", "an actor folder that does not exist", "validate rlhf_ppo --config tiny "
        "roles.actor.model={d}/no_such_export", "roles.actor.model", "no_such_export"),
    cli("sft-model-no-config", "models", "a model folder without config.json", "validate rlhf_sft --config tiny "
        "roles.actor.model={d}/empty_model", "roles.actor.model", "empty_model"),
    cli("tokenizer-missing", "models", "a tokenizer folder that does not exist", "validate rlhf_sft --config tiny "
        "roles.actor.model={d}/plain_model roles.actor.tokenizer={d}/no_tok", "roles.actor.tokenizer", "no_tok"),
    cli("tokenizer-too-big", "models", "a tokenizer with ids the model cannot embed", "validate rlhf_sft --config tiny "
        "roles.actor.model={d}/plain_model roles.actor.tokenizer={d}/chat_tok", "roles.actor.tokenizer", "chat_tok"),
    cli("sd-not-diffusers", "models", "a transformers folder given as a diffusers model",
        "validate sd_finetune --config "
        "tiny model.pretrained={d}/tf_folder", "model.pretrained", "tf_folder", "model_index.json"),
    cli("reward-model-missing", "models", "a reward-model folder that does not exist",
        "validate rlhf_ppo --config tiny "
        "roles.actor.model={d}/plain_model roles.reward.model={d}/no_reward", "roles.reward.model", "no_reward"),
    cli("distill-teacher-missing", "models", "a teacher folder that does not exist", "validate distill --config tiny "
        "roles.teacher.model={d}/no_teacher", "roles.teacher.model", "no_teacher"),
    cli("sft-pack-opt", "models", "packed passes asked of a family that cannot pack (the built-in tiny OPT)",
        "validate rlhf_sft --config tiny roles.actor.packing=packed", "roles.actor.packing", "opt model",
        "roles.actor.packing=auto"),
    cli("vllm-moe", "models", "the vLLM engine for an MoE actor (the weight sync cannot load fused experts)",
        "validate rlhf_grpo --config tiny roles.actor.model={d}/moe_model generation.engine=vllm", "generation.engine",
        "mixture of experts", "generation.engine=hf"),
    cli("reward-no-seqcls", "models", "training a reward model of a family transformers has no sequence classifier "
        "for (its export would fail at the end)", "validate rlhf_reward --config tiny roles.reward.model="
        "{d}/olmoe_model", "roles.reward.model", "olmoe", "*ForSequenceClassification", "qwen3_moe"),
    cli("critic-no-seqcls", "models", "the same for PPO's critic (from the reward model's folder)", "validate "
        "rlhf_ppo --config tiny roles.reward.model={d}/olmoe_model", "roles.critic.model", "olmoe",
        "export.critic=false"),
    # --- rewards ---------------------------------------------------------------------------------------------
    cli("reward-fn-no-colon", "rewards", "a reward function without module:function",
        "validate rlhf_grpo --config tiny "
        "reward.functions=[my_reward]", "reward.functions[0]", "my_reward"),
    cli("reward-fn-missing-file", "rewards", "a reward function in a file that does not exist", "validate rlhf_grpo "
        "--config tiny reward.functions=[{d}/nope.py:score]", "reward.functions[0]", "nope.py"),
    cli("reward-fn-missing-name", "rewards", "a reward function name the file does not define", "validate rlhf_grpo "
        "--config tiny reward.functions=[{d}/rewards.py:scroe]", "reward.functions[0]", "scroe"),
    cli("reward-fn-no-module", "rewards", "a reward module that does not import", "validate rlhf_grpo --config tiny "
        "reward.functions=[no_such_pkg.rewards:score]", "reward.functions[0]", "no_such_pkg"),
    cli("reward-fn-no-builtin", "rewards", "a built-in reward that does not exist", "validate rlhf_grpo --config tiny "
        "reward.functions=[builtin:judg]", "reward.functions[0]", "judg"),
    cli("reward-fn-twice", "rewards", "one reward function listed twice", "validate rlhf_grpo --config tiny "
        "'reward.functions=[builtin:judge, builtin:judge]'", "reward.functions[1]", "twice"),
    cli("reward-fn-weight-inf", "rewards", "an infinite reward weight", "validate rlhf_grpo --config tiny "
        "'reward.functions=[{fn: builtin:judge, weight: .inf}]'", "reward.functions[0].weight", "inf"),
    cli("reward-fn-needs-column", "rewards", "a reward function reading a column the data lacks", "validate rlhf_grpo "
        "--config tiny data.source={d}/sft.jsonl reward.functions=[{d}/rewards.py:needs_answer]", "needs_answer",
        "answer"),
    cli("reward-model-role-name", "rewards", "a reward-model role not named reward or reward_<name>", "validate "
        "rlhf_ppo --config tiny 'reward.models=[{role: critic, model: x}]'", "reward.models[0].role", "critic"),
    cli("reward-model-twice", "rewards", "one reward-model role listed twice", "validate rlhf_ppo --config tiny "
        "'reward.models=[{role: reward_a, model: x}, {role: reward_a, model: y}]'", "reward.models[1].role", "twice"),
    cli("reward-model-path", "rewards", "a reward-model entry naming its folder `path` (the old name)", "validate "
        "rlhf_ppo --config tiny 'reward.models=[{role: reward_a, path: x}]'", "reward.models[0].path",
        "reward.models[0].model"),
    cli("reward-none", "rewards", "GRPO without any reward source", "validate rlhf_grpo --config tiny "
        "reward.functions=[]", "no reward source", "reward.functions"),
    # --- the Python API --------------------------------------------------------------------------------------
    api("nvme-without-path", "NVMe parameter offload without nvme_path (was: the model factory failed)",
        "build(RoleSpec('actor', mlp, nvme(train_ds_config(stage=3, offload_params=True), 'offload_param'), "
        "optimizer=sgd))", "zero_optimization.offload_param.nvme_path"),
    api("nvme-optimizer-without-path", "NVMe optimizer offload without nvme_path",
        "build(RoleSpec('actor', mlp, nvme(train_ds_config(stage=2, offload_optimizer=True), 'offload_optimizer'), "
        "optimizer=sgd))", "zero_optimization.offload_optimizer.nvme_path"),
    api("offload-device", "an offload device DeepSpeed does not have",
        "build(RoleSpec('ref', mlp, device(eval_ds_config(stage=3), 'disk')))", "offload_param.device", "disk"),
    api("placement-offload-stage", "parameter offload below ZeRO-3", "Placement(stage=2, offload_params=True)",
        "offload_params", "stage=3"),
    api("placement-stage", "a ZeRO stage that does not exist", "Placement(stage=4)", "stage=4"),
    api("placement-dtype", "a dtype the factories do not know", "Placement(dtype='fp8')", "fp8"),
    api("optim-lr", "a negative learning rate", "OptimSpec(lr=-1e-5)", "lr=-1e-05"),
    api("optim-name", "an optimizer the project does not build", "OptimSpec(name='adam')", "adam", "adamw"),
    api("factory-dtype", "a dtype the config factory does not know", "train_ds_config(dtype='fp8')", "fp8"),
    api("factory-stage", "a stage the config factory does not know", "eval_ds_config(stage=5)", "stage=5"),
    api("ds-unknown-key", "a DeepSpeed key with a typo (DeepSpeed would ignore it)",
        "build(RoleSpec('ref', mlp, dict(eval_ds_config(), gradient_clipingg=1.0)))", "gradient_clipingg",
        "gradient_clipping"),
    api("ds-unknown-zero-key", "a zero_optimization key with a typo",
        "build(RoleSpec('ref', mlp, zero(eval_ds_config(), overlap_com=True)))", "zero_optimization.overlap_com",
        "overlap_comm"),
    api("trainable-without-optimizer", "a trainable role without an optimizer",
        "RoleSpec('actor', mlp, train_ds_config(), trainable=True)", "actor", "optimizer"),
    api("fp16-on-cpu", "fp16 on DeepSpeed's CPU accelerator",
        "build(RoleSpec('ref', mlp, eval_ds_config(dtype='fp16')))",
        "fp16", "bf16"),
    api("factory-not-a-module", "a model factory that returns something else",
        "build(RoleSpec('ref', lambda: 'weights.bin', eval_ds_config()), backend='torch')", "str",
        "torch.nn.Module"),
    api("unknown-role", "a role name with a typo", "build(RoleSpec('actor', mlp, train_ds_config(stage=0), "
        "optimizer=sgd), backend='torch')['actr']", "actr", "actor"),
    api("add-state", "checkpointing an object without state_dict", "EngineRegistry(backend='torch').add_state("
        "'sampler', object())", "sampler", "state_dict"),
    api("collator-unknown-role", "a chat message the template does not take, through a collator",
        "SFTCollator(tokenizer('chat_tok'), 16, 16)([{'messages': [{'role': 'tool', 'content': 'kiwi'}, "
        "{'role': 'assistant', 'content': 'kiwi'}]}])", "'tool'", "system, user, assistant"),
    api("check-data-no-template", "conversations for a tokenizer without a chat template",
        "check_rlhf_data(d + '/chats.jsonl', 'sft', tokenizer=tokenizer('plain_tok'))", "chat template"),
    api("image-data-no-images", "an image folder without images", "check_image_caption_data(d + '/meta_only')",
        "meta_only", "no images"),
    api("reward-spec", "a reward function spec without module:function", "load_reward_function('my_reward')",
        "my_reward"),
    api("reward-source-both", "a reward source that is both a model and a function",
        "RewardSource(name='r', role='reward', fn=len)", "exactly one of role= or fn="),
]


def write_data(d: Path) -> None:
    """The files the rows point at (`{d}`), built in a few seconds: tiny tokenizers and models, rows, images."""
    import json

    from multiengine.pipelines.rlhf import tiny
    from PIL import Image

    def jsonl(name: str, rows: list[dict]) -> None:
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    corpus = tiny.build_corpus(0, n_sft=16, n_reward=16, n_ppo=8, n_eval=8)
    jsonl("qa.jsonl", [{"question": f"list {i}", "answer": "a b c"} for i in range(8)])
    jsonl("sft.jsonl", [{"prompt": r["prompt"], "response": r["response"]} for r in corpus["sft"]])
    jsonl("pairs.jsonl", corpus["reward"])
    jsonl("chosen_only.jsonl", [{"prompt": f"list {i}", "chosen": "a b c"} for i in range(8)])
    chats = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
             for r in corpus["sft"]]
    jsonl("chats.jsonl", [{"messages": c} for c in chats])
    chats[3].insert(1, {"role": "tool", "content": "kiwi"})
    jsonl("chats_tool.jsonl", [{"messages": c} for c in chats])
    (d / "empty.jsonl").write_text("")
    (d / "notes.txt").write_text("prompt: list 3 fruits\n")
    (d / "dpo_typo.yaml").write_text("# a user's config with a typo\ndpo:\n  betta: 0.2\n")
    (d / "dup.yaml").write_text("# my run\nmax_steps: 3\ntrain:\n  lr: 1.0e-3\n  micro_batch_size: 2\n  lr: 2.0e-3\n")
    (d / "list.yaml").write_text("- max_steps: 3\n")
    (d / "broken.yaml").write_text("train:\n  lr: 1.0e-3\n micro_batch_size: 2\n")
    (d / "rewards.py").write_text("def score(prompts, completions, **kwargs):\n    return [0.0] * len(prompts)\n\n\n"
                                  "def needs_answer(prompts, completions, answer):\n"
                                  "    return [float(c == a) for c, a in zip(completions, answer)]\n")
    (d / "afile").write_text("not a folder\n")
    (d / "dangling").symlink_to(d / "nowhere")
    (d / "empty").mkdir()
    (d / "reward_run").mkdir()
    (d / "reward_run" / "run.json").write_text(json.dumps({"recipe": "rlhf_reward"}))
    (d / "reward_run" / "metrics.jsonl").write_text("")
    (d / "empty_model").mkdir()
    (d / "tf_folder").mkdir()
    (d / "tf_folder" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    tiny.train_tokenizer(tiny.task_vocabulary(), d / "plain_tok")
    tiny.build_tiny_causal_lm(d / "plain_model", d / "plain_tok", hidden=16, layers=1)
    for name, family in (("moe_model", "qwen3_moe"), ("olmoe_model", "olmoe")):  # transformers has no OLMoE classifier
        tiny.build_tiny_causal_lm(d / name, d / "plain_tok", hidden=16, layers=1, family=family)
    tiny.train_tokenizer(tiny.task_vocabulary(), d / "chat_tok", chat_template=True)
    tiny.build_tiny_causal_lm(d / "chat_model", d / "chat_tok", hidden=16, layers=1)
    for name in ("text_only", "empty_images", "meta_only", "rowless", "corrupt"):
        (d / name).mkdir()
    (d / "text_only" / "notes.txt").write_text("no images here\n")
    (d / "meta_only" / "metadata.jsonl").write_text("")
    Image.new("RGB", (16, 16)).save(d / "rowless" / "0.png")
    (d / "rowless" / "metadata.csv").write_text("file_name,text\n")
    corrupt = d / "corrupt"
    for i in range(12):  # more rows than the tiny config holds out, so the image check is what fails
        Image.new("RGB", (16, 16), (i * 20, 0, 0)).save(corrupt / f"{i}.png")
    (corrupt / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature, no image
    jsonl("corrupt/metadata.jsonl", [{"file_name": f, "text": "a red square"}
                                     for f in [*(f"{i}.png" for i in range(12)), "broken.png"]])


def api_namespace(d: Path) -> dict[str, Any]:
    """What the Python API rows' expressions see: the public names they use and a few helpers."""
    import torch
    from multiengine.engines import (
        EngineRegistry,
        OptimSpec,
        Placement,
        RoleSpec,
        eval_ds_config,
        train_ds_config,
    )
    from multiengine.pipelines.diffusion.data import check_image_caption_data
    from multiengine.pipelines.rlhf.data import SFTCollator, check_rlhf_data
    from multiengine.pipelines.rlhf.rewards import RewardSource, load_reward_function
    from transformers import AutoTokenizer

    def build(*specs: Any, backend: str = "deepspeed") -> Any:
        registry = EngineRegistry(backend=backend)
        for spec in specs:
            registry.add(spec)
        return registry.build()

    def nvme(config: dict, section: str) -> dict:
        config["zero_optimization"][section] = {"device": "nvme"}
        return config

    def device(config: dict, name: str) -> dict:
        config["zero_optimization"]["offload_param"] = {"device": name}
        return config

    def zero(config: dict, **keys: Any) -> dict:
        config["zero_optimization"].update(keys)
        return config

    return {"d": str(d), "build": build, "nvme": nvme, "device": device, "zero": zero,
            "mlp": lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
            "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
            "tokenizer": lambda name: AutoTokenizer.from_pretrained(str(d / name)),
            "EngineRegistry": EngineRegistry, "OptimSpec": OptimSpec, "Placement": Placement, "RoleSpec": RoleSpec,
            "eval_ds_config": eval_ds_config, "train_ds_config": train_ds_config, "SFTCollator": SFTCollator,
            "check_rlhf_data": check_rlhf_data, "check_image_caption_data": check_image_caption_data,
            "RewardSource": RewardSource, "load_reward_function": load_reward_function}


@dataclass
class Result:
    code: int | None  # the exit code (None: a Python API row)
    errors: list[str]  # the `error:` lines (a Python API row: "<exception type>: <message>")
    message: str  # as the docs show it: the error line (or exception) with the folders as {d} and {locked}
    new_files: list[str]  # what appeared under the data folder (or the locked folder)
    stderr: str
    skipped: str = ""  # why the row could not run here


def nobody_can_read(*paths: Path) -> bool:
    """As root, whether `nobody` reaches these files: a clone inside `mktemp -d` (mode 0700) is closed to it, and
    then a row acting as `nobody` cannot even read the CLI's configs."""
    if os.geteuid() != 0:
        return True
    with unprivileged():
        try:
            for path in paths:
                os.stat(path)
        except PermissionError:
            return False
    return True


def _paths(*roots: Path) -> set[Path]:
    return {p for root in roots for p in root.rglob("*")}


def run_row(row: Row, d: Path, locked: Path) -> Result:
    from multiengine.recipes.language.cli import main

    def shown(text: str) -> str:
        return text.replace(str(locked), "{locked}").replace(str(d), "{d}")

    if "{locked}" in row.command and not nobody_can_read(*configs_dir().glob("*/tiny.yaml")):
        return Result(None, [], "", [], "", skipped="acting as `nobody`, the CLI must read the shipped configs, and "
                      "this repository is under a folder only its owner may enter")
    before = _paths(d, locked.parent)
    command = row.command.replace("{d}", str(d)).replace("{locked}", str(locked))
    stderr = io.StringIO()
    if row.api:
        try:
            eval(command, api_namespace(d))  # noqa: S307 - the rows' own expressions
        except Exception as exc:  # the test says which types a row may raise
            errors, code = [f"{type(exc).__name__}: {exc}"], None
        else:
            errors, code = [], None
    else:
        argv = shlex.split(command)
        if argv[0] in ("validate", "run") and not argv[1].startswith("-") and not any(
                a.startswith("output_dir=") for a in argv):
            argv.append(f"output_dir={d / 'out' / row.id}")
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            with unprivileged() if "{locked}" in row.command else contextlib.nullcontext():
                try:
                    code = main(argv)
                except SystemExit as exc:  # argparse
                    code = exc.code
        errors = [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]
    new = sorted(shown(str(p)) for p in _paths(d, locked.parent) - before)
    return Result(code, errors, shown(errors[0].removeprefix("error: ") if errors else ""), new, stderr.getvalue())


def run_rows(d: Path) -> dict[str, Result]:
    """Every row, in one folder of data, with the working directory there (relative defaults land inside it)."""
    from multiengine.pipelines.rlhf import data as rlhf_data
    from multiengine.recipes import registry_demo  # noqa: F401 - imported before a row runs as another user

    assert rlhf_data  # the modules a row needs while acting as `nobody` are imported now
    write_data(d)
    locked = locked_folder()
    cwd = os.getcwd()
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MULTIENGINE_VALIDATED")
             if k in os.environ}
    try:
        os.chdir(d)
        return {row.id: run_row(row, d, locked) for row in ROWS}
    finally:
        os.chdir(cwd)
        os.environ.update(saved)
        shutil.rmtree(locked.parent)


def _cell(text: str) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(results: dict[str, Result]) -> str:
    lines = ["| Row | Area | Bad input | Command (`multiengine ...`) or Python call | Message |",
             "|---|---|---|---|---|"]
    documented = {line.split(" | ")[0].removeprefix("| "): line for line in docs_table().splitlines()}
    for row in ROWS:
        if results[row.id].skipped:  # not run here: the documented line stands
            lines.append(documented.get(row.id, f"| {row.id} | (not run) |"))
            continue
        message = results[row.id].message
        lines.append(f"| {row.id} | {row.area} | {row.what} | {_cell(row.command)} | {_cell(message)} |")
    return "\n".join(lines)


def docs_table() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    return run_rows(tmp_path_factory.mktemp("bad_input_table"))


def test_the_table_spans_every_area_with_60_cases_or_more():
    assert len({r.id for r in ROWS}) == len(ROWS) >= 60
    counts = {area: sum(r.area == area for r in ROWS) for area in AREAS}
    assert set(counts) == {r.area for r in ROWS} and min(counts.values()) >= 5, counts


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_each_bad_input_is_one_error_naming_it_and_writes_nothing(results, row):
    result = results[row.id]
    if result.skipped:
        pytest.skip(result.skipped)
    assert len(result.errors) == 1, f"{row.command}: {result.errors}\n{result.stderr[-3000:]}"
    if row.api:
        assert result.errors[0].split(":")[0] in ("ConfigError", "DataSourceError", "ValueError",
                                                  "UnknownRoleError"), result.errors[0]
    else:
        assert result.code == 2, f"{row.command}: exit {result.code}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr
    for name in row.names:
        assert name in result.message, f"{row.id}: {name!r} not in {result.message!r}"
    assert result.new_files == [], f"{row.id} left {result.new_files}"


def test_the_docs_table_is_what_these_runs_print(results):
    assert docs_table() == table(results), (
        "docs/bad-inputs.md differs from what the rows print now: run `python tests/unit/test_bad_input_table.py` "
        "to rewrite its table, and read the diff")


if __name__ == "__main__":
    # Rewrite the docs table from fresh runs of every row.
    with tempfile.TemporaryDirectory() as tmp:
        new = table(run_rows(Path(tmp)))
    text = DOC.read_text(encoding="utf-8")
    DOC.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + new + "\n" + text[text.index(END):],
                   encoding="utf-8")
    print(f"wrote {len(ROWS)} rows to {DOC}")
