"""The ``vlguard`` command.

``vlguard serve [model] [every vllm serve flag] [--guard-* flags]`` parses with vLLM's own parser plus
the guard's flags (:mod:`server.args`). ``vlguard tiny-model [DIR]`` writes the embedded tiny Qwen3-VL.
``vlguard bench twopass|compare`` runs the two-pass workload and the side-by-side benchmarks
(:mod:`server.workload.cli`). ``vlguard forensics list|replay`` reads the forensic records
(:mod:`server.forensics_cli`).

vLLM is imported lazily: ``serve`` must set up the Prometheus multiprocess directory before
``prometheus_client`` is first imported (vLLM imports it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from server.args import add_tiny_model_args, describe_config, resolve_serve_args


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``vlguard`` console script and ``python -m server``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # a client: imports no vLLM
        try:
            from server.workload.cli import main as bench_main
        except ModuleNotFoundError as exc:  # the bench's own dependencies are an extra
            sys.exit(f"vlguard bench needs the bench extra: pip install 'vlguard[bench]' (missing: {exc.name})")
        sys.exit(bench_main(argv[1:]))
    if argv[:1] == ["forensics"]:  # a client: imports no vLLM
        from server.forensics_cli import main as forensics_main

        sys.exit(forensics_main(argv[1:]))
    if "--print-config" in argv:
        # stdout carries the JSON alone; vLLM logs to stdout unless told otherwise.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    elif argv[:1] == ["serve"]:
        from server import run_dirs
        from server.metrics.registry import prepare_multiprocess_dir

        run_dirs.sweep()  # what vlguard processes killed before their end left in the temp folder
        prepare_multiprocess_dir()

    if argv[:1] == ["tiny-model"]:
        tiny = argparse.ArgumentParser(prog="vlguard tiny-model")  # without vLLM's serve parser: no vLLM import
        add_tiny_model_args(tiny)
        args = tiny.parse_args(argv[1:])
        from server.devmodel import build_tiny_model
        from server.devmodel_cache import cached_tiny_model

        print(build_tiny_model(args.dir) if args.dir else cached_tiny_model())
        return

    import pydantic

    try:
        args, settings = resolve_serve_args(argv)
    except pydantic.ValidationError as exc:  # a --guard-* value out of range: a usage error, not a traceback
        for err in exc.errors():
            flag = "--guard-" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            print(f"vlguard serve: {flag}: {err['msg']} (got {err.get('input')!r})", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        json.dump(describe_config(args, settings), sys.stdout, indent=2, sort_keys=True, default=repr)
        sys.stdout.write("\n")
        return

    from server.start import run

    sys.exit(run(args, settings))
