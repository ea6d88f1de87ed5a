"""The later setting wins: an override that turns a feature off leaves the feature's details that the file set
inactive (named by validate, not refused), on every shipped config of every recipe; the same contradiction written in
one place (one override list, one file) is still refused naming the key. Nothing here builds a model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from multiengine.engines.settings import SettingsError, sets_feature
from multiengine.recipes.language import cli
from multiengine.recipes.language.config import (
    Leaf,
    RecipeConfigError,
    config_path,
    flatten,
    inactive_keys,
    leaves,
    list_recipes,
    load_config,
    load_recipe,
    recipe_schema,
    validate_config,
)
from test_bad_input_table import locked_folder, unprivileged

CONFIGS = [(recipe, name) for recipe, names in list_recipes().items() for name in names]


def _switch(path: str, leaf: Leaf) -> str:
    """The key a ``when`` condition names (a dotted name is from the config's root, else a sibling)."""
    name = leaf.when.partition("=")[0]
    return name if "." in name or "." not in path else f"{path.rsplit('.', 1)[0]}.{name}"


def switch_offs(recipe: str, cfg) -> dict[str, str]:
    """``{override that turns a feature off: the switch}`` for each feature ``cfg`` has on that has ``when`` keys:
    a bool or number switch set to false/0, a ``switch=value`` condition's switch back to its default where that is
    not the value (``generation.engine=hf``); plus ``eval.every=0``. A text switch (a model folder, an environment)
    names a thing rather than a feature: emptying it picks another model, so it is left out."""
    values, out = flatten(cfg), {}
    keys = leaves(recipe_schema(load_recipe(recipe)))
    for path, leaf in keys.items():
        if not leaf.when:
            continue
        switch = _switch(path, leaf)
        value, (_, eq, wanted) = values[switch], leaf.when.partition("=")
        default = keys[switch].default
        if eq and wanted and str(value).lower() == wanted.lower() and str(default).lower() != wanted.lower():
            out[f"{switch}={default}"] = switch
        elif not eq and value and isinstance(value, (bool, int, float)):
            out[f"{switch}={'false' if isinstance(value, bool) else 0}"] = switch
    if "eval.every" in keys:
        out["eval.every=0"] = "eval.every"
    return out


def _dependents(recipe: str, cfg, switch: str) -> set[str]:
    """The keys the file set that the switch turns off: its ``when`` keys, and theirs, asking for something."""
    values, keys = flatten(cfg), leaves(recipe_schema(load_recipe(recipe)))
    found, todo = set(), [switch]
    while todo:
        on = todo.pop()
        for path, leaf in keys.items():
            if leaf.when and _switch(path, leaf) == on and sets_feature(values[path], leaf.default):
                found.add(path)
                todo.append(path)
            if any(w.partition("=")[0] == on and item in values[path] for item, w in leaf.items_when):
                found.add(path)  # a list naming an item of the feature (export.roles: [unet, ema])
    return found


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # the GPU configs name hub models and datasets: offline, their absence is refused at once, not after retries
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _validate(recipe: str, name: str, overrides: list[str]) -> tuple[object, str | None]:
    """The loaded config and the key validate refused (None: accepted)."""
    cfg = load_config(recipe, name, overrides)
    try:
        validate_config(recipe, cfg, world_size=1)
    except SettingsError as e:
        return cfg, getattr(e, "key", None) or str(e)
    return cfg, None


@pytest.mark.parametrize("recipe, name", CONFIGS, ids=[f"{r}-{n}" for r, n in CONFIGS])
def test_every_switch_off_is_accepted_and_names_the_inactive_keys(recipe, name, tmp_path):
    out = [f"output_dir={tmp_path / 'run'}"]
    base, base_refusal = _validate(recipe, name, out)  # a GPU config may be refused here: no model folder offline
    switches = switch_offs(recipe, base)
    assert "checkpoint.every=0" in switches or not base.checkpoint.every
    refused = {}
    for override, switch in switches.items():
        cfg, refusal = _validate(recipe, name, [*out, override])
        expected = _dependents(recipe, base, switch)
        assert set(inactive_keys(cfg)) == expected, (override, inactive_keys(cfg))
        keys = leaves(recipe_schema(load_recipe(recipe)))
        for key in expected:  # back to its default (an item: out of its list); the reason names the switch and where
            items = [item for item, w in keys[key].items_when if w.partition("=")[0] == switch]
            assert all(i not in flatten(cfg)[key] for i in items) if items else flatten(cfg)[key] == keys[key].default
            assert f"{switch}=" in inactive_keys(cfg)[key] and f"in override '{override}'" in inactive_keys(cfg)[key]
        if refusal is not None and refusal != base_refusal:
            refused[(recipe, override)] = refusal
    assert refused == {}, refused


def test_the_switch_offs_of_the_issue_are_among_those_walked():
    walked = {(r, n): set(switch_offs(r, load_config(r, n))) for r, n in CONFIGS}
    assert {"checkpoint.every=0", "eval.size=0", "eval.every=0"} <= walked[("rlhf_grpo", "tiny")]
    assert {"validation.enabled=false", "ema.enabled=false", "export.enabled=false"} <= walked[("sd_finetune", "tiny")]
    assert "roles.unet.lora.r=0" in walked[("sd_finetune", "sd15_lora")]
    assert "generation.engine=hf" in walked[("rlhf_grpo", "tiny_vllm")]


def test_lora_switched_off_on_a_lora_config_leaves_its_details_inactive():
    cfg = load_config("sd_finetune", "sd15_lora", ["roles.unet.lora.r=0"])
    assert cfg.roles.unet.lora.r == 0 and {"roles.unet.lora.alpha", "roles.unet.lora.target_modules"} <= set(
        inactive_keys(cfg))
    assert inactive_keys(load_config("sd_finetune", "sd15_lora")) == {}


def test_a_contradiction_in_one_place_is_refused_naming_the_key(tmp_path):
    # one override list: lora.alpha without lora.r (r=0 in the file)
    alpha = r"'roles\.actor\.lora\.alpha' .* applies only when roles\.actor\.lora\.r is set, got 16\.0 \(in override"
    with pytest.raises(RecipeConfigError, match=alpha):
        load_config("rlhf_sft", "tiny", ["roles.actor.lora.alpha=16"])
    # one override list that turns the switch off and sets a detail
    with pytest.raises(RecipeConfigError, match=r"'checkpoint\.keep_last' .* applies only when checkpoint\.every"):
        load_config("rlhf_grpo", "tiny", ["checkpoint.every=0", "checkpoint.keep_last=5"])
    # one override list: a list naming an item of the feature it turns off
    with pytest.raises(RecipeConfigError, match=r"'export\.roles' .* names 'ema', which applies only when ema\.en"):
        load_config("sd_finetune", "tiny", ["ema.enabled=false", "export.roles=[unet,ema]"])
    # one file: the detail set beside a switch the file leaves off
    mine = tmp_path / "mine.yaml"
    mine.write_text((Path(__file__).parents[2] / "recipes/configs/rlhf_sft/tiny.yaml").read_text()
                    + "\ncheckpoint: {every: 0, keep_last: 5}\n")
    with pytest.raises(RecipeConfigError, match=rf"'checkpoint\.keep_last' .* got 5 \(in {mine}\)"):
        load_config("rlhf_sft", str(mine))
    # a detail set in an override, its switch off in the (earlier) file: refused, the override is the later word
    mine.write_text("checkpoint: {every: 0}\n")
    with pytest.raises(RecipeConfigError, match=r"'checkpoint\.keep_last' .* \(in override"):
        load_config("rlhf_sft", str(mine), ["checkpoint.keep_last=5"])
    # an off value beside its switch off is no contradiction: eval.judge=false with eval.size=0
    cfg = load_config("rlhf_grpo", "tiny", ["eval.size=0", "eval.judge=false", "eval.every=0"])
    assert (cfg.eval.size, cfg.eval.judge) == (0, False) and inactive_keys(cfg) == {}


def test_a_switch_off_in_a_file_after_the_defaults_and_a_chain_of_switches(tmp_path):
    # a when key whose switch is itself a when key: ema.enabled=false turns off use_ema_warmup, and so inv_gamma
    mine = tmp_path / "mine.yaml"
    mine.write_text("ema: {enabled: true, use_ema_warmup: true, inv_gamma: 2.0}\n")
    cfg = load_config("sd_finetune", str(mine), ["ema.enabled=false", "export.roles=[unet]"])
    assert set(inactive_keys(cfg)) == {"ema.use_ema_warmup", "ema.inv_gamma"}
    assert (cfg.ema.use_ema_warmup, cfg.ema.inv_gamma) == (False, 1.0)


def test_the_cli_accepts_a_switch_off_and_prints_the_inactive_keys_once(tmp_path, capsys):
    exe = shutil.which("multiengine") or str(Path(sys.executable).with_name("multiengine"))
    proc = subprocess.run([exe, "validate", "rlhf_grpo", "--config", "tiny", "checkpoint.every=0",
                           f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("inactive keys")]
    assert len(lines) == 1 and "checkpoint.keep_last" in lines[0], proc.stdout
    assert "checkpoint.every=0 in override 'checkpoint.every=0'" in lines[0]
    assert proc.stdout.rstrip().endswith("ok: config for recipe 'rlhf_grpo' is valid")
    assert cli.main(["validate", "rlhf_sft", "--config", "tiny", "roles.actor.lora.alpha=16"]) == 2
    assert "'roles.actor.lora.alpha'" in _one_error(capsys)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_sd_finetune_with_validation_off_names_an_imageless_folder_or_an_unwritable_output_dir(tmp_path, capsys):
    base = ["validate", "sd_finetune", "--config", "tiny", "validation.enabled=false"]
    empty, texts = tmp_path / "empty", tmp_path / "texts"
    empty.mkdir()
    texts.mkdir()
    (texts / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "caption": "a cat"}) + "\n")
    for folder, what in ((empty, "it is empty"), (texts, "it holds only metadata.jsonl")):
        assert cli.main([*base, f"data.source={folder}", f"output_dir={tmp_path / 'run'}"]) == 2
        line = _one_error(capsys)
        assert f"data.source='{folder}' is an image folder with no images ({what})" in line, line
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    assert cli.main([*base, f"output_dir={afile / 'run'}"]) == 2
    assert f"'output_dir' cannot be created: {afile} is a file" in _one_error(capsys)
    locked = locked_folder()
    try:  # as nobody, the config is read from a copy anyone may read (a clone's own folder may be root's alone)
        config = str(shutil.copy(config_path("sd_finetune", "tiny"), locked.parent / "tiny.yaml"))
        with unprivileged():
            code = cli.main(["validate", "sd_finetune", "--config", config, *base[4:], f"output_dir={locked / 'run'}"])
        assert code == 2
        line = _one_error(capsys)
        assert "'output_dir' is not writable" in line and str(locked) in line, line
    finally:
        shutil.rmtree(locked.parent)


def test_a_run_logs_the_inactive_keys_first_and_records_them_in_its_summary(tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert cli.main(["run", "registry_demo", "--config", "tiny", "backend=torch", "checkpoint.every=0",
                         "max_steps=1", "plot=false", f"output_dir={out}"]) == 0
    first = caplog.messages[0]
    assert first.startswith("inactive keys") and "checkpoint.keep_last" in first, caplog.messages[:2]
    assert sum("inactive keys" in m for m in caplog.messages) == 1
    recorded = json.loads((out / "summary.json").read_text())["inactive_keys"]
    assert list(recorded) == ["checkpoint.keep_last"] and "checkpoint.every=0" in recorded["checkpoint.keep_last"]
