#!/usr/bin/env bash
# Configures (once) and builds zeroband-cpp into build/ with CMake + Ninja + ccache.
#   BUILD_TYPE=Release|Debug|RelWithDebInfo (default Release)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ZB_CACHE:-$HOME/.cache/zeroband-cpp}
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
export CCACHE_DIR=${CCACHE_DIR:-$CACHE/ccache}
# Relative paths in the compile lines let every fresh clone reuse the cache.
export CCACHE_BASEDIR=$ROOT

"$ROOT/scripts/setup.sh"

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  TORCH_CMAKE=$("$ROOT/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -Wno-dev \
    -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DZB_PYTHON="$ROOT/.venv/bin/python"
fi
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
