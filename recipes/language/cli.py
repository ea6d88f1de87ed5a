"""The `multiengine` command: run a recipe (in this process or on N ranks), validate, plan, list and copy configs.

    multiengine run registry_demo --config tiny --nproc-per-node 2 max_steps=3
    multiengine plan rlhf_ppo --config opt1.3b_opt350m --gpus 8 --gpu-mem 80GiB --write my.yaml

The config is validated here before any rank starts; failures are reported once (see launcher.py for exit codes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multiengine.engines.settings import reads_of, track_reads, tracking_reads

from .config import (
    KEY_READS_ENV,
    RECIPES_PACKAGE,
    RecipeConfigError,
    checked_config,
    config_header,
    config_path,
    configs_dir,
    format_key_help,
    inactive_line,
    list_recipes,
    load_config,
    load_recipe,
    resolve_config_file,
    validate_config,
)
from .launcher import (
    _LAUNCH,
    EXIT_FAILURE,
    EXIT_USAGE,
    RDZV_BACKENDS,
    Nodes,
    _is_config_error,
    _launch_env,
    _launch_main,
    build_launch_command,
    launch_job,
    run_rank,
)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multiengine", description="Run multi-engine DeepSpeed recipes and manage their configs.",
        allow_abbrev=False,  # `--conf` silently meaning `--config` hides typos
    )
    parser.add_argument(
        "--recipes-package", default=RECIPES_PACKAGE,
        help="package holding the recipe modules (default: %(default)s)",
    )
    parser.add_argument(
        "--configs-dir", default=None,
        help="folder of shipped configs, <recipe>/<name>.yaml (default: the recipes package's configs/)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a recipe", allow_abbrev=False, add_help=False,
                         description="Run a recipe. Overrides are key=value "
                         "with dotted keys and YAML values: max_steps=3 roles.actor.stage=2 prompts=[a,b]")
    run.add_argument("-h", "--help", action="store_true",
                     help="show this help and, with a recipe, every config key: type, default, meaning")
    run.add_argument("recipe", nargs="?")
    run.add_argument("--config", help="shipped config name (see `multiengine ls`) or path to a YAML file")
    run.add_argument("--nproc-per-node", type=int, help="launch N ranks with torch.distributed.run")
    run.add_argument("--nnodes", type=int, default=1, help="number of nodes (the command runs once on each)")
    run.add_argument("--node-rank", type=int, default=None,
                     help="this node's index, 0 on rank 0's node (static rendezvous; required with --nnodes > 1)")
    run.add_argument("--master-addr", help="rank 0's host (required with --nnodes > 1; with c10d: the rendezvous host)")
    run.add_argument("--master-port", type=int, help="rank 0's port (default: a free one on one node)")
    run.add_argument("--rdzv-backend", choices=RDZV_BACKENDS, default="static",
                     help="static (default): fixed --node-rank, rank 0's node serves the store at "
                     "--master-addr:--master-port; c10d: nodes join in any order and are numbered as they arrive")
    run.add_argument("--rdzv-id", default="multiengine", help="c10d: a job id, the same on every node")
    run.add_argument("overrides", nargs="*", metavar="key=value")

    val = sub.add_parser("validate", help="check a config (types, ranges, choices, paths, data) without running",
                         allow_abbrev=False, add_help=False,
                         description="Check a recipe config in this process, in seconds, without building models:"
                         " the same checks `run` does before any rank starts.")
    val.add_argument("-h", "--help", action="store_true", help="show this help and the recipe's config keys")
    val.add_argument("recipe", nargs="?")
    val.add_argument("--config", help="shipped config name or path to a YAML file")
    val.add_argument("--print", action="store_true", dest="print_config", help="print the resolved config")
    val.add_argument("--nproc-per-node", type=int, default=1,
                     help="ranks per node the run will have (default 1): the batch arithmetic is checked for them")
    val.add_argument("--nnodes", type=int, default=1, help="nodes the run will have (default 1)")
    val.add_argument("overrides", nargs="*", metavar="key=value")

    _add_plan_parser(sub)

    sub.add_parser("ls", help="list recipes and their shipped configs")

    cp = sub.add_parser("cp", help="copy a shipped config to edit it")
    cp.add_argument("source", metavar="RECIPE/CONFIG")
    cp.add_argument("dest", help="file, or an existing folder to copy into")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    return parser


def run_recipe(
    recipe: str,
    config: str | None = None,
    overrides: Sequence[str] = (),
    *,
    package: str = RECIPES_PACKAGE,
    configs_dir: str | Path | None = None,
) -> dict[str, Any]:
    """checked_config (CHECKS and validate(cfg)), then the recipe's main(cfg) in this process; returns its summary."""
    cfg = checked_config(recipe, config, overrides, package=package, configs_dir=configs_dir)
    return _run_loaded(recipe, cfg, package, configs_dir)


