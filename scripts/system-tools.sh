#!/usr/bin/env bash
# System tools some tests drive, from Debian's packages, installed when missing:
#   systemd-analyze (package systemd): `systemd-analyze verify` of deploy/systemd/*.service;
#   prometheus and promtool (package prometheus): the alert rules' unit tests and the real Prometheus
#   server the observability tests scrape vlguard with (started by the tests on loopback, never as a
#   service).
# Needs root (CI runs as root); otherwise prints the apt-get line to run and fails.
set -euo pipefail

need=()
command -v systemd-analyze >/dev/null || need+=(systemd)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "system-tools.sh: missing ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "system-tools.sh: installing ${need[*]}" >&2
apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
