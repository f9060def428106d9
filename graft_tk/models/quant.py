"""Quantized models: weight-only int8 per output channel, int4 per group of 32 (formats in
``graft_tk.reference.quant_matmul``), and ``a8w8``: the int8 weights with every activation row
rounded to int8 as it arrives (its own scale, amax / 127), multiplied in integers (``torch._int_mm``).

``quantize_model(net, "int4")`` replaces every linear layer of a float ``Transformer`` — fused
QKV (with Qwen2's bias), the output projection, fused gate/up, down, and the LM head (untied
from the embedding, which stays a float lookup table) — by a ``QuantLinear``. Activations, norms
and the KV cache keep the compute dtype. A GGUF model is quantized from its own blocks when it is
converted (``graft_tk.models.gguf``), so a 4-bit tensor stays 4-bit: Q4_0 / Q4_1 blocks and
Q4_K's sub-blocks are groups of 32, and ``scale * q + min`` is rebuilt exactly whenever a group
uses both q = 0 and q = 15 (most do; the rest are re-quantized within the group's own range).

Where the matmul runs:
  * CPU: torch's packed kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``; the
    int4 weight is repacked into their layout at load and its scales and zeros into one
    [K / 32, N, 2] tensor); an int8 layer's calls from the width its plan says (``cpu_paths``:
    measured by graft-autotune, else from 64 rows where bf16 is native; int4 past 128) convert the
    weight block by block into a scratch and run float GEMMs;
  * CUDA: the Triton kernel ``graft_tk.kernels.quant_matmul`` (W4A16 / W8A16);
  * anywhere else: the torch reference.

``a8w8`` (CPU): the integer product runs in oneDNN's u8 x s8 kernel on the weight prepacked at
load (``torch.ops.onednn.qlinear_prepack``; the row's int8 values shifted by 128, oneDNN
subtracting 128 x the weight's column sums in int32): 1.3-1.7x faster than ``torch._int_mm`` from
4 rows on, where a verify spends its time. ``onednn_int8_exact`` checks once per process that its
sums are the exact ones (a CPU without VNNI multiplies u8 x s8 pairs into saturating int16);
where not, and where torch has no oneDNN, ``_int_mm`` on the plain weight. A 16-node verify of
the 1.5B Qwen costs 1.6-2.1x a 1-row forward on a 2-core Zen 4 without AMX (2.7x with ``_int_mm``;
docs/benchmarks), against 5.7x for int4 weight-only. Integer sums are exact, so a row's result
never depends on the rows beside it; the activation's rounding to 8 bits does turn any other
row-dependence upstream (attention) into different logits: speculation on an ``a8w8`` target is
token-identical to its plain decoding in exact mode (``exact=True``).
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch import Tensor, nn

from ..errors import InputError
from ..reference import quant_matmul as reference
from . import cpu_paths

# "int4-all": every linear layer int4, those the GGUF stores finer (Q5_x, Q6_K, Q8_0) re-quantized to
# 4 bits too; for a drafter, whose lost bits cost acceptance, never output (verification is exact).
QUANTS = ("none", "int8", "int4", "int4-all", "a8w8")
GROUP = 32                 # int4 group: GGUF's Q4_0 / Q4_1 block and Q4_K sub-block


def cpu_drafter_quant(device: torch.device, dtype: torch.dtype) -> str | None:
    """A drafter's default quantization beside a target on ``device`` in ``dtype``: "int4-all" on
    a CPU in bf16 / fp16, where a forward is bound by reading its weights (about a third of the
    bf16 bytes; lossless, the target decides every token); None elsewhere (the caller's default)."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return "int4-all"
    return None


def check_quant(quant: str | None) -> str:
    """``quant`` checked: "none" (also for None), "int8", "int4", "int4-all" or "a8w8"."""
    quant = quant or "none"
    if quant not in QUANTS:
        raise InputError(f"unknown quantization {quant!r}; use one of {', '.join(QUANTS)}")
    return quant


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [N, K] -> (int8 [N, K], fp32 scales [N]): symmetric per output channel, |q| <= 127."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """float [N, K] -> (uint8 [N, K / 2], fp32 scales, zeros [N, K / group]): per group, the range
    [min, max] in 15 steps, ``W = (q - 8) * scale + zero`` with ``zero = min + 8 * scale``."""
    N, K = w.shape
    if K % group or group % 2:
        raise InputError(f"int4 needs K ({K}) divisible by an even group size ({group})")
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scales, lo + 8 * scales


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous and starting on a 64-byte boundary: torch's int8 CPU kernel crashes from 4
    rows of activations up on a weight that does not (seen with safetensors-loaded tensors, which
    are only 8-byte aligned)."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W int8 or int4 (formats in ``graft_tk.reference.quant_matmul``).

    Built on its device from the canonical tensors (``qweight``, ``scales``, ``zeros`` or None for
    int8) and kept there: on a CPU an int4 weight is held only in the layout of torch's packed
    kernel (when it takes the shape). ``dtype`` is the compute dtype: activations in and out, scales and bias.
    """

    def __init__(self, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bias: Tensor | None,
                 dtype: torch.dtype, group: int = GROUP):
        super().__init__()
        self.mode = "int8" if zeros is None else "int4"
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if self.mode == "int4" else 1)
        self.group = group
        # torch's CPU kernels (int4: N a multiple of 16); else the Triton kernel or the reference
        self.cpu = qweight.device.type == "cpu" and (self.mode == "int8" or self.out_features % 16 == 0)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.paths: tuple[str, ...] | None = None    # per call width on a CPU (cpu_paths.apply)
        self.min_rows = 1                             # calls narrower than this are padded (models.exact)
        self.int8_activations = False                 # a8w8: rows rounded to int8, integer matmul (CPU int8)
        self.packed: Tensor | None = None             # a8w8: the weight in oneDNN's layout (``use_int8_activations``)
        self.handle: int | None = None                # ... and its key in ``_PACKED`` (what forward passes)
        if self.mode == "int8":
            self.register_buffer("qweight", _aligned(qweight.to(torch.int8)))
            self.register_buffer("scales", _aligned(scales.to(dtype)))
            self.register_buffer("zeros", None)
        elif self.cpu:  # torch's CPU int4 kernel: its own packing, scales and zeros as [K / group, N, 2]
            q = reference.unpack_int4(qweight).to(torch.int32)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("scales", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype))
            self.register_buffer("zeros", None)
        else:
            self.register_buffer("qweight", qweight.contiguous())
            self.register_buffer("scales", scales.to(dtype).contiguous())
            self.register_buffer("zeros", zeros.to(dtype).contiguous())

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None, mode: str, dtype: torch.dtype) -> "QuantLinear":
        """Quantize a float weight [N, K] (int4 falls back to int8 when K is not a multiple of 32)."""
        if mode in ("int4", "int4-all") and weight.shape[1] % GROUP == 0:
            return cls(*quantize_int4(weight), bias, dtype)
        return cls(*quantize_int8(weight), None, bias, dtype)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows < self.min_rows:
            x2 = cpu_paths.pad_rows(x2, self.min_rows)
        if self.int8_activations:
            y = int8_matmul(x2, self.qweight, self.scales, self.handle)
            if self.bias is not None:
                y = y + self.bias
        elif self.cpu:
            x2 = x2.contiguous()
            blocks = cpu_paths.pick(self.paths, x2.shape[0]) == "blocks"
            if blocks and self.mode == "int8":
                y = cpu_paths.blocks(x2, self.qweight, self.scales)
            elif blocks:
                y = cpu_paths.int4_blocks(x2, self.qweight, self.scales, self.group)
            elif self.mode == "int8":
                y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales)
            if self.bias is not None:
                y = y + self.bias
        else:
            if x2.device.type == "cuda":
                from ..kernels.quant_matmul import quant_matmul
            else:
                quant_matmul = reference.quant_matmul
            y = quant_matmul(x2, self.qweight, self.scales, self.zeros, self.group, self.bias)
        return y[:rows].reshape(*lead, self.out_features)

    def dequantized(self) -> Tensor:
        """The float weight [N, K] this layer multiplies by (for tools that need it, e.g. EAGLE-3 training)."""
        if self.packed is not None:
            return reference.dequantize(self._unpacked(), self.scales, None, self.group).to(self.scales.dtype)
        if self.cpu and self.mode == "int4":   # read back through the kernel: I @ W^T = W^T
            eye = torch.eye(self.in_features, dtype=self.scales.dtype, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group, self.scales).T.contiguous()
        return reference.dequantize(self.qweight, self.scales, self.zeros, self.group).to(self.scales.dtype)

    @property
    def format(self) -> str:
        """"int8", "int4" or "a8w8" (int8 weights, int8 activations)."""
        return "a8w8" if self.int8_activations else self.mode

    def use_int8_activations(self) -> None:
        """Make this int8 layer (on a CPU) ``a8w8``: each row rounded to int8 as it arrives, the
        product in integers; the weight moves into oneDNN's prepacked layout where its sums are
        checked exact (``onednn_int8_exact``), held there only."""
        if not (self.mode == "int8" and self.cpu):
            raise InputError(f"a8w8 needs an int8 layer on a CPU, not {self.extra_repr()}")
        self.int8_activations = True
        if self.packed is None and onednn_int8_exact():
            self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)
            self.handle = next(_HANDLES)
            _PACKED[self.handle] = self.packed
            self.qweight = None

    def _unpacked(self) -> Tensor:
        """The int8 weight [N, K] read back from oneDNN's prepacked layout (which holds W^T)."""
        return _aligned(self.packed.to_dense().T)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}, bias={self.bias is not None}"


