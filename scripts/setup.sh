#!/usr/bin/env bash
# Installs everything zeroband-cpp needs, non-interactively. Safe to run again: with nothing
# changed it finishes in seconds.
#   - Debian packages (compilers' helpers, toml++, spdlog, cxxopts, json, GoogleTest, OpenMPI)
#   - a Python virtual environment with the pinned torch (our LibTorch), kept outside the clone
#     under $ZB_CACHE (default ~/.cache/zeroband-cpp), keyed by requirements.txt, so that every
#     clone of the project on this machine shares it; .venv in the clone links to it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ZB_CACHE:-$HOME/.cache/zeroband-cpp}
mkdir -p "$CACHE"
# One setup at a time on this machine (clones share the cache).
exec 9>"$CACHE/setup.lock"
flock 9

# --- Debian packages --------------------------------------------------------------------------
APT_PACKAGES=(cmake ninja-build g++ ccache pkg-config
              libtomlplusplus-dev libspdlog-dev libfmt-dev libcxxopts-dev nlohmann-json3-dev
              libgtest-dev libgmock-dev openmpi-bin libopenmpi-dev python3-venv
              libgloo-dev   # gloo headers for ProcessGroupGloo.hpp (the torch wheel lacks them)
              python3.11-doc)  # the embedded corpus: Python's documentation sources
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Python environment (torch = LibTorch) ----------------------------------------------------
PY=${ZB_PYTHON:-python3}
key=$( (cat "$ROOT/requirements.txt"; "$PY" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
VENV="$CACHE/venv-$key"
if [ ! -f "$VENV/.complete" ]; then
  echo "setup: creating Python environment $VENV (torch is large: a few minutes the first time)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
  touch "$VENV/.complete"
fi
ln -sfn "$VENV" "$ROOT/.venv"
# Environments of older requirements are several GB each: keep only the current one.
for old in "$CACHE"/venv-*; do
  [ "$old" = "$VENV" ] || rm -rf "$old"
done

# --- the embedded corpus: Python's reStructuredText docs -> a 1024-token BPE -> token shards --
DOCS=/usr/share/doc/python3.11/html/_sources
ckey=$( (cat "$ROOT/scripts/data/make_shards.py"; dpkg-query -W python3.11-doc) | sha256sum | cut -c1-12)
DATA="$CACHE/data/python-docs-$ckey"
if [ ! -f "$DATA/meta.json" ]; then
  echo "setup: building the embedded corpus $DATA from $DOCS"
  rm -rf "$DATA.tmp"
  "$VENV/bin/python" "$ROOT/scripts/data/make_shards.py" "$DATA.tmp" "$DOCS" --train-vocab 1024 \
      --val-fraction 0.02 --shard-tokens 1000000 >/dev/null
  rm -rf "$DATA" && mv "$DATA.tmp" "$DATA"
fi
mkdir -p "$ROOT/data"
ln -sfn "$DATA" "$ROOT/data/python-docs"

# --- ccache, outside the clone as well ---------------------------------------------------------
mkdir -p "$CACHE/ccache"
if [ ! -f "$CACHE/ccache/ccache.conf" ]; then
  cat > "$CACHE/ccache/ccache.conf" <<CONF
max_size = 5G
sloppiness = pch_defines,time_macros,include_file_mtime,include_file_ctime
CONF
fi
echo "setup: ready (python env: $VENV)"