def _run_loaded(recipe: str, cfg: Any, package: str, configs_dir: str | Path | None) -> dict[str, Any]:
    if inactive_line(cfg):
        logger.info("%s", inactive_line(cfg))
    logger.info("recipe %s, config:\n%s", recipe, _yaml(cfg))
    result = load_recipe(recipe, package, configs_dir).main(cfg)
    return {} if result is None else result


def _print_run_help(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    sub.print_help()
    if args.recipe:
        print()
        print(format_key_help(args.recipe, load_recipe(args.recipe, args.recipes_package, args.configs_dir)))
    else:
        print(f"\n`multiengine {args.command} <recipe> --help` also lists the recipe's config keys.")
    return 0


def _yaml(cfg: Any) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None, width=110).rstrip()


def _output_dir_policy(args: argparse.Namespace, cfg: Any, clear: bool) -> None:
    from .lifecycle import output_dir_policy

    output_dir_policy(load_recipe(args.recipe, args.recipes_package, args.configs_dir), cfg, clear=clear,
                      nnodes=getattr(args, "nnodes", 1), node_rank=getattr(args, "node_rank", None),
                      rdzv_backend=getattr(args, "rdzv_backend", "static"))


def _world_size(nproc_per_node: int | None, nnodes: int) -> int:
    for flag, value in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes)):
        if value is not None and value < 1:
            raise RecipeConfigError(f"{flag} must be >= 1, got {value}")
    return (nproc_per_node or 1) * nnodes


def _load_checked(args: argparse.Namespace, overrides: list[str], hook: bool, world_size: int | None = None) -> Any:
    """load_config (types, unknown keys, CHECKS) and, if `hook`, the output_dir policy and the recipe's
    validate(cfg) for `world_size` ranks (default: this rank's job, else 1)."""
    if not args.recipe:
        raise RecipeConfigError(f"`multiengine {args.command}` needs a recipe name (see `multiengine ls`)")
    cfg = load_config(args.recipe, args.config, overrides, package=args.recipes_package, configs_dir=args.configs_dir)
    if hook:
        _output_dir_policy(args, cfg, clear=False)
        if os.environ.get(KEY_READS_ENV) and not tracking_reads():  # tests: the keys validate reads count too
            track_reads()
        validate_config(args.recipe, cfg, package=args.recipes_package, configs_dir=args.configs_dir,
                        world_size=world_size)
    return cfg


def _write_validate_reads(cfg: Any) -> None:
    """With MULTIENGINE_KEY_READS set: the keys this process's checks read, beside the ranks' (logs/)."""
    if os.environ.get(KEY_READS_ENV) and tracking_reads():
        folder = os.path.join(str(cfg.output_dir), "logs")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "key-reads-validate.json"), "w", encoding="utf-8") as f:
            json.dump(sorted(reads_of(cfg)), f)


