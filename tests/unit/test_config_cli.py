"""Recipe configs (the typed Config's defaults, then a YAML file, then key=value overrides, strictly) and the
`multiengine` CLI.

Uses a throwaway recipe package and configs folder in a tmp dir, so it depends on no real recipe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
from multiengine.recipes.language import cli, launcher
from multiengine.recipes.language.config import (
    ConfigKeyError,
    ConfigTypeError,
    OverrideSyntaxError,
    RecipeConfigError,
    RecipeDefinitionError,
    UnknownConfigError,
    UnknownRecipeError,
    config_path,
    list_recipes,
    load_config,
    parse_override,
)
from multiengine.recipes.language.launcher import Nodes
from toys import toy_package

PKG = "me_toy_recipes"  # unique, so it cannot shadow or be shadowed by anything installed
CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]

TOY = '''
import json
import os
from dataclasses import dataclass
from pathlib import Path

from multiengine.engines.settings import Range, setting
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class ToyConfig(RunConfig):
    output_dir: str = setting("out", "where the run writes")
    max_steps: int = setting(10, "optimizer steps", Range(1))
    lr: float = setting(1e-3, "a rate")
    use_bf16: bool = setting(False, "a switch")
    name: str = setting("toy", "a name")
    dtype: str = setting("bf16", "a dtype's name")
    prompts: list[str] = setting(["a cat"], "prompts")
    extra: dict = setting({}, "handed on as it is")
    tag: str | None = setting(None, "anything, or null")
    fail: bool = setting(False, "raise after writing the rank file")


class Toy(Recipe):
    name = "toy"
    roles = (Role("actor", "trained", trainable=True, defaults={"stage": 0}),
             Role("critic", "frozen", defaults={"stage": 0}))
    Config = ToyConfig
    renamed = {"steps": "max_steps", "actor.*": "roles.actor.*"}

    @classmethod
    def main(cls, cfg):
        rank = os.environ.get("RANK", "0")
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "world": os.environ.get("WORLD_SIZE"), "omp": os.environ.get("OMP_NUM_THREADS"),
                  "max_steps": cfg.max_steps}
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        if cfg.fail:
            raise RuntimeError("toy recipe asked to fail")
        return {"steps": cfg.max_steps, "lr": cfg.lr, "rank": int(rank), "stage": cfg.roles.actor.stage}


RECIPE = Toy
'''

BROKEN = '''
from dataclasses import dataclass

from multiengine.engines.settings import Settings, setting
from multiengine.recipes.language.lifecycle import Recipe


@dataclass(frozen=True)
class NoSeed(Settings):
    output_dir: str = setting("out", "where")
    max_steps: int = setting(1, "steps")


class Broken(Recipe):
    name = "broken"
    Config = NoSeed


RECIPE = Broken
'''

TINY_YAML = """\
# Toy recipe, tiny: two steps, actor at ZeRO-2.
# Hardware tested: CPU.
# Command: multiengine run toy --config tiny
max_steps: 2
roles:
  actor:
    stage: 2
