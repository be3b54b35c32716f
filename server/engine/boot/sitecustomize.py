"""Run at interpreter start-up of every Python process ``vlguard serve`` spawns (this folder is put on
their ``PYTHONPATH``): vLLM's engine-core and worker processes start watching their parent before they
import anything heavy (:func:`server.engine.parent_watch.boot`). Then the next ``sitecustomize`` on the path,
if any, runs as it would have without this one."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:  # by file, next to this folder: whatever sys.path holds, it is the vlguard that started this process
    _spec = importlib.util.spec_from_file_location(
        "vlguard_parent_watch", os.path.join(os.path.dirname(_here), "parent_watch.py")
    )
    assert _spec is not None and _spec.loader is not None
    _watch = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_watch)
    _watch.boot()
except Exception:  # an engine process must start even if the watch cannot
    pass

_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
