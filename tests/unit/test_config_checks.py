"""Value checks before any rank starts (each field's checks, ``when``, a section's ``check()``, the recipe's
``validate``), `multiengine validate`, `multiengine run <recipe> --help`, and how a failing run is reported: once,
one `error:` line plus the fix, the traceback in a log file, exit 2 for user errors.

Uses throwaway recipe packages in a tmp dir, so it depends on no real recipe.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from multiengine.engines.settings import Choice, Each, FieldError, Length, Range, Satisfies, SettingsError
from multiengine.recipes.language import cli
from multiengine.recipes.language.config import (
    ConfigKeyError,
    ConfigValueError,
    RecipeDefinitionError,
    describe_keys,
    format_key_help,
    load_config,
    load_recipe,
    validate_config,
)
from toys import toy_package

PKG = "me_checks_recipes"

CHECKED = '''
import os
from dataclasses import dataclass
from pathlib import Path

from multiengine.engines.settings import (Choice, Each, FieldError, Length, PathExists, Range, Settings, section,
                                          setting)
from multiengine.recipes.language.config import RecipeConfigError, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class Data(Settings):
    path: str = setting("", "a JSONL file of rows", PathExists("file"))
    heldout: int = setting(2, "rows kept out for evaluation", Range(0))
    rows: int = setting(0, "rows to use (0 = all)", Range(0))
    shuffle: bool = setting(False, "shuffle the rows")
    shuffle_seed: int = setting(0, "the shuffle's seed", Range(0), when="shuffle")

    def check(self):
        if self.rows and self.heldout >= self.rows:
            raise FieldError("heldout", self.heldout, f"leaves no training rows of rows={self.rows}",
                             f"set heldout below {self.rows}")


@dataclass(frozen=True)
class CheckedConfig(RunConfig):
    output_dir: str = setting("out", "where the run writes everything")
    max_steps: int = setting(10, "optimizer steps to run", Range(1))
    mode: str = setting("full", "full fine-tuning or LoRA", Choice("full", "lora"))
    lr: float = setting(1e-3, "peak learning rate", Range(0, min_exclusive=True))
    warmup: float = setting(0.1, "fraction of max_steps spent warming up", Range(0, 1, max_exclusive=True))
    prompts: list[str] = setting(["a cat"], "prompts sampled at each evaluation", [Length(1), Each(Length(1))])
    data: Data = section(Data, "the training data", heldout=1)
    fail: str = setting("", "test switch", Choice("", "user", "bug", "engines", "rank1"))


class Checked(Recipe):
    name = "checked"
    roles = (Role("actor", "the policy", trainable=True, defaults={"stage": 0}),
             Role("critic", "frozen", defaults={"stage": 0}))
    Config = CheckedConfig
    omit = ("report_to",)

    @classmethod
    def validate(cls, cfg, world_size=1):
        marker = Path(cfg.output_dir) / "validated"
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "a") as f:
            f.write((os.environ["RANK"] if "TORCHELASTIC_RUN_ID" in os.environ else "parent") + "\\n")
        if cfg.data.path:
            rows = Path(cfg.data.path).read_text().splitlines()
            if cfg.data.heldout >= len(rows):
                raise config_problem("data.heldout", cfg.data.heldout, f"leaves no training rows ({len(rows)} rows)",
                                     f"set data.heldout below {len(rows)}")

    @classmethod
    def main(cls, cfg):
        rank = int(os.environ.get("RANK", "0"))
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        if cfg.fail == "user":
            raise RecipeConfigError("mode 'lora' needs roles.actor.lr >= 1e-4; set roles.actor.lr=1e-4")
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


RECIPE = Checked
'''

BAD_ROLE = '''
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


class BadRole(Recipe):
    name = "bad_role"
    roles = (Role("actor", "x", trainable=True, defaults={"learning_rate": 1.0}),)
    Config = RunConfig


RECIPE = BadRole
'''


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    with toy_package(tmp_path_factory.mktemp("checks"), PKG, {"checked": CHECKED, "bad_role": BAD_ROLE},
                     {"checked/tiny": "# Checked toy.\nmax_steps: 2\nmode: lroa\n"}) as where:
        yield where


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


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


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


def test_settings_check_their_fields_when_made_in_python_too():
    from multiengine.recipes.language.lifecycle import CheckpointSettings, NonfiniteSettings

    with pytest.raises(FieldError, match=r"keep_last=0 must be >= 1"):
        CheckpointSettings(every=1, keep_last=0)
    with pytest.raises(FieldError, match=r"max_skips=3 applies only with policy=skip"):
        NonfiniteSettings(max_skips=3)
    assert NonfiniteSettings(policy="skip", max_skips=3).max_skips == 3


# --- field checks inside load_config -------------------------------------------------------------
def test_valid_config_passes(toy, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n{}\n{}\n")
    cfg = load(toy, f"data.path={data}", "roles.critic.stage=3", "data.shuffle=true", "data.shuffle_seed=4")
    assert cfg.roles.critic.stage == 3 and cfg.data.shuffle_seed == 4 and cfg.data.heldout == 1


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
        ("roles.actor.stage=-1", "roles.actor.stage", "must be in [0, 3], got -1"),  # it follows no role
        ("roles.actor.lr=0", "roles.actor.lr", "must be > 0"),
        ("roles.actor.lora.r=-2", "roles.actor.lora.r", "must be >= 0"),
        ("max_steps=null", "max_steps", "must be set"),  # null only where the type admits it
        # the common keys' own checks, in every recipe
        ("seed=8589934592", "seed", "must be in [0, 4294967295]"),
        ("resume_from=/no/such/dir", "resume_from", "must be '', 'latest' or a checkpoint folder"),
        ("dist_timeout_s=0", "dist_timeout_s", "must be > 0"),
        # `when`: a key that matters only while another is set
        ("data.shuffle_seed=3", "data.shuffle_seed", "applies only when data.shuffle is set"),
        ("nonfinite.max_skips=3", "nonfinite.max_skips", "applies only with nonfinite.policy=skip"),
        ("checkpoint.keep_last=3", "checkpoint.keep_last", "applies only when checkpoint.every is set"),
        ("roles.actor.lora.alpha=16", "roles.actor.lora.alpha", "applies only when roles.actor.lora.r is set"),
        # a section's own rule across its fields (check()), named by the whole key
        ("data.rows=3", "data.heldout", None),
    ],
)
def test_bad_value_names_key_value_source_and_fix(toy, override, key, words):
    extra = ["data.heldout=3"] if key == "data.heldout" else []
    with pytest.raises(ConfigValueError) as info:
        load(toy, *extra, override)
    msg = str(info.value)
    assert f"config key '{key}' for recipe 'checked'" in msg and (words or "leaves no training rows of rows=3") in msg
    source = f"in override '{extra[0] if extra else override}'"
    assert f"({source})" in msg and "; fix: " in msg, msg
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


@pytest.mark.parametrize(("override", "words"), [
    ("report_to=wandb", "unknown config key 'report_to'"),  # a common key this recipe omits
    ("roles.critic.lr=0.1", "roles.critic is frozen: it has no lr"),
    ("roles.critic.gradient_checkpointing=true", "roles.critic is frozen: it has no gradient_checkpointing"),
    ("roles.critic.lora.r=8", "roles.critic is frozen: it has no lora"),
    ("roles.actor.gather_forward=true", "unknown config key 'roles.actor.gather_forward'"),
])
def test_a_key_the_recipe_does_not_have_is_refused_with_its_reason(toy, override, words):
    with pytest.raises(ConfigKeyError, match=words):
        load(toy, override)


def test_a_broken_declaration_is_the_recipes_bug(toy):
    with pytest.raises(RecipeDefinitionError, match=r"TrainableRole has no field\(s\) \['learning_rate'\]"):
        load_config("bad_role", None, [], package=toy["package"], configs_dir=toy["configs_dir"])


# --- validate ------------------------------------------------------------------------------------
def test_validate_hook_checks_the_data(toy, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n{}\n")
    cfg = load(toy, f"data.path={data}", "data.heldout=2", f"output_dir={tmp_path / 'o'}")
    with pytest.raises(SettingsError, match=r"'data.heldout' leaves no training rows \(2 rows\).*below 2"):
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


@pytest.mark.parametrize("override, words", [
    ("seed=8589934592", "config key 'seed'"),
    ("checkpoint.keep_last=0", "config key 'checkpoint.keep_last'"),
    ("resume_from={empty}", "config key 'resume_from'"),
    ("roles.critic.gradient_checkpointing=true", "roles.critic is frozen"),
])
def test_validate_refuses_the_common_keys_bad_values_with_one_error_line(toy, tmp_path, capsys, override, words):
    (tmp_path / "empty").mkdir()
    args = ["checkpoint.every=1", override.format(empty=tmp_path / "empty"), f"output_dir={tmp_path / 'o'}"]
    assert cli.main(cli_args(toy, "validate", "checked", *args)) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and words in errors[0], errors


def test_run_checks_before_any_rank_starts(toy, tmp_path, capsys):
    out = tmp_path / "o"
    code = cli.main(cli_args(toy, "run", "checked", "--nproc-per-node", "2", "max_steps=0", f"output_dir={out}"))
    assert code == 2
    err = capsys.readouterr().err
    assert "config key 'max_steps'" in err and err.count("error:") == 1
    assert not out.exists()  # nothing ran, not even the validate hook


# --- --help -----------------------------------------------------------------------------------------
def test_help_rows_give_each_key_its_type_checks_default_and_meaning(toy):
    recipe = load_recipe("checked", toy["package"], toy["configs_dir"])
    rows = {r["key"]: r for r in describe_keys(recipe)}
    assert list(rows)[:3] == ["output_dir", "seed", "max_steps"] and "report_to" not in rows  # omitted
    assert rows["max_steps"] == {"key": "max_steps", "type": "int, >= 1", "default": "10",
                                 "meaning": "optimizer steps to run"}
    assert rows["mode"]["type"] == "str, one of full, lora" and rows["mode"]["default"] == '"full"'
    assert rows["prompts"]["type"].startswith("list[str], non-empty")
    assert rows["data"]["type"] == "section" and rows["data"]["meaning"] == "the training data"
    assert rows["data.heldout"]["default"] == "1"  # the section's default as the recipe changed it
    assert rows["data.shuffle_seed"]["type"] == "int, >= 0, only with shuffle"
    assert rows["roles.critic.stage"]["type"] == "int, in [0, 3]" and "roles.critic.lr" not in rows  # frozen
    assert rows["roles.actor.lr"]["meaning"] == "peak learning rate" and rows["roles.actor.lora.r"]["default"] == "0"
    assert rows["seed"]["type"] == "int, in [0, 4294967295]"
    first = format_key_help("checked", recipe).splitlines()[0]
    assert first == "config keys of recipe 'checked' (set them in a YAML file or as key=value overrides):"


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
    assert "roles.actor.lora.target_modules" in capsys.readouterr().out


# --- errors at run time: once, with the fix, traceback to a file --------------------------------------
def _run(toy, *args, timeout=240):
    env = {k: v for k, v in os.environ.items()  # not what an in-process registry of another test left
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([toy["src"], os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "multiengine.recipes.language.cli",
                           *cli_args(toy, "run", "checked", *args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fail", "code", "words"), [
    ("user", 2, "needs roles.actor.lr >= 1e-4"),
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
    assert (out / "validated").read_text() == "parent\n"  # validate ran once, not per rank


@pytest.mark.timeout(300)
def test_the_failing_rank_is_named(toy, tmp_path):
    out = tmp_path / "o"
    proc = _run(toy, "--nproc-per-node", "2", "fail=rank1", f"output_dir={out}")
    assert proc.returncode == 1
    errors = _error_lines(proc.stderr)
    assert errors == ["error: rank 1: KeyError: 'missing'"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and (out / "logs" / "rank1-error.log").is_file()


@pytest.mark.timeout(180)
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
