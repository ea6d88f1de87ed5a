"""The `multiengine` command: run a recipe (in this process or on N ranks), list and copy configs.

    multiengine ls
    multiengine cp registry_demo/tiny my.yaml
    multiengine run registry_demo --config tiny max_steps=3
    multiengine run rlhf_ppo --config tiny --nproc-per-node 2 roles.actor.stage=3
    multiengine plan rlhf_ppo --config opt13b_opt350m --gpus 8 --gpu-mem 80GiB --write my.yaml
    multiengine run rlhf_ppo --config my.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 \
        --master-addr node0 --master-port 29500          # the same on node1 with --node-rank 1

The config is validated here before any rank starts, so a typo costs a second, not a launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import (
    CONFIGS_DIR,
    RECIPES_PACKAGE,
    RecipeConfigError,
    config_header,
    config_path,
    list_recipes,
    load_config,
    load_recipe,
    resolve_config_file,
)

logger = logging.getLogger(__name__)

EXIT_USAGE = 2  # bad recipe, config, key or value (argparse's own usage errors use 2 as well)


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
        "--configs-dir", default=str(CONFIGS_DIR),
        help="folder of shipped configs, <recipe>/<name>.yaml (default: the installed ones)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a recipe", allow_abbrev=False,
                         description="Run a recipe. Overrides are key=value "
                         "with dotted keys and YAML values: max_steps=3 roles.actor.stage=2 prompts=[a,b]")
    run.add_argument("recipe")
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

    _add_plan_parser(sub)

    sub.add_parser("ls", help="list recipes and their shipped configs")

    cp = sub.add_parser("cp", help="copy a shipped config to edit it")
    cp.add_argument("source", metavar="RECIPE/CONFIG")
    cp.add_argument("dest", help="file, or an existing folder to copy into")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    return parser


# --- run ---------------------------------------------------------------------------------
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not the whole machine
    except AttributeError:
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RDZV_BACKENDS = ("static", "c10d")


def _rendezvous_args(nnodes: int, node_rank: int | None, master_addr: str | None, master_port: int | None,
                     rdzv_backend: str, rdzv_id: str) -> list[str]:
    """torchrun's rendezvous options, checked: a wrong node rank or a missing address would hang every node."""
    if rdzv_backend not in RDZV_BACKENDS:
        raise RecipeConfigError(f"--rdzv-backend {rdzv_backend!r}; use one of {list(RDZV_BACKENDS)}")
    if nnodes < 1:
        raise RecipeConfigError(f"--nnodes must be >= 1, got {nnodes}")
    where = ("rank 0's host and port" if rdzv_backend == "static"
             else "the rendezvous endpoint: one node's host and a free port, the same on every node")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise RecipeConfigError(f"--nnodes > 1 needs --master-addr and --master-port ({where})")
    addr = master_addr or "127.0.0.1"
    port = str(master_port if master_port is not None else _free_port())
    if rdzv_backend == "c10d":
        if node_rank is not None and nnodes > 1:
            raise RecipeConfigError("--node-rank has no effect with --rdzv-backend c10d (nodes are numbered as they "
                                    "join); drop it, or use the static rendezvous")
        return ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{port}", "--rdzv_id", rdzv_id]
    if node_rank is None:
        if nnodes > 1:
            raise RecipeConfigError(
                f"--nnodes {nnodes} needs --node-rank on every node: 0 on rank 0's node (--master-addr), 1 to "
                f"{nnodes - 1} on the others (or --rdzv-backend c10d, which numbers nodes as they join)")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise RecipeConfigError(f"--node-rank {node_rank} is not in [0, --nnodes {nnodes})")
    return ["--node_rank", str(node_rank), "--master_addr", addr, "--master_port", port]


def build_launch_command(
    recipe: str,
    config_file: str | None,
    overrides: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int | None = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    package: str = RECIPES_PACKAGE,
    configs_dir: str | Path = CONFIGS_DIR,
    rdzv_backend: str = "static",
    rdzv_id: str = "multiengine",
) -> list[str]:
    """`python -m torch.distributed.run ... -m multiengine.recipes.cli run <recipe> ...` for every rank."""
    if nproc_per_node < 1:
        raise RecipeConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc_per_node),
        "--nnodes", str(nnodes),
        *_rendezvous_args(nnodes, node_rank, master_addr, master_port, rdzv_backend, rdzv_id),
        "-m", "multiengine.recipes.cli",
        "--recipes-package", package,
        "--configs-dir", str(configs_dir),
        "run", recipe,
    ]
    if config_file is not None:
        cmd += ["--config", config_file]
    return cmd + list(overrides)


