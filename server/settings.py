"""vlguard's own options (everything that is not a ``vllm serve`` flag).

One pydantic ``Settings`` class. Each field becomes a ``--guard-<name>`` CLI flag (its docstring is the
``--help`` text), can be set in a YAML profile as ``guard-<name>: value`` (the same file ``--config``
hands to vLLM's parser), or through the environment as ``VLGUARD_<NAME>``. Precedence: CLI, then the
profile, then the environment, then the default. Built once in the CLI and passed down; never read at
import time.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GuardSettings(BaseSettings):
    """Options of the vlguard wrapper around vLLM."""

    model_config = SettingsConfigDict(env_prefix="VLGUARD_", use_attribute_docstrings=True, extra="forbid", frozen=True)

    patches: bool = True
    """Backport the deepstack fixes into every vLLM process where the installed vLLM needs them
    (on/off). Off is for A/B runs only."""

    startup_timeout: float = Field(default=1800.0, gt=0)
    """Seconds the engine may take to load and compile before start-up is declared failed."""


def settings_from_flags(flags: dict[str, str]) -> GuardSettings:
    """Build the settings from explicitly given ``guard_*`` flags (CLI or profile) over the environment.

    Arguments:
        flags: field name (without the ``guard_`` prefix) to raw string value.

    Raises:
        pydantic.ValidationError: a value is out of range or of the wrong type.
    """
    return GuardSettings(**flags)  # type: ignore[arg-type]
