#!/usr/bin/env bash
# GPU runs, in two places.
#
#   scripts/gpu.sh pack        on a CPU machine with PyPI, from the project root: builds the device
#                              bundle .device/ (nvFuser + Transformer Engine, ../shared/device/pack.sh)
#                              and .whl/ (small wheels the GPU image lacks). Both are git-ignored.
#   scripts/gpu.sh tests       on the GPU machine: every test — the `cuda`-marked ones and the CPU suite
#                              under that machine's torch (2.11). `tests -m cuda -n 8`: the cuda tests alone,
#                              8 at a time (pytest-xdist from .whl/; all 93 in ~90 s on an H100).
#   scripts/gpu.sh bench [..]  on the GPU machine: benchmarks/train_gpu.py (arguments passed on).
#   scripts/gpu.sh race [..]   on the GPU machine: benchmarks/region_race.py (nvFuser's regions vs
#                              Inductor's on the same graphs; arguments passed on).
#   scripts/gpu.sh casts [..]  on the GPU machine: benchmarks/fp8_cast_fusion_gpu.py (what an fp8 cast
#                              costs beside the kernel making its input, TE's way vs in the graph).
# FlashAttention-4 for benchmarks/sdpa_gpu.py travels apart, in two parts: scripts/fa4_bundle.sh.
#
# With this workplace's device tool: run(command="scripts/gpu.sh tests", carry=[".device", ".whl"]).
# To run exactly the committed tree while the working tree has edits in flight, snapshot it first:
#   rm -rf .gpu && mkdir .gpu && git archive HEAD | tar -x -C .gpu     (.gpu/ in .git/info/exclude)
#   run(command="cd .gpu && ln -s ../.device ../.whl . && scripts/gpu.sh tests", carry=[".gpu", ".device", ".whl"])
# Results also land in $OUT (when set): tests.log, bench.log, bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-tests}; shift || true
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"

if [ "$what" = pack ]; then
  set -e
  ../shared/device/pack.sh .device
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d .whl expecttest==0.3.0 torchao==0.17.0 \
    pytest-xdist==3.8.0 execnet==2.1.2
  exit 0
fi

if [ -f .device/setup.sh ]; then source .device/setup.sh; else echo "no .device bundle: nvFuser and TE rows will be skipped"; fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/whl .whl/*.whl
  export PYTHONPATH=/tmp/whl:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

case "$what" in
  tests)  # the whole suite, or the test files / folders given
    paths=(); for a in "$@"; do [[ "$a" == tests* ]] && paths+=("$a"); done
    [ ${#paths[@]} -eq 0 ] && set -- "$@" tests/
    python3 -m pytest -q --timeout 600 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" ;;
  bench) python3 benchmarks/train_gpu.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" ;;
  race)  python3 benchmarks/region_race.py "$@" 2>&1 | tee "$OUT/race.log" ;;
  casts) python3 benchmarks/fp8_cast_fusion_gpu.py "$@" 2>&1 | tee "$OUT/casts.log" ;;
  *) echo "usage: scripts/gpu.sh pack|tests|bench|race|casts [args]"; exit 2 ;;
esac