def _cmd_validate(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: list[str]) -> int:
    if args.help:
        return _print_run_help(parser, args)
    world = _world_size(args.nproc_per_node, args.nnodes)
    cfg = _load_checked(args, overrides, hook=True, world_size=world)
    if args.print_config:
        print(_yaml(cfg))
    if inactive_line(cfg):
        print(inactive_line(cfg))
    print(f"ok: config for recipe '{args.recipe}' is valid" + (f" on {world} ranks" if world > 1 else ""))
    return 0


def _cmd_run(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: list[str]) -> int:
    if args.help:
        return _print_run_help(parser, args)
    package, folder = args.recipes_package, args.configs_dir
    multinode = ((args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_backend)
                 != (1, None, None, None, "static"))
    if args.nproc_per_node is None and multinode:
        raise RecipeConfigError(
            "--nnodes/--node-rank/--master-addr/--master-port/--rdzv-backend need --nproc-per-node")
    if args.nproc_per_node is not None:
        # Validate first, in this process: a bad key or value, a batch the data cannot fill on this many ranks or
        # a reused output_dir must fail before any rank starts.
        cfg = _load_checked(args, overrides, hook=True, world_size=_world_size(args.nproc_per_node, args.nnodes))
        from multiengine.engines.metrics import setup_logging  # imports neither torch nor numpy

        setup_logging(0)
        # The ranks get the resolved file, so a shipped name or relative path means the same to all.
        config_file = str(resolve_config_file(args.recipe, args.config, folder)) if args.config else None
        nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_backend, args.rdzv_id)
        cmd = build_launch_command(args.recipe, config_file, overrides, nproc_per_node=args.nproc_per_node,
                                   nodes=nodes, package=package, folder=folder)
        _output_dir_policy(args, cfg, clear=True)  # overwrite=true: cleared before any rank writes into it
        _write_validate_reads(cfg)
        return launch_job(cmd, _launch_env(args.nproc_per_node, package, args.nnodes), str(cfg.output_dir),
                          args.nproc_per_node)
    return _run_here(args, overrides)


def _run_here(args: argparse.Namespace, overrides: list[str]) -> int:
    """This process runs the recipe: alone, or as one rank of a launched job (language/launcher.run_rank)."""
    rank = int(os.environ.get("RANK", "0"))

    def load(checked: bool) -> Any:
        cfg = _load_checked(args, overrides, hook=checked)
        from multiengine.engines.metrics import setup_logging

        setup_logging(rank)
        if checked and rank == 0:
            _output_dir_policy(args, cfg, clear=True)
        return cfg

    def run(cfg: Any) -> str | None:
        from multiengine.engines.metrics import to_plain

        result = to_plain(_run_loaded(args.recipe, cfg, args.recipes_package, args.configs_dir))
        # the lifecycle's closing summary; a recipe of your own outside it: what its main(cfg) returned
        if not result:
            return None
        return result["report"] if isinstance(result.get("report"), str) else json.dumps(result, indent=2)

    return run_rank(load, run)


