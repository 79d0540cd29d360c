#!/usr/bin/env bash
# Builds zeroband-cpp on a machine with no package registry: the lent GPU machines have CUDA,
# CMake, ninja, a compiler and a python with torch 2.11.0, but not our Debian libraries. Two halves:
#
#   scripts/gpu/gpu_kit.sh fetch    # here (Debian 12, network): the .deb files into .gpukit/debs,
#                               # the benchmark peer's muon-fsdp2 wheel and pytest's (the
#                               # end-to-end tests') into .gpukit/wheels
#   scripts/gpu/gpu_kit.sh build    # there: unpack them into .gpukit/root (the wheel into
#                               # .gpukit/pylib, for PYTHONPATH) and build into build/
#                               # (the tests' reference python: the one `python` finds)
#   scripts/gpu/gpu_kit.sh python   # the python that has torch: $PYTHON if set (exit 1 if it has
#                               # none), else python3, else the lent machines'
#                               # /opt/torch/.venv/bin/python3 (exit 1 if neither has it)
#
# build puts that python's folder first on PATH (the pip-installed cmake and ninja live there)
# and stops, naming it, where an nvcc the build may use (/usr/local/cuda's, which CMakeLists.txt
# takes where it exists, and the one on PATH) is of another CUDA major version than torch's: our
# kernel would load a second CUDA runtime beside LibTorch's.
#
# .gpukit/ is ignored by git: name it in the device tool's `carry`. Programs built there need
#   export LD_LIBRARY_PATH=$PWD/.gpukit/root/usr/lib/x86_64-linux-gnu
# for spdlog and fmt (LibTorch is found through the RPATH); bench.sh there wants
# PYTHON=$(scripts/gpu/gpu_kit.sh python) ZB_SKIP_BUILD=1.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIT=$ROOT/.gpukit
# Headers, CMake package files and the two shared libraries the programs load. gloo: headers only
# (declarations of what libtorch has compiled in; see src/dist/gloo_backend.cpp).
PACKAGES=(libtomlplusplus-dev libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libcxxopts-dev
          nlohmann-json3-dev libgtest-dev libgmock-dev googletest libgloo-dev)

# A python that imports torch: the one named, python3, or the lent machines' own.
torch_python() {
  local candidate
  local lent=${ZB_LENT_PYTHON:-/opt/torch/.venv/bin/python3}  # where the lent machines keep it
  local candidates=(python3 "$lent")
  [ -n "${PYTHON:-}" ] && candidates=("$PYTHON")  # the one named, or none
  for candidate in "${candidates[@]}"; do
    candidate=$(command -v "$candidate" 2>/dev/null) || continue
    [ "${candidate#/}" = "$candidate" ] && candidate=$PWD/$candidate  # absolute, links kept (a venv's)
    "$candidate" -c 'import torch' 2>/dev/null && { echo "$candidate"; return 0; }
  done
  echo "$0: no python with torch (tried ${candidates[*]})${PYTHON:+; unset PYTHON to look further}" >&2
  return 1
}

case ${1:-} in
python)
  torch_python
  ;;
fetch)
  rm -rf "$KIT/debs" && mkdir -p "$KIT/debs"
  (cd "$KIT/debs" && apt-get download "${PACKAGES[@]}")
  # The Python packages the GPU machine's python3 lacks (pure Python): muon-fsdp2, pinned as
  # requirements.txt, and pytest with what it imports (tests/e2e, the CUDA checkpoint test among
  # them; tomli and exceptiongroup for a python older than 3.11).
  rm -rf "$KIT/wheels" && mkdir -p "$KIT/wheels"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --no-deps -d "$KIT/wheels" \
    "$(grep -E '^muon-fsdp2==' "$ROOT/requirements.txt")"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --only-binary=:all: -d "$KIT/wheels" \
    "$(grep -E '^pytest' "$ROOT/requirements.txt")"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: --platform any \
    --python-version 3.10 --implementation py --abi none -d "$KIT/wheels" tomli exceptiongroup
  du -sh "$KIT/debs" "$KIT/wheels"
  ;;
build)
  python=$(torch_python)
  export PATH=$(dirname "$python"):$PATH
  torch_cmake=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  torch_cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
  echo "python $python (torch CUDA ${torch_cuda:-none}), $(command -v cmake || echo 'no cmake'), $(command -v ninja || echo 'no ninja')"
  nvccs=()
  [ -x /usr/local/cuda/bin/nvcc ] && nvccs+=(/usr/local/cuda/bin/nvcc)
  on_path=$(command -v nvcc || true)
  [ -n "$on_path" ] && [ "$on_path" != /usr/local/cuda/bin/nvcc ] && nvccs+=("$on_path")
  for nvcc in "${nvccs[@]}"; do
    nvcc_cuda=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p') || true
    echo "$nvcc: CUDA ${nvcc_cuda:-of unknown version}"
    if [ -n "$torch_cuda" ] && [ -n "$nvcc_cuda" ] && [ "${torch_cuda%%.*}" != "${nvcc_cuda%%.*}" ]; then
      echo "$0: $nvcc is CUDA $nvcc_cuda but torch was built for CUDA $torch_cuda: the build needs a CUDA ${torch_cuda%%.*} toolkit" >&2
      exit 1
    fi
  done
  rm -rf "$KIT/root" && mkdir -p "$KIT/root"
  for deb in "$KIT"/debs/*.deb; do dpkg -x "$deb" "$KIT/root"; done
  rm -rf "$KIT/pylib" && mkdir -p "$KIT/pylib"
  for wheel in "$KIT"/wheels/*.whl; do [ -f "$wheel" ] && "$python" -m zipfile -e "$wheel" "$KIT/pylib"; done
  usr=$KIT/root/usr
  # The test programs run at build time (gtest discovery) and load spdlog and fmt from the kit.
  export LD_LIBRARY_PATH=$usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # -isystem: the unpacked headers after LibTorch's own (-I comes first), as /usr/include would be.
  cmake -S "$ROOT" -B "$ROOT/build" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;$usr;$usr/lib/x86_64-linux-gnu/cmake" \
    -DCMAKE_CXX_FLAGS="-isystem $usr/include" \
    -DZB_PYTHON="$python"
  # ZB_BUILD_TARGETS: only these targets (a lent machine's minutes; gpu_check.sh names its own).
  read -r -a targets <<<"${ZB_BUILD_TARGETS:-}"
  cmake --build "$ROOT/build" -j "${JOBS:-$(nproc)}" ${targets[@]+--target "${targets[@]}"}
  ;;
*)
  echo "usage: $0 fetch|build|python" >&2
  exit 2
  ;;
esac
