"""Shared kernel plumbing: every launch is counted by the step that runs it (``graft_tk.counters``)."""
from __future__ import annotations

from ..backend import interpreted  # noqa: F401  (the kernels' modules take it from here)
from ..counters import count_launch


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, counted in the active ``StepCounters``."""
    count_launch(getattr(kernel, "__name__", None) or kernel.fn.__name__)
    return kernel[grid](*args, **kwargs)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


_SMS: dict = {}
_UNUSED: dict = {}


def unused(device, dtype):
    """A one-element tensor (cached per device and dtype) for a pointer argument the kernel's
    constexprs never read: no allocation and no fill kernel per launch (a CUDA graph can capture it)."""
    import torch
    key = (str(device), dtype)
    if key not in _UNUSED:
        _UNUSED[key] = torch.zeros(1, dtype=dtype, device=device)
    return _UNUSED[key]


def multiprocessors(device) -> int:
    """SMs of a CUDA device (cached): how many programs a launch needs to fill it; 0 on a CPU or
    under the interpreter (launchers then keep their one-program-per-row forms)."""
    if interpreted() or device.type != "cuda":
        return 0
    import torch
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
