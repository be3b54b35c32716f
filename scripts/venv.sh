#!/usr/bin/env bash
# Create (or reuse) the cached virtual environment for one vLLM engine lane and print its Python.
#
# The environment lives outside the clone, in $VLGUARD_CACHE (default ~/.cache/vlguard), keyed by a
# hash of the lane's requirement files and the Python version, so CI and later runs reuse it instead of
# reinstalling ~6 GB. It is built in a temporary folder and renamed only when every step succeeded;
# any pip error stops the build (set -e) and leaves nothing half-built behind.
#
# Usage: scripts/venv.sh [LANE]    (LANE defaults to 0.20.0; see requirements/vllm-LANE-*.txt)
#
# A front lane (requirements/vllm-LANE-overlay names its base lane) has no CPU build of its vLLM: its
# environment holds only that vLLM wheel (--no-deps, requirements/vllm-LANE-engine.txt) and sees the base
# lane's environment behind it (torch, dependencies, tools, vlguard's editable installs) through a .pth
# file, which also sets the overlay file's KEY=VALUE lines as defaults in every process it starts.
set -euo pipefail

lane=${1:-0.20.0}
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements"
py=${PYTHON:-python3}
cache=${VLGUARD_CACHE:-$HOME/.cache/vlguard}
overlay="$req/vllm-$lane-overlay"

if [ -f "$overlay" ]; then
  base_lane=$(grep -v '^#' "$overlay" | head -n 1)
  [ -f "$req/vllm-$lane-engine.txt" ] || { echo "venv.sh: lane '$lane' lacks requirements/vllm-$lane-engine.txt" >&2; exit 2; }
  base_py=$("$0" "$base_lane")  # builds or reuses the base lane, pointed at this clone
  key=$( { echo "$base_py"; cat "$overlay" "$req/vllm-$lane-engine.txt"; } | sha256sum | cut -c1-12)
  venv="$cache/venv-$lane-$key"
  if [ ! -x "$venv/bin/python" ]; then
    tmp="$venv.building.$$"
    rm -rf "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    echo "venv.sh: building $venv over lane $base_lane" >&2
    "$py" -m venv --without-pip "$tmp"
    site=$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    defaults=$(grep -v '^#' "$overlay" | tail -n +2 | grep '=' \
      | sed -E 's/^([A-Za-z_][A-Za-z0-9_]*)=(.*)$/os.environ.setdefault("\1", "\2");/' | tr -d '\n')
    echo "import os, site; ${defaults} site.addsitedir(\"$base_site\")" > "$site/zz_vlguard_base_lane.pth"
    "$base_py" -m pip install --no-input --progress-bar off --no-deps --target "$site" \
      -r "$req/vllm-$lane-engine.txt" >&2
    mv "$tmp" "$venv"
    trap - EXIT
    # the venv's paths name the temporary folder: fix them up after the rename
    grep -rl "$tmp" "$venv/bin" "$venv/pyvenv.cfg" 2>/dev/null | xargs -r sed -i "s|$tmp|$venv|g"
  fi
  echo "$venv/bin/python"
  exit 0
fi

for f in torch deps engine; do
  [ -f "$req/vllm-$lane-$f.txt" ] || { echo "venv.sh: no lane '$lane' (missing requirements/vllm-$lane-$f.txt)" >&2; exit 2; }
done

key=$( { "$py" --version; cat "$req/vllm-$lane-torch.txt" "$req/vllm-$lane-deps.txt" \
  "$req/vllm-$lane-engine.txt" "$req/dev.txt"; [ ! -f "$req/vllm-$lane-env" ] || cat "$req/vllm-$lane-env"; } \
  | sha256sum | cut -c1-12)
venv="$cache/venv-$lane-$key"

if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$cache"
  tmp="$venv.building.$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  echo "venv.sh: building $venv (first run takes a few minutes and ~6 GB)" >&2
  pip_env=()
  # A lane may need pip's environment adjusted (e.g. 0.32.0 must not see PIP_FIND_LINKS).
  if [ -f "$req/vllm-$lane-env" ]; then read -r -a pip_env < "$req/vllm-$lane-env"; fi
  "$py" -m venv "$tmp"
  pip() { env "${pip_env[@]}" "$tmp/bin/python" -m pip install --no-input --progress-bar off "$@" >&2; }
  pip --upgrade pip
  pip -r "$req/vllm-$lane-torch.txt"
  pip -r "$req/vllm-$lane-deps.txt"
  pip --no-deps -r "$req/vllm-$lane-engine.txt"
  pip -r "$req/dev.txt"
  # venv scripts hard-code their folder; fix them up for the final name before the rename.
  grep -rl "$tmp" "$tmp/bin" | xargs sed -i "s|$tmp|$venv|g"
  mv "$tmp" "$venv"
  trap - EXIT
fi

# Point the environment at this clone (editable installs; fast when already pointing here): vlguard
# itself and the test-only vLLM plugins. Plugin entry points live in package metadata, so both must be
# installed, not only on PYTHONPATH.
for pkg in "vlguard=$root" "vlguard-test-plugins=$root/tests/plugins"; do
  name=${pkg%%=*} dir=${pkg#*=}
  # Reinstall when the clone or the package metadata (entry points) changed.
  want="$dir $(sha256sum "$dir/pyproject.toml" | cut -c1-16)"
  marker="$venv/.editable-$name"
  if [ "$(cat "$marker" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install --no-input --no-deps --no-build-isolation -q -e "$dir" >&2
    echo "$want" > "$marker"
  fi
done

echo "$venv/bin/python"
