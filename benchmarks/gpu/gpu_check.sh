#!/usr/bin/env bash
# Every CUDA path of Bagua in one command, for a lent GPU machine (docs/gpu.md):
#
#   benchmarks/gpu/gpu_check.sh OUT_DIR [--stage install,tests,codec,step,network,latency] [--wheels .whl] [--budget-s 540] ...
#   benchmarks/gpu/gpu_check.sh --fetch .whl     # where PyPI (and apt) work: the wheels (and iproute2 .debs) to carry
#
# It writes OUT_DIR/gpu_check.json and gpu_check.log (and the network stages' CSV/JSON). Without CUDA the same
# steps run as a dry run: each part that needs CUDA is skipped with one line. Options: python -m
# benchmarks.gpu.gpu_check --help. PYTHON picks the interpreter (default python3, the one holding torch there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"

# No ip or tc on the machine (the network stages need them): unpack the .debs carried in <wheels>/debs into a
# folder of their own and put it first on PATH; nothing under / is touched.
wheels=.whl
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --wheels) wheels="${args[$((i + 1))]:-.whl}" ;;
    --wheels=*) wheels="${args[$i]#--wheels=}" ;;
  esac
done
if ! { command -v ip && command -v tc; } >/dev/null 2>&1 && compgen -G "$wheels/debs/*.deb" >/dev/null; then
  root=/tmp/bagua-iproute2
  for deb in "$wheels"/debs/*.deb; do dpkg -x "$deb" "$root"; done
  export PATH="$root/usr/sbin:$root/sbin:$root/usr/bin:$root/bin:$PATH"
  libs="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "gpu_check.sh: ip and tc from $wheels/debs ($(command -v tc))"
fi
exec "$PY" -m benchmarks.gpu.gpu_check "$@"
