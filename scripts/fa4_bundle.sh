#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe-DSL kernels) for the GPU machine, which has no internet. Its
# CuTe-DSL compiler library alone is 193 MB (92 MB as a wheel), more than one transfer carries (64 MiB),
# so it travels in two parts, each under 52 MB, sent by two calls while the machine stays warm.
#
#   scripts/fa4_bundle.sh pack       here (PyPI): writes .fa4a/ (the compiler library, xz) and .fa4b/
#                                    (the rest: wheels, the runtime library); both git-ignored
#   scripts/fa4_bundle.sh unpack a   on the GPU machine, first call, carry [".fa4a"]
#   scripts/fa4_bundle.sh unpack b   on the GPU machine, second call, carry [".fa4b"]: installs into
#                                    /tmp/fa4site; then `source scripts/fa4_bundle.sh env` before python
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -euo pipefail  # not in a shell that sources `env`
SITE=/tmp/fa4site
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
RUNTIME=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
# What the bundle's .pth file would add, were /tmp/fa4site a site directory (PYTHONPATH reads no .pth)
PATHS=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages

case "${1:-}" in
  pack)
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp" \
      flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
      apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.1 \
      cuda-bindings==13.0.3 cuda-pathfinder==1.3.3 protobuf==6.33.6
    rm -rf .fa4a .fa4b; mkdir -p .fa4a .fa4b "$tmp/cu13"
    (cd "$tmp/cu13" && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && rm ../nvidia_cutlass_dsl_libs_cu13-*.whl)
    xz -T0 -9 -c "$tmp/cu13/$IR" > .fa4a/cutlass_ir.so.xz
    xz -T0 -9 -c "$tmp/cu13/$RUNTIME" > .fa4b/cute_dsl_runtime.so.xz
    rm "$tmp/cu13/$IR" "$tmp/cu13/$RUNTIME"
    tar -C "$tmp/cu13" -cf .fa4b/cu13_rest.tar nvidia_cutlass_dsl
    mv "$tmp"/*.whl .fa4b/
    du -sh .fa4a .fa4b ;;
  unpack)
    mkdir -p "$SITE/$(dirname $IR)" "$SITE/$(dirname $RUNTIME)"
    if [ "${2:-}" = a ]; then xz -dc .fa4a/cutlass_ir.so.xz > "$SITE/$IR"; exit 0; fi
    [ -s "$SITE/$IR" ] || { echo "part a is missing on this machine: run 'unpack a' first (same warm machine)"; exit 1; }
    # pip --target skips a package folder that exists (part a made nvidia_cutlass_dsl/): install apart, then merge
    rm -rf "$SITE.b"; python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE.b" .fa4b/*.whl
    cp -a "$SITE.b/." "$SITE/"
    tar -C "$SITE" -xf .fa4b/cu13_rest.tar
    xz -dc .fa4b/cute_dsl_runtime.so.xz > "$SITE/$RUNTIME"
    PYTHONPATH=$PATHS python3 -c "import flash_attn.cute" ;;
  env)  # sourced
    export PYTHONPATH=$PATHS:${PYTHONPATH:-}
    return 0 2>/dev/null || exit 0 ;;
  *) echo "usage: scripts/fa4_bundle.sh pack | unpack a|b | env"; exit 2 ;;
esac
