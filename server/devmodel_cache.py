"""Where the embedded tiny model lives on a machine: built once per builder revision, then reused.

Separate from :mod:`server.devmodel` because the path is keyed by that module's bytes: a change here must
not look like a new model (and throw away vLLM's compile cache for it).
"""

from __future__ import annotations

from pathlib import Path


def cached_tiny_model(cache: str | Path | None = None) -> Path:
    """The tiny model at a path that is the same for every run on a machine, built there once.

    ``<cache>/tiny-qwen3-vl-<hash of server/devmodel.py>-tf<transformers version>``; ``cache`` defaults to
    ``$VLGUARD_CACHE`` or ``~/.cache/vlguard``. A stable path because vLLM keys its torch.compile cache by
    the engine configuration, which holds the model path (a per-run directory compiled from scratch every
    time, ~40 s per compiled launch on 2 cores); the transformers version is in the name because the
    tokenizer and processor files it writes differ between versions. Concurrent callers are safe: each
    builds in a temporary directory and the first rename wins.

    Returns:
        The model directory (``model.safetensors`` present).
    """
    import hashlib
    import os
    import shutil
    import tempfile

    import transformers

    from server import devmodel

    base = Path(cache or os.environ.get("VLGUARD_CACHE") or Path.home() / ".cache" / "vlguard")
    digest = hashlib.sha256(Path(devmodel.__file__).read_bytes()).hexdigest()[:12]
    path = base / f"tiny-qwen3-vl-{digest}-tf{transformers.__version__}"
    if not (path / "model.safetensors").exists():
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=base))
        try:
            devmodel.build_tiny_model(tmp)
            tmp.rename(path)
        except OSError:
            if not (path / "model.safetensors").exists():
                raise
        finally:  # another process built it meanwhile, or the build failed
            shutil.rmtree(tmp, ignore_errors=True)
    _readable_by_all(path)
    return path


def _readable_by_all(path: Path) -> None:
    """Make the model readable by every user (mkdtemp's 0700 and the weights file's 0600 hid it from a service
    user: systemd ``User=``, the image's uid 10001). Where it is someone else's, leave it."""
    import contextlib

    with contextlib.suppress(OSError):
        path.chmod(0o755)
        for file in path.iterdir():
            file.chmod(file.stat().st_mode | 0o444)
