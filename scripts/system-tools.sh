#!/usr/bin/env bash
# System tools some tests drive, from Debian's packages, installed when missing:
#   systemd-analyze (package systemd): `systemd-analyze verify` of deploy/systemd/*.service;
#   prometheus and promtool (package prometheus): the alert rules' unit tests and the real Prometheus
#   server the observability tests scrape vlguard with (started by the tests on loopback, never as a
#   service);
#   haproxy (package haproxy): the shipped load-balancer configuration run in front of two replicas
#   (started by the tests in the foreground on loopback, never as a service).
#   kubectl (package kubectl): `kubectl kustomize deploy/kubernetes` (renders offline);
#   docker (package docker.io) and debootstrap: the image built on a stand-in base and run for real
#   (scripts/standin-base.sh); dockerd is started here when it is not running (overlay2, cgroupfs; log in
#   /var/log/vlguard-dockerd.log);
#   kubernetes-validate (PyPI, pinned, in its own venv $VLGUARD_CACHE/tools-venv): the rendered manifests
#   checked against the Kubernetes schemas, offline;
#   checkov (PyPI, pinned, in its own venv $VLGUARD_CACHE/checkov-venv: it brings many dependencies): the
#   rendered manifests checked against the "restricted" Pod Security Standard's rules, offline.
# The apt part needs root (CI runs as root); otherwise it prints the apt-get line to run and fails.
set -euo pipefail

cache="${VLGUARD_CACHE:-$HOME/.cache/vlguard}"
# pinned_tool VENV COMMAND PACKAGE VERSION: PACKAGE==VERSION in its own venv $cache/VENV, unless COMMAND
# there already reports VERSION.
pinned_tool() {
  local venv="$cache/$1" command=$2 package=$3 version=$4
  if ! "$venv/bin/$command" --version 2>/dev/null | grep -qx "$version"; then
    echo "system-tools.sh: installing $package==$version in $venv" >&2
    rm -rf "$venv" && python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --no-input --progress-bar off -q "$package==$version" >&2
  fi
}
pinned_tool tools-venv kubernetes-validate kubernetes-validate 1.37.0
pinned_tool checkov-venv checkov checkov 3.3.30

need=()
command -v systemd-analyze >/dev/null || need+=(systemd)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || need+=(prometheus)
{ command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; } || need+=(haproxy)
command -v kubectl >/dev/null || need+=(kubectl)
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "system-tools.sh: missing ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  echo "system-tools.sh: installing ${need[*]}" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

if ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "system-tools.sh: no Docker engine answers; start dockerd (as root)" >&2
    exit 1
  fi
  echo "system-tools.sh: starting dockerd" >&2
  setsid dockerd --storage-driver=overlay2 --exec-opt native.cgroupdriver=cgroupfs \
    >>/var/log/vlguard-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "system-tools.sh: dockerd did not start" >&2; tail -20 /var/log/vlguard-dockerd.log >&2; exit 1; }
fi