# --- plan --------------------------------------------------------------------------------
EXIT_DOES_NOT_FIT = 1


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="per-role memory plan: will it fit, with which stage and offload per role",
        allow_abbrev=False,
        description="Plan a recipe's per-rank memory without loading any weights: per role, the bytes of "
        "parameters, gradients and optimizer state at each ZeRO stage and offload choice, activation "
        "estimates, fixed overheads, and the cheapest placement per role that fits. Exits 0 when it fits, "
        f"{EXIT_DOES_NOT_FIT} when it does not, 2 on a bad argument.")
    plan.add_argument("recipe")
    plan.add_argument("--config", help="shipped config name or path to a YAML file")
    plan.add_argument("--gpus", type=int, required=True, help="total number of GPUs (ranks)")
    plan.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 80GiB or 80GB")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    plan.add_argument("--cpu-mem", help="host memory per node, e.g. 512GiB (default: not checked)")
    plan.add_argument("--margin", type=float, default=None,
                      help="fragmentation margin as a fraction of the total (default 0.10)")
    plan.add_argument("--assume", action="append", default=[], metavar="ROLE=MODEL",
                      help="what a model folder that does not exist yet will hold (folder or built-in name)")
    plan.add_argument("--write", metavar="FILE", help="write the config with the chosen placements")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("overrides", nargs="*", metavar="key=value")


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from multiengine.engines import planner

    from . import plans

    cfg = load_config(args.recipe, args.config, overrides, package=args.recipes_package, configs_dir=args.configs_dir)
    try:
        budget = planner.budget_for(args.gpus, args.gpu_mem, args.nodes, args.cpu_mem, args.margin)
        assume = planner.parse_assume(args.assume)
        # Libraries building the tiny models print to stdout (DeepSpeed's logger): keep --json clean.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            recipe = load_recipe(args.recipe, args.recipes_package, args.configs_dir)
            items, results = plans.plan_recipe(recipe, cfg, budget, assume)
    except planner.PlanError as e:
        raise RecipeConfigError(str(e)) from None
    fits = all(r.fits for r in results)
    if args.json:
        print(json.dumps([dict(r.to_dict(), title=i.title) for i, r in zip(items, results)], indent=2))
    else:
        name = f"{args.recipe} --config {args.config}" if args.config else args.recipe
        for item, result in zip(items, results):
            print(planner.format_plan(result, title=f"== plan: {item.title} ({name})"))
            print()
    if args.write:
        if not fits:
            print(f"error: not writing {args.write}: the run does not fit (see above)", file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        command = " ".join(["multiengine plan", args.recipe, *(["--config", args.config] if args.config else []),
                            *overrides, "--gpus", str(args.gpus), "--gpu-mem", args.gpu_mem,
                            *(["--nodes", str(args.nodes)] if args.nodes > 1 else [])])
        path = plans.write_config(args.recipe, args.config, overrides, (items, results), args.write, command,
                                  folder=args.configs_dir)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0 if fits else EXIT_DOES_NOT_FIT


# --- ls / cp -----------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    recipes = list_recipes(args.configs_dir)
    if not recipes:
        print(f"no recipes found in {args.configs_dir}")
        return 0
    rows = [("RECIPE", "CONFIG", "DESCRIPTION")]
    for recipe, names in recipes.items():
        if not names:
            rows.append((recipe, "-", "(no shipped configs)"))
        for name in names:
            rows.append((recipe, name, config_header(config_path(recipe, name, args.configs_dir))))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for row in rows:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}".rstrip())
    return 0


def _cmd_cp(args: argparse.Namespace) -> int:
    recipe, sep, name = args.source.partition("/")
    if not sep or not recipe or not name:
        raise RecipeConfigError(f"'{args.source}' is not RECIPE/CONFIG (e.g. registry_demo/tiny)")
    src = config_path(recipe, name, args.configs_dir)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name
    if dest.exists() and not args.force:
        print(f"error: {dest} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    print(f"copied {recipe}/{src.stem} to {dest}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `multiengine` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_LAUNCH]:
        return _launch_main(argv[1:])
    parser = build_parser()
    # parse_known_args lets overrides come after options too (`run r --config c a=1 --nnodes 1 b=2`).
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or args.command not in ("run", "validate", "plan")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.configs_dir is None:
        args.configs_dir = str(configs_dir(args.recipes_package))
    try:
        if args.command == "run":
            return _cmd_run(parser, args, [*args.overrides, *extra])
        if args.command == "validate":
            return _cmd_validate(parser, args, [*args.overrides, *extra])
        if args.command == "plan":
            return _cmd_plan(args, [*args.overrides, *extra])
        if args.command == "ls":
            return _cmd_ls(args)
        return _cmd_cp(args)
    except ValueError as e:
        if not _is_config_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        fix = getattr(e, "fix", None)
        if fix and f"fix: {fix}" not in str(e):
            print(f"  fix: {fix}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `multiengine run X --help | head`: the reader left; end quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
