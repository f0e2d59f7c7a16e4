import os

# Must be set before anything imports triton: on a machine without CUDA the Triton
# kernels run in the interpreter (numpy, on CPU tensors).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except Exception:
    os.environ.setdefault("TRITON_INTERPRET", "1")
