"""Every setting the project means is written into the engine config: read back from built engines on both
backends at ZeRO 0/1/2/3, and one SGD step with clipping off / at 0.5 equal to plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from conftest import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("explicit_settings", tmp_path_factory.mktemp("explicit_settings"))


def _max_diff(a, b) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_engine_reports_the_role_spec_and_steps_like_plain_pytorch(ranks, backend, stage, clip):
    for rank in ranks:
        r = rank[f"{backend}/s{stage}_c{int(clip * 10)}"]
        assert (r["clip"], r["config_clip"]) == (clip, clip)
        assert (r["bf16"], r["fp16"], r["accum"], r["micro"], r["lr"]) == (False, False, 1, 4, 0.1)
        assert r["optimizer"] == "SGD"
        ref = rank[f"reference/{clip}"]
        assert ref["grad_norm"] > 10  # clipping at 0.5 (or DeepSpeed's default 1.0) would change the step
        assert _max_diff(r["params"], ref["params"]) < 1e-5


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_a_config_without_gradient_clipping_clips_alike_on_both_backends(ranks, backend):
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    for rank in ranks:
        r = rank[f"{backend}/own"]
        assert r["clip"] == r["config_clip"] == GRADIENT_CLIPPING_DEFAULT
        assert _max_diff(r["params"], rank[f"reference/{float(GRADIENT_CLIPPING_DEFAULT)}"]["params"]) < 1e-5
