"""Small, documented patches to DeepGEMM 03d0be3 (deep_gemm/jit/*.py only; no kernel header is touched), applied by
benchmarks/deepgemm_setup.sh after unpacking. Idempotent: a file already patched is left alone.

1. CUDA_HOME fallback (jit/compiler.py, jit/runtime.py): torch's ``cpp_extension.CUDA_HOME`` is None on a CPU-only
   torch, which made ``get_nvcc_compiler`` crash before it read ``DG_JIT_NVCC_COMPILER``. Fall back to the
   ``CUDA_HOME`` environment variable. On a CUDA torch this changes nothing (torch itself reads that variable first).
2. Kernel-name lookup (jit/runtime.py): the runtime lists the cubin's symbols with ``cuobjdump -symbols`` and keeps
   lines starting ``STT_FUNC``. That is what cuobjdump 13.0/13.1 print; 13.5 prints ``FUNC  GLOBAL  DEFAULT  ENTRY``
   instead, and CUDA 12.9+ can list device functions as STT_FUNC too. Keep only entry points (``STO_ENTRY`` or
   ``ENTRY``) in either format, and find cuobjdump on PATH when ``$CUDA_HOME/bin`` has none.

Usage: python3 apply_patches.py PATH/TO/deep_gemm
"""

import os
import sys

FALLBACK = "from torch.utils.cpp_extension import CUDA_HOME\n"
FALLBACK_NEW = (
    "from torch.utils.cpp_extension import CUDA_HOME\n"
    "CUDA_HOME = CUDA_HOME or os.environ.get('CUDA_HOME')  # fuse-shared patch 1: CPU-only torch has no CUDA_HOME\n"
)

OBJDUMP_OLD = """            command = [f'{CUDA_HOME}/bin/cuobjdump', '-symbols', path]
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert result.returncode == 0
            illegal_names = ['vprintf', '__instantiate_kernel', '__internal', '__assertfail']
            check_illegal = lambda line: any([name in line for name in illegal_names])
            kernel_names = [line.split()[-1] for line in result.stdout.splitlines()
                            if line.startswith('STT_FUNC') and not check_illegal(line)]
"""
OBJDUMP_NEW = """            # fuse-shared patch 2: both cuobjdump symbol formats, entry points only, cuobjdump from PATH too
            cuobjdump = f'{CUDA_HOME}/bin/cuobjdump'
            if not os.path.exists(cuobjdump):
                import shutil
                cuobjdump = shutil.which('cuobjdump') or cuobjdump
            command = [cuobjdump, '-symbols', path]
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert result.returncode == 0, f'cuobjdump failed: {result.stderr}'
            illegal_names = ['vprintf', '__instantiate_kernel', '__internal', '__assertfail']
            check_illegal = lambda line: any([name in line for name in illegal_names])
            is_entry = lambda w: len(w) > 1 and (w[0] == 'STT_FUNC' and 'STO_ENTRY' in w or w[0] == 'FUNC' and 'ENTRY' in w)
            kernel_names = [line.split()[-1] for line in result.stdout.splitlines()
                            if is_entry(line.split()) and not check_illegal(line)]
"""

EDITS = {
    "jit/compiler.py": [(FALLBACK, FALLBACK_NEW)],
    "jit/runtime.py": [(FALLBACK, FALLBACK_NEW), (OBJDUMP_OLD, OBJDUMP_NEW)],
    "jit/interleave_ffma.py": [(FALLBACK, FALLBACK_NEW)],
}


def main(pkg: str) -> None:
    for rel, edits in EDITS.items():
        path = os.path.join(pkg, rel)
        with open(path) as f:
            src = f.read()
        if "fuse-shared patch" in src:
            print(f"already patched: {rel}")
            continue
        for old, new in edits:
            assert src.count(old) == 1, f"{rel}: expected text not found once; is this DeepGEMM 03d0be3?"
            src = src.replace(old, new)
        with open(path, "w") as f:
            f.write(src)
        print(f"patched: {rel}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "deep_gemm")
