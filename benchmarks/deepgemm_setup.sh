#!/usr/bin/env bash
# Unpack the offline DeepGEMM bundle (.device/deepgemm/, git-ignored; made by benchmarks/deepgemm_bundle.sh) on a
# machine with no network, apply its documented patches, and print the environment that makes
# `python3 -c "import deep_gemm"` work.
#
#   eval "$(bash benchmarks/deepgemm_setup.sh [DEST])"      # from the repo root; DEST defaults to /tmp/deepgemm
#   python3 benchmarks/bench_grouped_gemm.py --out $OUT/grouped_gemm.json
#
# stdout carries only `export ...` lines (so eval works); everything else goes to stderr. The same lines are written
# to DEST/env.sh. Nothing outside DEST is written. Needs: python3 with CUDA torch, nvcc (>= 12.3; 13.0 there) and a host
# C++ compiler for it (the JIT runs `nvcc -cubin`), cuobjdump in the same toolkit, and the Python package
# cuda-bindings (from the image; the bundle's cp312 wheel is installed into DEST/site only when the import fails).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
BUNDLE="${DEEPGEMM_BUNDLE:-$ROOT/.device/deepgemm}"
DEST="${1:-/tmp/deepgemm}"
TARBALL="$BUNDLE/deepgemm-03d0be3_cutlass-eefa171.tar.xz"
log() { echo "[deepgemm_setup] $*" >&2; }

[ -f "$TARBALL" ] || { log "missing $TARBALL (carry .device/deepgemm)"; exit 1; }
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"

# 1. Unpack (once) and patch (idempotent)
if [ ! -f "$DEST/src/deep_gemm/__init__.py" ]; then
    mkdir -p "$DEST/src"
    tar -xJf "$TARBALL" -C "$DEST/src" 2>/dev/null ||  # no xz on the machine: Python's lzma instead
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$TARBALL" "$DEST/src"
    log "unpacked $(basename "$TARBALL") into $DEST/src"
fi
python3 "$HERE/deepgemm/apply_patches.py" "$DEST/src/deep_gemm" >&2

# 2. CUDA_HOME: the toolkit that nvcc really lives in (nvcc may be a wrapper script elsewhere on PATH)
if [ -z "${CUDA_HOME:-}" ] || [ ! -x "${CUDA_HOME}/bin/nvcc" ]; then
    command -v nvcc >/dev/null || { log "no nvcc on PATH and CUDA_HOME unset"; exit 1; }
    here_bin="$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)"
    if [ -n "$here_bin" ] && [ -x "$here_bin/nvcc" ]; then
        CUDA_HOME="$(cd "$here_bin/.." && pwd)"
    else
        CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    fi
fi
log "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p'))"
[ -x "$CUDA_HOME/bin/cuobjdump" ] || command -v cuobjdump >/dev/null || log "WARNING: no cuobjdump (the runtime needs it)"
command -v "${CXX:-g++}" >/dev/null || command -v c++ >/dev/null || log "WARNING: no host C++ compiler for nvcc"

# 3. cuda-bindings (the JIT's driver API): the image's, else the bundled wheel
PP="$DEST/src"
if ! python3 -c "import cuda.bindings.driver" 2>/dev/null; then
    log "cuda.bindings not importable: installing the bundled wheels into $DEST/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$DEST/site" \
        "$BUNDLE"/wheels/*.whl >&2
    PP="$PP:$DEST/site"
fi

# 4. The environment
mkdir -p "$DEST/cache"
ENV_LINES="export CUDA_HOME=$CUDA_HOME
export PYTHONPATH=$PP\${PYTHONPATH:+:\$PYTHONPATH}
export DG_JIT_CACHE_DIR=$DEST/cache
export DG_CACHE_DIR=$DEST/cache"
echo "$ENV_LINES" >"$DEST/env.sh"

# 5. Check the import (no GPU work) in that environment
(
    eval "$ENV_LINES"
    python3 - <<'EOF' >&2
import cuda.bindings, deep_gemm, torch
from deep_gemm.jit.compiler import get_nvcc_compiler
print(f"[deepgemm_setup] import deep_gemm OK ({deep_gemm.__file__}); cuda-bindings {cuda.bindings.__version__}; "
      f"torch {torch.__version__}; JIT nvcc {get_nvcc_compiler()}")
EOF
)
echo "$ENV_LINES"
