"""The unit modules the other lanes skip (``tests/suites.py``, ``NO_VLLM``) load no vLLM."""

from __future__ import annotations

import subprocess
import sys

from tests.suites import NO_VLLM


def test_the_modules_other_lanes_skip_import_no_vllm() -> None:
    modules = sorted(f"tests.unit.{name.removesuffix('.py')}" for name in NO_VLLM)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
