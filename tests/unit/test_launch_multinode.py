"""The CLI's multi-node launch command: static and c10d rendezvous, and the mistakes that would hang a job."""

from __future__ import annotations

import pytest
from multiengine.recipes.language import cli
from multiengine.recipes.language.config import RecipeConfigError
from multiengine.recipes.language.launcher import Nodes


def _cmd(**kw):
    return cli.build_launch_command("registry_demo", None, ["max_steps=3"], nproc_per_node=8, nodes=Nodes(**kw))


def _opt(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_static_rendezvous():
    cmd = _cmd(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert (_opt(cmd, "--nnodes"), _opt(cmd, "--node_rank")) == ("2", "1")
    assert (_opt(cmd, "--master_addr"), _opt(cmd, "--master_port")) == ("10.0.0.1", "29500")
    assert "--rdzv_backend" not in cmd
    assert cmd[-3:] == ["run", "registry_demo", "max_steps=3"]


def test_c10d_rendezvous():
    cmd = _cmd(nnodes=4, node_rank=None, master_addr="head", master_port=29400, rdzv_backend="c10d", rdzv_id="job7")
    assert (_opt(cmd, "--rdzv_backend"), _opt(cmd, "--rdzv_endpoint"), _opt(cmd, "--rdzv_id")) == (
        "c10d", "head:29400", "job7")
    assert "--node_rank" not in cmd and "--master_addr" not in cmd


@pytest.mark.parametrize("kw,message", [
    (dict(nnodes=2, node_rank=None, master_addr="h", master_port=1), "needs --node-rank on every node"),
    (dict(nnodes=2, node_rank=2, master_addr="h", master_port=1), "--node-rank 2 is not in [0, --nnodes 2)"),
    (dict(nnodes=2, node_rank=0), "needs --master-addr and --master-port (rank 0's host and port)"),
    (dict(nnodes=2, node_rank=None, rdzv_backend="c10d"), "the rendezvous endpoint"),
    (dict(nnodes=2, node_rank=1, master_addr="h", master_port=1, rdzv_backend="c10d"), "no effect with"),
    (dict(nnodes=0), "--nnodes must be >= 1"),
    (dict(nnodes=1, rdzv_backend="etcd"), "--rdzv-backend 'etcd'"),
])
def test_mistakes_fail_before_launching(kw, message):
    with pytest.raises(RecipeConfigError) as exc:
        _cmd(**kw)
    assert message in str(exc.value)


def test_cli_rejects_a_missing_node_rank(capsys):
    code = cli.main(["run", "registry_demo", "--config", "tiny", "--nproc-per-node", "1", "--nnodes", "2",
                     "--master-addr", "127.0.0.1", "--master-port", "29500"])
    assert code == cli.EXIT_USAGE and "needs --node-rank on every node" in capsys.readouterr().err
