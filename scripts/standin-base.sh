#!/usr/bin/env bash
# A stand-in for the stock base image vllm/vllm-openai:v<LANE>, which cannot be pulled here, with the stock
# image's contract: `python3` (first on PATH) has pip, vLLM and torch (the lane's CPU environment, the
# one the tests run, usable by any user), `python3 -m vllm.entrypoints.openai.api_server` is the entrypoint,
# and g++ is there (torch inductor compiles C++ on the CPU platform). Built from Debian's packages (debootstrap) plus the
# lane's interpreter and virtual environment at their own absolute paths, imported with `docker import`.
#
# Kept between runs: the tag carries the environment's name (its requirements hash), so a machine builds
# it once per lane environment (~3 min: 7 GB), then reuses it. Needs root and a running dockerd.
#
# Usage: scripts/standin-base.sh [LANE]     prints the image tag as its last line.
set -euo pipefail
lane=${1:-0.20.0}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$("$root/scripts/venv.sh" "$lane")
venv=$(dirname "$(dirname "$py")")
# The recipe (this script) is part of the tag: a changed recipe builds a new stand-in.
tag="vlguard-standin:$(basename "$venv")-$(sha256sum "$0" | cut -c1-8)"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi

# The interpreter the venv was made from (pyvenv.cfg `home` is its bin directory).
pyhome=$(dirname "$(sed -n 's/^home = //p' "$venv/pyvenv.cfg")")
# An overlay lane (scripts/venv.sh: 0.34.0 over 0.32.0) sees its base lane's site-packages through a .pth:
# the base environment goes into the image too, at its own path.
base_venvs=$(sed -n 's/.*site\.addsitedir("\([^"]*\)\/lib\/python[^"]*").*/\1/p' "$venv"/lib/python*/site-packages/zz_vlguard_base_lane.pth 2>/dev/null || true)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "standin-base.sh: debootstrap bookworm (minbase + g++, procps, libnuma (vLLM CPU ops), the interpreter's libraries)" >&2
debootstrap --variant=minbase \
  --include=g++,procps,ca-certificates,libnuma1,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgomp1 \
  bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
# The stock image's Python serves any user (vlguard's image runs as uid 10001): the lane's interpreter and
# environment live below /root on this machine, so /root must be traversable, as /usr/local is there.
chmod 0755 "$work/rootfs/root"
# pip inside builds verifies TLS against this machine's CA bundle (the registries' certificates).
cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$work/rootfs/etc/ssl/certs/host-ca.crt"

echo "standin-base.sh: importing rootfs + $pyhome + $venv ${base_venvs:+(over $base_venvs) }as ${tag}-rootfs" >&2
tar -c -C "$work/rootfs" . -C / "${pyhome#/}" "${venv#/}" $(for b in $base_venvs; do echo "${b#/}"; done) \
  | docker import \
      --change "ENV PATH=$venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
      --change "ENV PIP_CERT=/etc/ssl/certs/host-ca.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt" \
      --change 'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]' \
      - "${tag}-rootfs" >&2

# The development environment carries vlguard and its test plugins as editable installs of a checkout
# that is not in the image: remove them (the stock image has neither), from a base lane too (pip removes
# only what is inside the environment it runs in).
docker build --network host -t "$tag" - >&2 <<EOF
FROM ${tag}-rootfs
RUN for py in $(for b in $base_venvs; do echo "$b/bin/python3"; done) python3; do "\$py" -m pip uninstall -y vlguard vlguard-test-plugins; done \\
 && python3 -c "import vllm, torch; print(vllm.__version__)"
EOF
docker image rm "${tag}-rootfs" >/dev/null
echo "$tag"
