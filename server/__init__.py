"""vlguard: crash-proof Qwen3-VL serving on vLLM (deepstack backports, chunk alignment, engine guard)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vlguard")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
