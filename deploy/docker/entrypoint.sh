#!/bin/sh
# Entrypoint of the vlguard image: the arguments are those of the stock image's `vllm serve` entrypoint
# (model and flags), plus vlguard's --guard-* flags.
#
#   VLGUARD_DRY_RUN=1  print the resolved engine arguments, front-end address and guard settings as JSON
#                      (`vlguard serve ... --print-config`) and exit, without starting anything.
#   VLGUARD_PORT       the port /health is probed on by the image's HEALTHCHECK (default 8000); pass the
#                      same value as --port when you change it.
set -eu

if [ "${VLGUARD_DRY_RUN:-0}" = "1" ]; then
    exec vlguard serve "$@" --print-config
fi
# vlguard empties $PROMETHEUS_MULTIPROC_DIR at start (stale files of a previous run would be summed in).
exec vlguard serve "$@"
