"""Weight-only quantized matmul in torch: ``x @ dequantize(W).T + bias``, the reference of
``graft_tk.kernels.quant_matmul``.

Two weight formats (``graft_tk.models.quant`` makes them), both per output row n of W [N, K]:

* **int8**, per output channel: ``qweight`` int8 [N, K], ``scales`` [N];
  ``W[n, k] = qweight[n, k] * scales[n]``.
* **int4**, per group of ``group`` consecutive k (32 here: the sub-block of GGUF's Q4_K and the
  block of Q4_0 / Q4_1): ``qweight`` uint8 [N, K / 2], two 4-bit values q in [0, 15] per byte,
  k even in the low nibble and k odd in the high one; ``scales`` and ``zeros`` [N, K / group];
  ``W[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g]`` with ``g = k // group`` (torch's
  int4 convention: a GGUF block ``d * q + m`` is ``scales = d``, ``zeros = 8 d + m``).

Worked example, int4, group 2, one row ``W = [0.5, 1.0, -1.0, -0.5]``: group 0 spans [0.5, 1.0],
scale (1.0 - 0.5) / 15, q = [0, 15]; packed bytes ``0xF0`` (q0 = 0 low, q1 = 15 high), then group 1.

Scales and zeros are kept in the compute dtype; the product accumulates in fp32 and returns x's dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor


def unpack_int4(qweight: Tensor) -> Tensor:
    """uint8 [N, K / 2] -> int values q in [0, 15], int16 [N, K] (k even from the low nibble)."""
    low = (qweight & 0x0F).to(torch.int16)
    high = (qweight >> 4).to(torch.int16)
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(qweight: Tensor, scales: Tensor, zeros: Tensor | None, group: int) -> Tensor:
    """The fp32 weight [N, K] of an int8 (``zeros`` None) or int4 weight."""
    if zeros is None:
        return qweight.float() * scales.float()[:, None]
    q = unpack_int4(qweight).float()
    return (q - 8) * scales.float().repeat_interleave(group, 1) + zeros.float().repeat_interleave(group, 1)


def quant_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, group: int,
                 bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for a weight-only quantized W.

    Parameters
    ----------
    x : Tensor, float [M, K]
        Activations (fp32, fp16 or bf16).
    qweight, scales, zeros, group
        The weight in one of the two formats above (``zeros`` None: int8).
    bias : Tensor, float [N] or None

    Returns
    -------
    Tensor, x's dtype [M, N], accumulated in fp32.
    """
    out = x.float() @ dequantize(qweight, scales, zeros, group).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