"""

BAD_YAML = """\
# Toy recipe with a typo.
max_step: 2
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A recipe package on sys.path plus its configs folder; returns the CLI's pointing flags."""
    with toy_package(tmp_path_factory.mktemp("toy"), PKG,
                     {"toy": TOY, "broken": BROKEN, "helpers": "X = 1\n"},
                     {"toy/tiny": TINY_YAML, "toy/bad": BAD_YAML}) as where:
        yield where


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """cli.run installs a handler on the root logger bound to the (captured) stderr: undo it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def load(toy: dict[str, str], config: str | None = None, *overrides: str, recipe: str = "toy"):
    return load_config(recipe, config, list(overrides), package=toy["package"], configs_dir=toy["configs_dir"])


def cli_args(toy: dict[str, str], *args: str) -> list[str]:
    return ["--recipes-package", toy["package"], "--configs-dir", toy["configs_dir"], *args]


# --- load_config ---------------------------------------------------------------------------
def test_defaults_only_as_a_typed_frozen_object(toy):
    cfg = load(toy)
    assert cfg.max_steps == 10 and cfg.roles.actor.stage == 0 and cfg.prompts == ["a cat"]
    assert cfg.roles["critic"].stage == 0 and list(cfg.roles) == ["actor", "critic"]
    with pytest.raises(AttributeError):
        _ = cfg.max_step  # a typo in recipe code fails too
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 1
    assert cfg.to_dict()["roles"]["actor"]["lora"]["r"] == 0 and json.dumps(cfg.to_dict())


def test_shipped_config_then_overrides(toy):
    cfg = load(toy, "tiny")
    assert cfg.max_steps == 2 and cfg.roles.actor.stage == 2 and cfg.roles.critic.stage == 0
    cfg = load(toy, "tiny", "max_steps=3", "roles.actor.stage=3", "roles.critic.stage=1", "prompts=[a, b c]",
               "lr=1", "use_bf16=true", "seed=7", "max_steps=4")
    assert cfg.max_steps == 4  # the later override wins
    assert cfg.roles.actor.stage == 3 and cfg.roles.critic.stage == 1 and cfg.roles.actor.offload_params is False
    assert cfg.prompts == ["a", "b c"]
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an int is fine for a float key
    assert cfg.use_bf16 is True and cfg.seed == 7


def test_override_a_whole_section(toy):
    cfg = load(toy, None, "roles.actor={stage: 3}")
    assert cfg.roles.actor.stage == 3 and cfg.roles.actor.lr == 1e-5  # merged, not replaced
    with pytest.raises(ConfigKeyError, match=r"roles\.actor\.stag'.*Did you mean 'roles\.actor\.stage'"):
        load(toy, None, "roles.actor={stag: 3}")


def test_yaml_scalars_follow_yaml_1_2(toy):
    cfg = load(toy, None, "dtype=no", "name=007", "lr=1e-4", "tag=anything")
    assert cfg.dtype == "no"  # YAML 1.1 would make it False
    assert cfg.name == "007"  # a str key keeps the text typed
    assert cfg.lr == pytest.approx(1e-4)  # YAML 1.1 would keep "1e-4" a string
    assert cfg.tag == "anything" and load(toy, None, "tag=null").tag is None  # `str | None` takes null


def test_config_from_path_and_interpolation(toy, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("max_steps: 5\nname: ${output_dir}/run\nextra:\n  zero_optimization:\n    stage: 3\n")
    cfg = load(toy, str(path), "output_dir=/tmp/o")
    assert cfg.max_steps == 5 and cfg.name == "/tmp/o/run"  # resolved after the overrides
    assert cfg.extra == {"zero_optimization": {"stage": 3}}  # a mapping key is taken as it is
    with pytest.raises(RecipeConfigError, match="nope"):
        load(toy, None, "name=${nope}")  # a broken interpolation fails at load time


def test_a_key_set_twice_in_a_file_or_an_override_is_refused(toy, tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("max_steps: 5\nroles:\n  actor:\n    stage: 1\n    stage: 2\n")
    with pytest.raises(UnknownConfigError, match=r"key 'roles\.actor\.stage' is set twice, on line 4 and on line 5"):
        load(toy, str(path))
    with pytest.raises(OverrideSyntaxError, match=r"key 'roles\.actor' is set twice"):
        load(toy, None, "roles={actor: {stage: 1}, actor: {stage: 2}}")


def test_unknown_override_key_names_key_value_and_suggestion(toy):
    with pytest.raises(ConfigKeyError) as info:
        load(toy, None, "max_step=3")
    msg = str(info.value)
    assert "unknown config key 'max_step' (value 3) for recipe 'toy'. Did you mean 'max_steps'?" in msg
    assert "max_step=3" in msg  # where it came from
    assert info.value.key == "max_step" and info.value.suggestion == "max_steps"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("roles.actor.stag=2", "roles.actor.stag", "roles.actor.stage"),
        ("rolse.actor.stage=2", "rolse.actor.stage", "roles.actor.stage"),
        ("roles.critc.stage=2", "roles.critc.stage", "roles.critic.stage"),
        ("roles.actor.lora.rank=2", "roles.actor.lora.rank", None),
        ("max_steps.x=2", "max_steps.x", None),
    ],
)
def test_unknown_nested_override_key(toy, override, key, suggestion):
    with pytest.raises(ConfigKeyError) as info:
        load(toy, None, override)
    assert info.value.key == key
    assert f"unknown config key '{key}'" in str(info.value)
    assert info.value.suggestion == suggestion
    if suggestion:
        assert f"Did you mean '{suggestion}'?" in str(info.value)


def test_unknown_key_in_yaml(toy, tmp_path):
    with pytest.raises(ConfigKeyError) as info:
        load(toy, "bad")
    assert "'max_step' (value 2)" in str(info.value) and "Did you mean 'max_steps'?" in str(info.value)
    assert "bad.yaml" in str(info.value)
    nested = tmp_path / "nested.yaml"
    nested.write_text("roles:\n  actor:\n    offlaod_params: true\n")
    with pytest.raises(ConfigKeyError, match=r"roles\.actor\.offlaod_params.*Did you mean '.*\.offload_params'"):
        load(toy, str(nested))


@pytest.mark.parametrize(("old", "new"), [("steps", "max_steps"), ("actor.lr", "roles.actor.lr"),
                                          ("actor.lora.r", "roles.actor.lora.r")])
def test_a_renamed_key_is_refused_naming_the_new_one(toy, old, new):
    with pytest.raises(ConfigKeyError) as info:
        load(toy, None, f"{old}=3")
    assert f"config key '{old}' (value 3) is now '{new}'" in str(info.value) and f"write {new}=3" in str(info.value)
    assert info.value.suggestion == new


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("max_steps=abc", "int"),
        ("max_steps=1.5", "int"),
        ("max_steps=true", "int"),
        ("lr=fast", "float"),
        ("use_bf16=1", "bool"),
        ("prompts=a cat", "list"),
        ("roles=3", "a mapping"),
        ("extra=[1]", "a mapping"),
        ("roles.actor.stage=[1]", "int"),
        ("roles.actor.betas=[0.9, x]", "float"),
    ],
)
def test_wrong_type_override(toy, override, expected):
    key, value = override.split("=", 1)
    with pytest.raises(ConfigTypeError) as info:
        load(toy, None, override)
    msg = str(info.value)
    assert f"'{key}" in msg and f"expects {expected}" in msg and value.strip("[]").split(", ")[-1] in msg


def test_wrong_type_in_yaml(toy, tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("roles:\n  actor:\n    stage: two\n")
    with pytest.raises(ConfigTypeError, match=r"'roles\.actor\.stage'.*expects int, got 'two'"):
        load(toy, str(path))


@pytest.mark.parametrize("override", ["max_steps", "=3", "max steps=3", "prompts=[a,", "+max_steps=3"])
def test_malformed_override(toy, override):
    with pytest.raises(OverrideSyntaxError) as info:
        load(toy, None, override)
    assert f"malformed override '{override}'" in str(info.value)


def test_parse_override():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=") == ("a", "")
    assert parse_override("a=x=y") == ("a", "x=y")


def test_unknown_recipe_and_config(toy):
    with pytest.raises(UnknownRecipeError, match="Did you mean 'toy'"):
        load(toy, recipe="tyo")
    with pytest.raises(UnknownRecipeError, match="module me_toy_recipes.helpers defines no RECIPE"):
        load(toy, recipe="helpers")
    with pytest.raises(UnknownConfigError, match=r"Did you mean 'tiny'.*Available: bad, tiny"):
        load(toy, "tinny")
    with pytest.raises(UnknownConfigError, match="does not exist"):
        load(toy, "/no/such/file.yaml")


def test_recipe_without_a_required_key_is_a_programming_error(toy):
    with pytest.raises(RecipeDefinitionError, match=r"Config lacks required key\(s\) \['seed'\]"):
        load(toy, recipe="broken")


def test_list_recipes_and_config_path(toy, tmp_path):
    assert list_recipes(toy["configs_dir"]) == {"toy": ["bad", "tiny"]}
    assert list_recipes(tmp_path / "missing") == {}
    assert config_path("toy", "tiny", toy["configs_dir"]).read_text() == TINY_YAML
    assert isinstance(list_recipes(), dict)  # the shipped folder (its content belongs to the recipes)


def test_shipped_configs_have_a_header():
    for recipe, names in list_recipes().items():
        for name in names:
            assert config_path(recipe, name).read_text().startswith("#"), f"{recipe}/{name} lacks a header"


# --- CLI -----------------------------------------------------------------------------------
def test_cli_ls(toy, capsys):
    assert cli.main(cli_args(toy, "ls")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RECIPE", "CONFIG", "DESCRIPTION"]
    tiny = next(line for line in lines if " tiny " in line)
    assert tiny.split()[:2] == ["toy", "tiny"] and "Toy recipe, tiny: two steps" in tiny


def test_cli_cp(toy, tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert cli.main(cli_args(toy, "cp", "toy/tiny", str(dest))) == 0
    assert dest.read_text() == TINY_YAML
    dest.write_text("edited\n")
    assert cli.main(cli_args(toy, "cp", "toy/tiny", str(dest))) == 1
    assert dest.read_text() == "edited\n"  # refused
    assert "--force" in capsys.readouterr().err
    assert cli.main(cli_args(toy, "cp", "toy/tiny", str(dest), "--force")) == 0
    assert dest.read_text() == TINY_YAML
    assert cli.main(cli_args(toy, "cp", "toy/tiny.yaml", str(tmp_path))) == 0  # into a folder
    assert (tmp_path / "tiny.yaml").read_text() == TINY_YAML
    assert cli.main(cli_args(toy, "cp", "toy", str(tmp_path / "x.yaml"))) == 2
    assert cli.main(cli_args(toy, "cp", "toy/nope", str(tmp_path / "x.yaml"))) == 2
    assert not (tmp_path / "x.yaml").exists()


def test_cli_run_in_process(toy, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    code = cli.main(cli_args(toy, "run", "toy", "--config", "tiny", "max_steps=4", f"output_dir={out}"))
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {"steps": 4, "lr": 1e-3, "rank": 0, "stage": 2}
    assert json.loads((out / "rank0.json").read_text())["max_steps"] == 4
    # Overrides may also follow options.
    assert cli.main(cli_args(toy, "run", "toy", "max_steps=6", "--config", "tiny", f"output_dir={out}")) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 6
    summary = cli.run_recipe("toy", "tiny", [f"output_dir={out}"], package=toy["package"],
                             configs_dir=toy["configs_dir"])
    assert summary == {"steps": 2, "lr": 1e-3, "rank": 0, "stage": 2}


def test_cli_config_error_exits_2_without_launching(toy, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(cli_args(toy, "run", "toy", "--nproc-per-node", "2", "max_step=3", f"output_dir={out}"))
    assert code == 2
    err = capsys.readouterr().err
    assert "Did you mean 'max_steps'?" in err and "Traceback" not in err
    assert not out.exists()  # no rank ran
    assert cli.main(cli_args(toy, "run", "toy", "max_steps")) == 2
    assert "malformed override 'max_steps'" in capsys.readouterr().err
    assert cli.main(cli_args(toy, "run", "toy", "--nnodes", "2", "--nproc-per-node", "1")) == 2
    assert "--master-addr" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(cli_args(toy, "run", "toy", "--confg", "tiny"))  # an unknown option is argparse's
    assert info.value.code == 2


def test_console_entry_config_error_has_no_traceback(toy, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([toy["src"], os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([*CLI, *cli_args(toy, "run", "toy", "max_step=3")], check=False, capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'max_step'" in proc.stderr and "Traceback" not in proc.stderr


def test_build_launch_command(toy):
    cmd = cli.build_launch_command("toy", "/c/tiny.yaml", ["max_steps=3", "prompts=[a, b]"], nproc_per_node=2,
                                   package=toy["package"], folder=toy["configs_dir"])
    assert cmd[:4] == [*CLI, "_launch"]  # torchrun's agent, quiet
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2" and cmd[cmd.index("--nnodes") + 1] == "1"
    tail = cmd[cmd.index("--master_port") + 2:]
    assert tail == ["-m", "multiengine.recipes.language.cli", "--recipes-package", toy["package"], "--configs-dir",
                    toy["configs_dir"], "run", "toy", "--config", "/c/tiny.yaml", "max_steps=3", "prompts=[a, b]"]
    multi = cli.build_launch_command("toy", None, [], nproc_per_node=4,
                                     nodes=Nodes(2, 1, master_addr="10.0.0.1", master_port=29500))
    assert multi[multi.index("--master_addr") + 1] == "10.0.0.1" and multi[multi.index("--node_rank") + 1] == "1"
    with pytest.raises(RecipeConfigError):
        cli.build_launch_command("toy", None, [], nproc_per_node=1, nodes=Nodes(2, None))
    with pytest.raises(RecipeConfigError):
        cli.build_launch_command("toy", None, [], nproc_per_node=0)


@pytest.mark.timeout(180)
def test_cli_run_launches_two_ranks(toy, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "out"
    code = cli.main(cli_args(toy, "run", "toy", "--config", "tiny", "--nproc-per-node", "2", "max_steps=5",
                             f"output_dir={out}"))
    assert code == 0
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in records] == ["0", "1"]
    assert all(r["world"] == "2" and r["max_steps"] == 5 for r in records)
    assert records[0]["omp"] == str(max(1, launcher._cpu_count() // 2))


@pytest.mark.timeout(180)
def test_cli_run_failing_rank_exits_non_zero(toy, tmp_path):
    out = tmp_path / "out"
    code = cli.main(cli_args(toy, "run", "toy", "--nproc-per-node", "1", "fail=true", f"output_dir={out}"))
    assert code != 0
    assert (out / "rank0.json").exists()  # it did run, then failed


def test_launch_env_sets_omp_threads_only_if_unset(toy, monkeypatch):
    monkeypatch.setattr(launcher, "_cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    load(toy)  # the package is imported (the CLI has loaded its config before it launches)
    env = cli._launch_env(2, toy["package"])
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == toy["src"]  # ranks import the package validated here
    assert cli._launch_env(16, toy["package"])["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli._launch_env(2, toy["package"])["OMP_NUM_THREADS"] == "3"


def test_a_reader_that_leaves_early_ends_the_command_quietly(monkeypatch, capsys):
    """`multiengine run X --help | head`: a closed pipe is exit 1 without a traceback."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w", buffering=1) as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert cli.main(["run", "gan", "--help"]) == cli.EXIT_FAILURE
    assert "Traceback" not in capsys.readouterr().err
