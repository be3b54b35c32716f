"""Parsing ``vlguard serve`` arguments, the one place the CLI and the bench share.

``vlguard serve [model] [every vllm serve flag] [--guard-* flags]`` parses with vLLM's own parser
(``make_arg_parser``, ``FlexibleArgumentParser``: so ``--model X``, ``--config profile.yaml`` and every
engine flag behave exactly as under ``vllm serve``), plus one ``--guard-<name>`` flag per field of
:class:`server.settings.GuardSettings`. vLLM is imported inside the functions, never at import time.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from server import front_flags, launcher

if TYPE_CHECKING:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.settings import GuardSettings

GUARD_PREFIX = "guard_"


def _add_guard_args(parser: argparse.ArgumentParser) -> None:
    from server.settings import GuardSettings

    group = parser.add_argument_group("vlguard", "vlguard's own options (env VLGUARD_<NAME> also works)")
    for name, field in GuardSettings.model_fields.items():
        group.add_argument(
            "--guard-" + name.replace("_", "-"),
            dest=GUARD_PREFIX + name,
            default=argparse.SUPPRESS,  # absent flags fall through to the environment and the default
            metavar=name.upper(),
            help=(field.description or "").replace("%", "%%") + f" (default: {field.default})",
        )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="Print the parsed engine arguments and guard settings as JSON and exit (loads nothing).",
    )


def _count(text: str) -> int:
    """A whole number, 0 or more (vLLM 0.32's ``ge=0``)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _add_queue_caps(parser: argparse.ArgumentParser) -> None:
    """Backport of vLLM PR #49445's ``--max-num-queued-reqs`` and ``--max-num-queued-tokens`` (vLLM 0.32)
    where the installed vLLM lacks them: the same flags and meaning, enforced at vlguard's door
    (:mod:`server.api.overload`)."""
    if any("--max-num-queued-reqs" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group("queue caps", "backported from vLLM 0.32 (PR #49445), enforced by vlguard")
    group.add_argument("--max-num-queued-reqs", type=_count, default=None, metavar="N",
                       help="Most requests in flight (waiting or running) at once; one more gets 503.")  # fmt: skip
    group.add_argument("--max-num-queued-tokens", type=_count, default=None, metavar="N",
                       help="Most prompt tokens of requests in the prefill phase; at or above it a new "
                       "request gets 503.")  # fmt: skip


def build_parser() -> FlexibleArgumentParser:
    """The ``vlguard`` parser: ``serve`` (vLLM's serve parser + guard flags) and ``tiny-model``."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.vllm_hooks.locations import vllm_symbol

    make_arg_parser = vllm_symbol("make_arg_parser")

    parser = FlexibleArgumentParser(prog="vlguard", description="Crash-proof Qwen3-VL serving on vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="Serve the OpenAI API on a guarded vLLM engine (takes every `vllm serve` flag).",
        usage="vlguard serve [model] [vllm serve flags] [--guard-* flags]",
    )
    make_arg_parser(serve)
    _add_queue_caps(serve)
    _add_guard_args(serve)
    add_tiny_model_args(sub.add_parser("tiny-model", help="Write the deterministic tiny Qwen3-VL (DIR or the cache)."))
    # Listed for --help only: main() hands `bench ...` to server.workload.cli before this parser runs.
    sub.add_parser("bench", help="Two-pass workload and side-by-side benchmarks (vlguard bench --help).")
    sub.add_parser("forensics", help="List forensic records, replay one (vlguard forensics --help).")
    return parser


def add_tiny_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", help="Output directory (created if missing); default: built once in "
                        "$VLGUARD_CACHE (~/.cache/vlguard) at a stable path. Prints the directory.")  # fmt: skip


def guard_settings(args: argparse.Namespace) -> GuardSettings:
    """The :class:`GuardSettings` for parsed ``serve`` arguments (explicit flags over the environment).

    ``vllm serve``'s ``--shutdown-timeout S`` (S > 0: wait up to S s for in-flight requests at shutdown)
    is vlguard's drain timeout: a migrated launch line keeps its meaning unless ``--guard-drain-timeout``
    is given too (which wins). vLLM's default 0 ("abort") leaves vlguard's drain timeout as it is."""
    from server.settings import settings_from_flags

    flags = {k.removeprefix(GUARD_PREFIX): v for k, v in vars(args).items() if k.startswith(GUARD_PREFIX)}
    if getattr(args, "shutdown_timeout", 0) and "drain_timeout" not in flags:
        flags["drain_timeout"] = str(args.shutdown_timeout)
    return settings_from_flags(flags)


def resolve_serve_args(argv: list[str]) -> tuple[argparse.Namespace, GuardSettings]:
    """Parse ``serve`` arguments the way ``vllm serve`` does and build the guard settings.

    Arguments:
        argv: the arguments after the program name, starting with ``serve``.

    Raises:
        SystemExit: unknown flag or bad value (argparse prints the usage); status 2 for a front-end flag
            vlguard cannot honour yet (:mod:`server.front_flags`, each named on stderr), or for what vLLM's
            launcher would refuse before building the engine (:func:`server.launcher.prepare`).
        pydantic.ValidationError: a guard setting is invalid.
    """
    from server.vllm_hooks.locations import vllm_symbol

    validate_parsed_serve_args = vllm_symbol("validate_parsed_serve_args")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    lines = front_flags.refused(args, serve_parser(parser))  # never accepted and dropped
    if not lines:
        try:
            launcher.prepare(args)  # what vLLM's launcher loads and checks before it builds the engine
        except ValueError as exc:
            lines = [str(exc)]
    if lines:
        for line in lines:
            print(f"vlguard serve: {line}", file=sys.stderr)
        raise SystemExit(2)
    return args, guard_settings(args)


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser inside :func:`build_parser`'s."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices["serve"]
            return found
    raise LookupError("no serve subcommand")


def describe_config(args: argparse.Namespace, settings: GuardSettings) -> dict[str, Any]:
    """The engine arguments vLLM would build from ``args``, what vlguard changes in vLLM's behaviour
    (:func:`server.serve.vllm_changes`), the front-end address and guard settings.

    Reads exactly the fields ``AsyncEngineArgs.from_cli_args`` hands to the constructor, plus vlguard's
    overrides, without running ``__post_init__`` (which loads plugins and, under ``HF_HUB_OFFLINE``,
    resolves the model path). Config objects print as their ``repr``.
    """
    from server.serve import engine_config, vllm_changes

    return {
        "engine": engine_config(args, settings),
        "vlguard_changes": vllm_changes(args, settings),
        "frontend": {
            "host": args.host,
            "port": args.port,
            "served_model_name": args.served_model_name,
            "api_server_count": args.api_server_count or 1,  # above 1: an owner and N API processes
        },
        "front_differences": front_flags.DIFFERENCES,
        "guard": settings.model_dump(),
    }