def int8_matmul(x: Tensor, qweight: Tensor | None, scales: Tensor, handle: int | None = None) -> Tensor:
    """``x [M, K] @ W^T`` for int8 weights with per-channel ``scales [N]``, each row of x rounded
    to int8 with its own scale (amax / 127) and multiplied in int32 sums: ``fp32(sums) * sx *
    scales``. The weight: oneDNN's prepacked layout registered under ``handle``
    (``QuantLinear.use_int8_activations``) where given, else ``qweight`` [N, K] (``torch._int_mm``):
    the same integer sums."""
    xf = x.float()
    sx = xf.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(xf / sx)
    if handle is not None:
        sums = onednn_int8_sums(q.add_(128).to(torch.uint8), handle)
    else:
        sums = torch._int_mm(q.to(torch.int8), qweight.t()).float()
    return (sums * sx * scales.float()).to(x.dtype)


# oneDNN's prepacked weights by handle. A compiled graph cannot hold the opaque prepacked tensor
# (dynamo cannot fake it), so forward passes the layer's handle, a constant to the graph, to an op
# inductor calls as it is: the rest of the layer (rounding, scaling) compiles around it.
_PACKED: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("graft_tk::onednn_int8_sums", mutates_args=())
def onednn_int8_sums(q: Tensor, handle: int) -> Tensor:
    """``_onednn_sums`` with the weight registered under ``handle``."""
    return _onednn_sums(q, _PACKED[handle])


