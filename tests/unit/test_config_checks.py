"""Value checks before any rank starts (a recipe's CHECKS and validate(cfg)), `multiengine validate`,
`multiengine run <recipe> --help`, and how a failing run is reported: once, one `error:` line plus the
fix, the traceback in a log file, exit 2 for user errors.

Uses throwaway recipe packages in a tmp dir, so it depends on no real recipe.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from multiengine.engines.recipe_config import (
    Choice,
    ConfigValueError,
    Each,
    Length,
    Range,
    RecipeDefinitionError,
    Satisfies,
    describe_keys,
    key_meanings,
    load_config,
    load_recipe,
    validate_config,
)
from multiengine.recipes import cli

PKG = "me_checks_recipes"

COMMON = '''
from multiengine.engines.recipe_config import Key

COMMON_KEYS = {
    "output_dir": Key("out", "where the run writes everything"),
    "seed": Key(0, "base seed of every random stream"),
    "max_steps": Key(10, "optimizer steps to run"),
}
'''

CHECKED = '''
import os
from pathlib import Path

from multiengine.engines.recipe_config import (Choice, Each, Length, PathExists, Range, RecipeConfigError, Satisfies,
                                        config_problem)

from multiengine.engines.recipe_config import Key, split_keys

from .common import COMMON_KEYS

DEFAULTS, HELP = split_keys({
    **COMMON_KEYS,
    "mode": Key("full", "full fine-tuning or LoRA"),
    "lr": Key(1e-3, "peak learning rate"),
    "warmup": 0.1,
    "prompts": Key(["a cat"], "prompts sampled at each evaluation"),
    "data": Key({
        "path": Key("", "a JSONL file of rows"),
        "heldout": Key(2, "rows kept out for evaluation"),
    }, "the training data"),
    "roles": Key({"actor": {"stage": 0, "width": 64}, "critic": {"stage": 0, "width": 64}}, "ZeRO placement per role"),
    "resume_from": Key(None, "checkpoint folder to resume from"),
    "extra": Key({}, "passed to DeepSpeed as is"),
    "fail": Key("", "test switch: '', 'user', 'bug', 'engines', 'rank1'"),
})
HELP.update({"warmup": "fraction of max_steps spent warming up", "seed": "overridden meaning"})
CHECKS = {
    "max_steps": Range(1),
    "mode": Choice("full", "lora"),
    "lr": Range(0, min_exclusive=True),
    "warmup": Range(0, 1, max_exclusive=True),
    "prompts": [Length(1), Each(Length(1))],
    "data.path": PathExists("file"),
    "roles.*.stage": Range(0, 3),
    "roles.*.width": Satisfies(lambda w: w % 8 == 0, "a multiple of 8"),
    "resume_from": PathExists("dir"),
}


def validate(cfg):
    marker = Path(cfg.output_dir) / "validated"
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "a") as f:
        f.write((os.environ["RANK"] if "TORCHELASTIC_RUN_ID" in os.environ else "parent") + "\\n")
    if cfg.data.path:
        rows = Path(cfg.data.path).read_text().splitlines()
        if cfg.data.heldout >= len(rows):
            raise config_problem("data.heldout", cfg.data.heldout, f"leaves no training rows ({len(rows)} rows)",
                                 f"set data.heldout below {len(rows)}")


def main(cfg):
    rank = int(os.environ.get("RANK", "0"))
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    if cfg.fail == "user":
        raise RecipeConfigError("mode 'lora' needs roles.actor.width >= 16; set roles.actor.width=16")
    if cfg.fail == "engines":
        from multiengine.engines import ConfigError
        raise ConfigError("role 'actor': fp16.enabled=true, but the CPU has no fp16; use dtype='bf16'")
    if cfg.fail == "bug":
        return [][1]
    if cfg.fail == "rank1" and rank == 1:
        return {}["missing"]
    if cfg.fail == "rank1":
        import time
        time.sleep(30)  # the launcher stops this rank when rank 1 fails
    return {"ok": True}
'''

BAD_CHECKS = '''
from multiengine.engines.recipe_config import Range
DEFAULTS = {"output_dir": "out", "seed": 0, "max_steps": 1}
CHECKS = {"max_step": Range(1)}


def main(cfg):
    return {}
'''


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checks")
    pkg = root / "src" / PKG
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "common.py").write_text(COMMON)
    (pkg / "checked.py").write_text(CHECKED)
    (pkg / "bad_checks.py").write_text(BAD_CHECKS)
    configs = root / "configs"
    (configs / "checked").mkdir(parents=True)
    (configs / "checked" / "tiny.yaml").write_text("# Checked toy.\nmax_steps: 2\nmode: lroa\n")
    sys.path.insert(0, str(root / "src"))
    yield {"package": PKG, "configs_dir": str(configs), "src": str(root / "src")}
    sys.path.remove(str(root / "src"))
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def load(toy, *overrides, config=None):
    return load_config("checked", config, list(overrides), package=toy["package"], configs_dir=toy["configs_dir"])


def cli_args(toy, *args):
    return ["--recipes-package", toy["package"], "--configs-dir", toy["configs_dir"], *args]


# --- the Check types ---------------------------------------------------------------------------
def test_check_types():
    assert Range(1).problem(0) == "must be >= 1" and Range(1).problem(1) is None
    assert Range(0, min_exclusive=True).problem(0.0) == "must be > 0"
    assert Range(0, 1, max_exclusive=True).describe() == "in [0, 1)" and Range(0, 1).problem(1) is None
    assert Range(None, 5).problem(6) == "must be <= 5" and Range(0).problem(float("nan")) == "must be >= 0"
    assert Range(0).problem(True) is not None  # a bool is not a number here
    assert Choice("a", "b").problem("c") == "must be one of a, b"
    assert Choice("full", "lora").fix("mode", "lroa").startswith("did you mean mode=lora?")
    assert Length(1).problem([]) == "must be non-empty (it has 0)" and Length(1, 2).problem("abc") is not None
    assert Each(Range(0)).problem([1, -1]) == "item 1 (-1) must be >= 0"
    assert Satisfies(lambda v: v % 8 == 0, "a multiple of 8").problem(12) == "must be a multiple of 8"
    with pytest.raises(TypeError):
        Range()


# --- CHECKS inside load_config -----------------------------------------------------------------
def test_valid_config_passes(toy, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n{}\n{}\n")
    cfg = load(toy, f"data.path={data}", "roles.critic.stage=3", "resume_from=null")
    assert cfg.roles.critic.stage == 3


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("max_steps=0", "max_steps", "must be >= 1, got 0"),
        ("max_steps=-1", "max_steps", "must be >= 1, got -1"),
        ("mode=foo", "mode", "must be one of full, lora, got 'foo'"),
        ("lr=0", "lr", "must be > 0"),
        ("warmup=1.0", "warmup", "must be in [0, 1)"),
        ("prompts=[]", "prompts", "must be non-empty"),
        ("prompts=[a, '']", "prompts", "item 1 ('') must be non-empty"),
        ("data.path=/no/such.jsonl", "data.path", "must be an existing file (no such path)"),
        ("roles.critic.stage=5", "roles.critic.stage", "must be in [0, 3], got 5"),
        ("roles.actor.width=12", "roles.actor.width", "must be a multiple of 8"),
        ("resume_from=/no/such/dir", "resume_from", "must be an existing folder"),
        ("max_steps=null", "max_steps", "must be set"),  # null only where the default is null
    ],
)
def test_bad_value_names_key_value_source_and_fix(toy, override, key, words):
    with pytest.raises(ConfigValueError) as info:
        load(toy, override)
    msg = str(info.value)
    assert f"config key '{key}' for recipe 'checked'" in msg and words in msg, msg
    assert f"(in override '{override}')" in msg and "; fix: " in msg
    assert info.value.key == key and info.value.fix


def test_every_problem_is_listed_with_its_source(toy, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 0\n")
    with pytest.raises(ConfigValueError) as info:
        load(toy, "mode=lroa", "roles.actor.stage=9", config=str(path))
    msg = str(info.value)
    assert msg.startswith("config for recipe 'checked' has 3 problems:")
    assert f"max_steps' for recipe 'checked' must be >= 1, got 0 (in {path})" in msg
    assert "did you mean mode=lora?" in msg and "roles.actor.stage" in msg
    assert [p.key for p in info.value.problems] == ["max_steps", "mode", "roles.actor.stage"]


def test_broken_checks_are_the_recipes_bug(toy):
    with pytest.raises(RecipeDefinitionError, match="'max_step' matches no key"):
        load_config("bad_checks", None, [], package=toy["package"], configs_dir=toy["configs_dir"])


# --- validate(cfg) --------------------------------------------------------------------------------
def test_validate_hook_checks_the_data(toy, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n{}\n")
    cfg = load(toy, f"data.path={data}", f"output_dir={tmp_path / 'o'}")
    with pytest.raises(ConfigValueError, match=r"'data.heldout' leaves no training rows \(2 rows\).*below 2"):
        validate_config("checked", cfg, package=toy["package"], configs_dir=toy["configs_dir"])


def test_validate_command(toy, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n{}\n{}\n")
    out = tmp_path / "o"
    assert cli.main(cli_args(toy, "validate", "checked", f"data.path={data}", f"output_dir={out}")) == 0
    assert "ok: config for recipe 'checked' is valid" in capsys.readouterr().out
    assert (out / "validated").read_text() == "parent\n"  # the hook ran, once
    assert cli.main(cli_args(toy, "validate", "checked", "--config", "tiny")) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "mode=lora" in err and "Traceback" not in err
    assert cli.main(cli_args(toy, "validate", "checked", f"data.path={data}", "data.heldout=5",
                             f"output_dir={out}")) == 2
    assert "data.heldout" in capsys.readouterr().err
    assert cli.main(cli_args(toy, "validate", "checked", "--print", f"output_dir={out}")) == 0
    assert f"output_dir: {out}" in capsys.readouterr().out


def test_run_checks_before_any_rank_starts(toy, tmp_path, capsys):
    out = tmp_path / "o"
    code = cli.main(cli_args(toy, "run", "checked", "--nproc-per-node", "2", "max_steps=0", f"output_dir={out}"))
    assert code == 2
    err = capsys.readouterr().err
    assert "config key 'max_steps'" in err and err.count("error:") == 1
    assert not out.exists()  # nothing ran, not even the validate hook


# --- --help -----------------------------------------------------------------------------------------
def test_key_meanings_from_typed_keys_splats_and_help(toy):
    module = load_recipe("checked", toy["package"], toy["configs_dir"])
    meanings = key_meanings(module)
    assert meanings["output_dir"] == "where the run writes everything"  # through **COMMON_KEYS
    assert meanings["seed"] == "overridden meaning"  # HELP wins
    assert meanings["warmup"] == "fraction of max_steps spent warming up"  # HELP fills a gap
    assert meanings["data"] == "the training data" and meanings["data.heldout"] == "rows kept out for evaluation"
    assert meanings["roles"] == "ZeRO placement per role"  # a section's own meaning
    rows = {r["key"]: r for r in describe_keys(module)}
    assert list(rows) == ["output_dir", "seed", "max_steps", "mode", "lr", "warmup", "prompts", "data", "data.path",
                          "data.heldout", "roles", "roles.actor", "roles.actor.stage", "roles.actor.width",
                          "roles.critic", "roles.critic.stage", "roles.critic.width", "resume_from", "extra", "fail"]
    assert rows["max_steps"] == {"key": "max_steps", "type": "int, >= 1", "default": "10",
                                 "meaning": "optimizer steps to run"}
    assert rows["mode"]["type"] == "str, one of full, lora" and rows["mode"]["default"] == '"full"'
    assert rows["prompts"]["type"].startswith("list[str], non-empty")
    assert rows["roles.critic.stage"]["type"] == "int, in [0, 3]"
    assert rows["resume_from"]["type"] == "any, an existing folder" and rows["resume_from"]["default"] == "null"
    assert rows["extra"]["type"] == "mapping (free-form)" and rows["data"]["type"] == "section"


def test_run_help_lists_every_key(toy, capsys):
    assert cli.main(cli_args(toy, "run", "checked", "--help")) == 0
    out = capsys.readouterr().out
    assert "usage: multiengine run" in out and "config keys of recipe 'checked'" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    assert "int, >= 1" in lines["max_steps"] and "optimizer steps to run" in lines["max_steps"]
    assert "a JSONL file of rows" in lines["data.path"] and "an existing file" in lines["data.path"]
    assert cli.main(cli_args(toy, "run", "--help")) == 0
    assert "<recipe> --help" in capsys.readouterr().out
    assert cli.main(cli_args(toy, "validate", "checked", "-h")) == 0
    assert "roles.actor.width" in capsys.readouterr().out


# --- errors at run time: once, with the fix, traceback to a file --------------------------------------
def _run(toy, *args, timeout=180):
    env = {k: v for k, v in os.environ.items()  # not what an in-process registry of another test left
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([toy["src"], os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "multiengine.recipes.cli", *cli_args(toy, "run", "checked", *args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fail", "code", "words"), [
    ("user", 2, "needs roles.actor.width >= 16"),
    ("engines", 2, "use dtype='bf16'"),
    ("bug", 1, "IndexError: list index out of range"),
])
def test_failure_on_two_ranks_is_reported_once(toy, tmp_path, fail, code, words):
    out = tmp_path / "o"
    proc = _run(toy, "--nproc-per-node", "2", f"fail={fail}", f"output_dir={out}")
    assert proc.returncode == code, proc.stderr[-3000:]
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "Sending process" not in proc.stderr  # the launcher's own chatter goes to its log file
    log = proc.stderr.split("traceback: ", 1)[1].splitlines()[0]
    assert log.startswith(str(out / "logs")) and "Traceback (most recent call last)" in open(log).read()
    assert (out / "validated").read_text() == "parent\n"  # validate(cfg) ran once, not per rank


@pytest.mark.timeout(300)
def test_the_failing_rank_is_named(toy, tmp_path):
    out = tmp_path / "o"
    proc = _run(toy, "--nproc-per-node", "2", "fail=rank1", f"output_dir={out}")
    assert proc.returncode == 1
    errors = _error_lines(proc.stderr)
    assert errors == ["error: rank 1: KeyError: 'missing'"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and (out / "logs" / "rank1-error.log").is_file()


@pytest.mark.timeout(120)
def test_failure_in_one_process(toy, tmp_path):
    out = tmp_path / "o"
    proc = _run(toy, "fail=user", f"output_dir={out}")
    assert proc.returncode == 2 and len(_error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    assert "Traceback" in (out / "logs" / "rank0-error.log").read_text()
    # An output_dir that cannot be created is refused before the recipe runs, naming the key.
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _run(toy, f"output_dir={blocker}/sub")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_lines(proc.stderr) == [
        f"error: config key 'output_dir' cannot be created: {blocker} is a file (value '{blocker}/sub'); fix: point "
        "output_dir at a folder whose parents are folders"]
