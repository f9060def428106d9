"""Triton kernels, one module per op, each paired with a torch reference of the same signature
in ``graft_tk.reference`` (see ``graft_tk.backend``).

Without CUDA the kernels run in Triton's interpreter: ``TRITON_INTERPRET`` must be set before any
``@triton.jit`` function is defined, so it is set here, before the kernel modules are imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