@onednn_int8_sums.register_fake
def _(q: Tensor, handle: int) -> Tensor:
    return q.new_empty(q.shape[0], _PACKED[handle].shape[1], dtype=torch.float32)


def _onednn_sums(q: Tensor, packed: Tensor) -> Tensor:
    """fp32 of the int32 sums ``(q - 128) @ W^T`` for ``q`` uint8 [M, K] and the prepacked W
    (scales 1: oneDNN's fp32 of its int32 sum, as ``_int_mm(...).float()``)."""
    n = packed.shape[1]
    ones, zeros = _unit_scales(n)
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> tuple[Tensor, Tensor]:
    return torch.ones(n), torch.zeros(n, dtype=torch.long)


@functools.lru_cache(maxsize=1)
def onednn_int8_exact() -> bool:
    """Whether oneDNN's u8 x s8 kernel (prepacked) gives ``torch._int_mm``'s exact sums on this CPU:
    the largest products (255 x 127, which saturate where pairs are summed in int16 without
    VNNI), sums past 2^24 and random values, at 1 and 16 rows."""
    try:
        gen = torch.Generator().manual_seed(0)
        k, n = 2048, 64
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w[:8] = 127
        q = torch.randint(-127, 128, (16, k), generator=gen, dtype=torch.int8)
        q[:4] = 127
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        for rows in (q[:1], q):
            got = _onednn_sums((rows.to(torch.int16) + 128).to(torch.uint8), packed)
            if not torch.equal(got, torch._int_mm(rows, w.t()).float()):
                return False
        return True
    except (RuntimeError, AttributeError, NotImplementedError):    # no oneDNN int8 in this torch
        return False


def use_int8_activations(net: nn.Module) -> nn.Module:
    """Make every int8 QuantLinear of ``net`` on a CPU an ``a8w8`` layer (in place); returns ``net``.
    Raises InputError where a linear layer is not int8."""
    for name, m in net.named_modules():
        if isinstance(m, nn.Linear) or (isinstance(m, QuantLinear) and not (m.mode == "int8" and m.cpu)):
            raise InputError(f"a8w8 needs every linear layer int8 on a CPU; {name or 'the model'} is "
                             f"{m.extra_repr() if isinstance(m, QuantLinear) else 'float'}")
        if isinstance(m, QuantLinear):
            m.use_int8_activations()
    return net


def linear_names(net: nn.Module) -> list[str]:
    """The linear layers a quantization replaces, by module name (the LM head as ``output``)."""
    return [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]


def quantize_model(net: nn.Module, quant: str, formats: dict[str, str] | None = None) -> nn.Module:
    """Replace every linear layer of a float Transformer (in place) by a QuantLinear of ``quant``
    ("int8" / "int4"; "int4-all" is int4 here; ``formats`` may give a layer its own), the LM head
    included: a tied head becomes its own quantized ``output`` and the embedding stays float.
    Returns ``net``."""
    quant = check_quant(quant)
    if quant == "none":
        return net
    dtype = net.tok_embeddings.weight.dtype
    if net.output is None:
        net.output = QuantLinear.from_float(net.tok_embeddings.weight, None, (formats or {}).get("output", quant), dtype)
    for name in linear_names(net):
        parent, _, attr = name.rpartition(".")
        holder = net.get_submodule(parent) if parent else net
        m = getattr(holder, attr)
        setattr(holder, attr, QuantLinear.from_float(m.weight, m.bias, (formats or {}).get(name, quant), dtype))
    return net

