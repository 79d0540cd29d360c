#!/usr/bin/env bash
# Configures (once) and builds zeroband-cpp into build/ with CMake + Ninja + ccache.
#   scripts/build.sh             everything: programs, tests, the GPU plugin where LibTorch has CUDA
#   scripts/build.sh programs    what scripts/train.sh runs: train_fsdp and export_hf, and the GPU
#                                plugin where the programs load it (the NVIDIA driver is here)
#   scripts/build.sh TARGET...   those targets and what they need
#   BUILD_TYPE=Release|Debug|RelWithDebInfo (default Release)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ZB_CACHE:-$HOME/.cache/zeroband-cpp}
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
export CCACHE_DIR=${CCACHE_DIR:-$CACHE/ccache}
# Relative paths in the compile lines let every fresh clone reuse the cache.
export CCACHE_BASEDIR=$ROOT
# What ccache needs to cache compiles that use a precompiled header (CMakeLists.txt).
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}

"$ROOT/scripts/setup.sh"

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  TORCH_CMAKE=$("$ROOT/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -Wno-dev \
    -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DZB_PYTHON="$ROOT/.venv/bin/python"
fi
targets=("$@")
if [ "${targets[*]-}" = programs ]; then
  targets=(train_fsdp export_hf)
  # The programs load the plugin where the driver is (util/cuda_plugin.h); it exists with CUDA's LibTorch.
  if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && ninja -C "$BUILD_DIR" -t targets all | grep -q '^zb_cuda:'; then
    targets+=(zb_cuda)
  fi
fi
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" ${targets[@]+--target "${targets[@]}"}
