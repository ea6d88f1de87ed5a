"""engines/ imports only torch and deepspeed at import time (the layering rule): a fresh process that imports
multiengine.engines has not imported transformers, diffusers, peft or datasets."""

import subprocess
import sys


def test_importing_the_engines_imports_no_model_or_data_library():
    code = ("import sys, multiengine.engines; "
            "print(sorted(m for m in ('transformers', 'diffusers', 'peft', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_deepspeed_floor_matches_what_the_multi_role_backward_needs():
    import re
    from pathlib import Path

    from multiengine.engines.registry import MIN_DEEPSPEED

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    floor = re.search(r'"deepspeed>=([0-9.]+)"', pyproject).group(1)
    assert version(floor) >= version(MIN_DEEPSPEED)
