"""Triton kernels, one module per op, each paired with a torch reference of the same signature
in ``graft_tk.reference`` (see ``graft_tk.backend``).

Without CUDA the kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set before
``triton.language`` is imported (its own helpers such as ``tl.zeros`` are jitted at import), so
``import graft_tk`` sets it first thing; importing Triton (e.g. through transformers) before
graft_tk on a machine without CUDA leaves the Triton backend unusable, and this warns about it.
"""
import importlib
import os
import sys
import warnings

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton.language" in sys.modules:
        warnings.warn("triton was imported before graft_tk on a machine without CUDA, so Triton's interpreter "
                      "cannot be switched on: backend='triton' will fail here (backend='torch' and 'auto' work). "
                      "Import graft_tk first or set TRITON_INTERPRET=1", RuntimeWarning, stacklevel=2)
    os.environ["TRITON_INTERPRET"] = "1"


def implementation(op: str, backend: str):
    """Op ``op``'s function: its Triton kernel (``backend`` "triton") or its torch reference ("torch")."""
    package = "graft_tk.kernels" if backend == "triton" else "graft_tk.reference"
    return getattr(importlib.import_module(f"{package}.{op}"), op)
