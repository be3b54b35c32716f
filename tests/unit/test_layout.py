"""The layout says the process (docs/architecture.md), and the imports keep to it: read from the source,
so a module that crosses a boundary fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"

#: package -> packages of vlguard it must not import
BOUNDARIES = {
    "engine": ("server.guard", "server.api", "server.app", "server.serve", "server.workload", "server.scaleout"),
    "guard": ("server.api", "server.app", "server.serve", "server.workload", "server.scaleout"),
    "vllm_hooks": ("server.guard", "server.api", "server.app", "server.serve", "server.workload", "server.scaleout"),
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_each_package_imports_only_what_its_process_may() -> None:
    found = []
    for package, forbidden in BOUNDARIES.items():
        for path in (SERVER / package).rglob("*.py"):
            for name in _imports(path):
                if name.startswith(forbidden):
                    found.append(f"{path.relative_to(SERVER)} imports {name}")
    assert found == []


def test_the_engine_side_reads_the_api_side_only_through_the_protocol() -> None:
    """The guard may import from server.engine only the contract and the pure helpers it shares."""
    allowed = ("server.engine.protocol", "server.engine.step_log.innermost_frames", "server.engine.spare")
    found = []
    for path in (SERVER / "guard").rglob("*.py"):
        for name in _imports(path):
            if name.startswith("server.engine") and not name.startswith(allowed) and name != "server.engine.step_log":
                found.append(f"{path.relative_to(SERVER)} imports {name}")
    assert found == []


def test_serving_loads_nothing_of_the_bench() -> None:
    """``vlguard serve``'s modules and every vLLM plugin vlguard registers (vLLM loads them in each of its
    processes) leave the bench package out but for its plugin shim (``server/workload/__init__.py``), and
    the bench extra's plotting and image libraries out (its ``openai`` and ``tqdm`` are vLLM's own too)."""
    code = (
        "import sys, server.serve, server.app, server.guard.supervisor\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('server.workload')"
        " or m.split('.')[0] in ('matplotlib', 'skimage'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["server.workload"]
