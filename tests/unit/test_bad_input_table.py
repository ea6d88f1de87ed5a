"""Bad inputs that used to run or fail late, each refused up front with the key, the value and the fix."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from multiengine.recipes.config import (
    ConfigValueError,
    DuplicateKeyError,
    RecipeConfigError,
    _yaml_load,
    check_output_dir_writable,
    load_config,
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
        _yaml_load("a:\n  - {x: 1}\n  - {x: 1,\n     x: 3}\n")
    assert (err.value.key, err.value.first_line, err.value.second_line) == ("a[1].x", 3, 4)
    # the same name in two sections, and a merge key overridden beside it, are not duplicates
    assert _yaml_load("a: {x: 1}\nb: {x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}
    assert _yaml_load("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n")["other"] == {"x": 2}
    with pytest.raises(RecipeConfigError, match=r"malformed override 'validation=\{a: 1, a: 2\}': key 'a' is set "
                                                r"twice"):
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
    with pytest.raises(ConfigValueError, match=r"'output_dir' is an existing file, not a folder .*fix: point"):
        check_output_dir_writable(str(afile))
    with pytest.raises(ConfigValueError, match=rf"'output_dir' cannot be created: {afile} is a file"):
        check_output_dir_writable(str(afile / "run"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigValueError, match=r"is a link to .*nowhere, which does not exist"):
        check_output_dir_writable(str(tmp_path / "dangling"))
    locked = locked_folder()
    try:
        for target, where in ((locked / "run" / "a", f"in {locked}, where it would be created"), (locked, "in it")):
            with unprivileged(), pytest.raises(ConfigValueError) as err:
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
        f"data.source: chat messages of {path} (row 4) have role 'tool', which the chat template of model.pretrained "
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
