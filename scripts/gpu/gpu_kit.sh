#!/usr/bin/env bash
# Builds zeroband-cpp on a machine with no package registry: the lent GPU machines have CUDA,
# CMake, ninja, a compiler and python3 with torch 2.11.0, but not our Debian libraries. Two halves:
#
#   scripts/gpu/gpu_kit.sh fetch    # here (Debian 12, network): the .deb files into .gpukit/debs,
#                               # the benchmark peer's muon-fsdp2 wheel into .gpukit/wheels
#   scripts/gpu/gpu_kit.sh build    # there: unpack them into .gpukit/root (the wheel into
#                               # .gpukit/pylib, for PYTHONPATH) and build into build/
#                               # (the tests' reference python: that machine's python3)
#
# .gpukit/ is ignored by git: name it in the device tool's `carry`. Programs built there need
#   export LD_LIBRARY_PATH=$PWD/.gpukit/root/usr/lib/x86_64-linux-gnu
# for spdlog and fmt (LibTorch is found through the RPATH); bench.sh there wants PYTHON=python3
# ZB_SKIP_BUILD=1.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIT=$ROOT/.gpukit
# Headers, CMake package files and the two shared libraries the programs load. gloo: headers only
# (declarations of what libtorch has compiled in; see src/dist/gloo_backend.cpp).
PACKAGES=(libtomlplusplus-dev libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libcxxopts-dev
          nlohmann-json3-dev libgtest-dev libgmock-dev googletest libgloo-dev)

case ${1:-} in
fetch)
  rm -rf "$KIT/debs" && mkdir -p "$KIT/debs"
  (cd "$KIT/debs" && apt-get download "${PACKAGES[@]}")
  # The one Python package the GPU machine's python3 lacks (pure Python), pinned as requirements.txt.
  rm -rf "$KIT/wheels" && mkdir -p "$KIT/wheels"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --no-deps -d "$KIT/wheels" \
    "$(grep -E '^muon-fsdp2==' "$ROOT/requirements.txt")"
  du -sh "$KIT/debs" "$KIT/wheels"
  ;;
build)
  rm -rf "$KIT/root" && mkdir -p "$KIT/root"
  for deb in "$KIT"/debs/*.deb; do dpkg -x "$deb" "$KIT/root"; done
  rm -rf "$KIT/pylib" && mkdir -p "$KIT/pylib"
  for wheel in "$KIT"/wheels/*.whl; do [ -f "$wheel" ] && python3 -m zipfile -e "$wheel" "$KIT/pylib"; done
  python=$(command -v "${PYTHON:-python3}")
  torch_cmake=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  usr=$KIT/root/usr
  # The test programs run at build time (gtest discovery) and load spdlog and fmt from the kit.
  export LD_LIBRARY_PATH=$usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # -isystem: the unpacked headers after LibTorch's own (-I comes first), as /usr/include would be.
  cmake -S "$ROOT" -B "$ROOT/build" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;$usr;$usr/lib/x86_64-linux-gnu/cmake" \
    -DCMAKE_CXX_FLAGS="-isystem $usr/include" \
    -DZB_PYTHON="$python"
  cmake --build "$ROOT/build" -j "${JOBS:-$(nproc)}"
  ;;
*)
  echo "usage: $0 fetch|build" >&2
  exit 2
  ;;
esac