def _launch_env(nproc_per_node: int, package: str) -> dict[str, str]:
    env = dict(os.environ)
    # N ranks each using every core oversubscribe the CPU badly (torch's launcher would force 1).
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // nproc_per_node)))
    if package != RECIPES_PACKAGE:
        # The ranks must import the recipe package the parent validated, wherever it was found.
        top = sys.modules[package.split(".")[0]]
        locations = [str(Path(p).parent) for p in getattr(top, "__path__", [])]
        env["PYTHONPATH"] = os.pathsep.join([*locations, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _launch(cmd: list[str], env: dict[str, str]) -> int:
    logger.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # Let the launcher stop its workers itself; killing it outright would orphan them.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        return 130
    return 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it


def run_recipe(
    recipe: str,
    config: str | None = None,
    overrides: Sequence[str] = (),
    *,
    package: str = RECIPES_PACKAGE,
    configs_dir: str | Path = CONFIGS_DIR,
) -> dict[str, Any]:
    """Load the config and run the recipe's main(cfg) in this process; returns its summary."""
    cfg = load_config(recipe, config, overrides, package=package, configs_dir=configs_dir)
    return _run_loaded(recipe, cfg, package, configs_dir)


def _run_loaded(recipe: str, cfg: Any, package: str, configs_dir: str | Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    logger.info("recipe %s, config:\n%s", recipe, OmegaConf.to_yaml(cfg, resolve=True).rstrip())
    result = load_recipe(recipe, package, configs_dir).main(cfg)
    return {} if result is None else result


def _cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    package, configs_dir = args.recipes_package, args.configs_dir
    # Validate first, in this process: a bad key must fail before any rank starts.
    cfg = load_config(args.recipe, args.config, overrides, package=package, configs_dir=configs_dir)
    from multiengine.engines.metrics import setup_logging, to_plain  # imports torch: only on `run`

    multinode = ((args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_backend)
                 != (1, None, None, None, "static"))
    if args.nproc_per_node is None and multinode:
        raise RecipeConfigError(
            "--nnodes/--node-rank/--master-addr/--master-port/--rdzv-backend need --nproc-per-node")
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    if args.nproc_per_node is not None:
        # The ranks get the resolved file, so a shipped name or relative path means the same to all.
        config_file = str(resolve_config_file(args.recipe, args.config, configs_dir)) if args.config else None
        cmd = build_launch_command(
            args.recipe, config_file, overrides,
            nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
            master_addr=args.master_addr, master_port=args.master_port,
            package=package, configs_dir=configs_dir, rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id,
        )
        return _launch(cmd, _launch_env(args.nproc_per_node, package))
    result = _run_loaded(args.recipe, cfg, package, configs_dir)
    from multiengine.engines.dist import shutdown

    shutdown()  # all ranks leave together (no-op when the recipe ran without a process group)
    if rank == 0 and result:
        print(json.dumps(to_plain(result), indent=2, sort_keys=True))
    return 0


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
    from . import plans

    planner = plans.P
    cfg = load_config(args.recipe, args.config, overrides, package=args.recipes_package, configs_dir=args.configs_dir)
    if args.gpus < 1:
        raise RecipeConfigError(f"--gpus {args.gpus}: plan for at least 1 GPU")
    if args.nodes < 1 or args.gpus % args.nodes:
        raise RecipeConfigError(f"--gpus {args.gpus} is not a multiple of --nodes {args.nodes}; give the total "
                                "number of GPUs, spread evenly over the nodes")
    if args.margin is not None and not 0 <= args.margin < 1:
        raise RecipeConfigError(f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.1")
    assume = {}
    for item in args.assume:
        role, sep, model = item.partition("=")
        if not sep or not role or not model:
            raise RecipeConfigError(f"--assume {item!r}: expected ROLE=MODEL, e.g. --assume actor=facebook/opt-1.3b")
        assume[role] = model
    try:
        budget = planner.Budget(
            world_size=args.gpus, gpus_per_node=args.gpus // args.nodes,
            gpu_bytes=planner.parse_bytes(args.gpu_mem, "--gpu-mem"),
            host_bytes=planner.parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None,
            margin=planner.FRAGMENTATION_MARGIN if args.margin is None else args.margin)
        # Libraries building the tiny models print to stdout (DeepSpeed's logger): keep --json clean.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            items = plans.recipe_plans(args.recipe, cfg, assume, args.configs_dir)
            results = [planner.plan(item.roles, budget) for item in items]
    except planner.PlanError as e:
        raise RecipeConfigError(str(e)) from None
    for item, result in zip(items, results):
        result.notes.extend(item.notes)
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
        header = (f"Placements chosen by `{command}`:\n"
                  + "\n".join(f"  {r.request.name}: {r.chosen.choice.label}" for res in results for r in res.roles))
        path = plans.write_config(args.recipe, args.config, overrides, items, [r.placements() for r in results],
                                  args.write, header, configs_dir=args.configs_dir)
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


def _is_config_error(exc: BaseException) -> bool:
    if isinstance(exc, RecipeConfigError):
        return True
    # The engines' DeepSpeed-config errors are user errors too. Looked up, not imported: if the
    # module was never imported, the exception cannot be one of its classes (and `ls` stays fast).
    engines_config = sys.modules.get("multiengine.engines.config")
    return engines_config is not None and isinstance(exc, engines_config.ConfigError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `multiengine` console script; returns the exit code."""
    parser = build_parser()
    # parse_known_args lets overrides come after options too (`run r --config c a=1 --nnodes 1 b=2`).
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or args.command not in ("run", "plan")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    try:
        if args.command == "run":
            return _cmd_run(args, [*args.overrides, *extra])
        if args.command == "plan":
            return _cmd_plan(args, [*args.overrides, *extra])
        if args.command == "ls":
            return _cmd_ls(args)
        return _cmd_cp(args)
    except ValueError as e:
        if not _is_config_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
