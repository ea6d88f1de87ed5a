"""``roles.<name>.max_grad_norm`` reaches DeepSpeed in five hops, spelled one way (a float, 0.0 = no clipping):

1. YAML / ``key=value`` -> ``load_config`` -> the role config ``TrainableRole.max_grad_norm``
2. ``TrainableRole.spec()`` -> ``OptimSpec.max_grad_norm`` (its ``.optim()``) handed to ``trainable_role``
3. ``trainable_role`` -> ``train_ds_config(gradient_clipping=optim.max_grad_norm)`` -> ``["gradient_clipping"]``
4. ``RoleSpec.ds_config`` -> ``EngineRegistry.build`` (resolves batch keys and buckets, never the clip)
5. -> ``deepspeed.initialize(config=...)``: the engine's ``gradient_clipping()``

Checked on the gan recipe's roles, built in this process on both backends; each hop is asserted on the way.
"""

from __future__ import annotations

import pytest
from multiengine.engines import EngineRegistry
from multiengine.pipelines.gan import MLP
from multiengine.recipes.language.config import load_config


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_max_grad_norm_reaches_the_built_engine(backend, tmp_path):
    cfg = load_config("gan", "tiny", [f"output_dir={tmp_path}", "roles.gen.max_grad_norm=0.37",
                                      "roles.disc.max_grad_norm=0"])
    assert (cfg.roles.gen.max_grad_norm, cfg.roles.disc.max_grad_norm) == (0.37, 0.0)  # 1. typed: floats
    registry = EngineRegistry(backend=backend, seed=cfg.seed)
    for name, clip in (("gen", 0.37), ("disc", 0.0)):
        spec = cfg.roles[name].spec(lambda n=name: MLP(**cfg.gan.shape(n)), total_steps=cfg.max_steps, seed=cfg.seed)
        assert spec.optim.max_grad_norm == clip  # 2.
        assert spec.ds_config["gradient_clipping"] == clip and type(spec.ds_config["gradient_clipping"]) is float  # 3.
        registry.add(spec)
    registry.build()  # 4. and 5.
    assert registry["gen"].gradient_clipping() == 0.37
    assert registry["disc"].gradient_clipping() == 0.0
    assert registry.role("disc").config["gradient_clipping"] == 0.0  # what summary.json records
