"""One decoder-only transformer for the Llama, Qwen2 and Qwen3 families (gpt-fast style).

Differences between the families are three switches on ``ModelConfig``:
  llama  — plain RMSNorm/SwiGLU/RoPE decoder (SmolLM2, Llama 3)
  qwen2  — + bias on q/k/v projections
  qwen3  — + RMSNorm on each head of q and k before RoPE (no bias)

The KV cache is static and lives in ONE tensor ``kv[L, 2, B, Hkv, S, Dh]`` so that committing an
accepted tree path moves every layer's K and V with a single indexed copy; new K/V are written by
index, and the RoPE tables for its S positions are built with it (``new_cache``).

Every forward takes an ``AttentionPlan`` (``graft_tk.models.attention``): per batch row, the
cache slots its new tokens' K/V go to, the cached prefix they all see (a device tensor: rows of a
batch have their own lengths) and the masked block after it (a tree's ancestor mask, a drafter
frontier's ancestry, or causal). Positions are explicit: a tree node's RoPE position is
``prefix_len + depth``, not its slot.

Attention is the tree-attention op the caller passes as ``attention=`` — ``ops.tree_attention``
of the step's backend: the torch reference (``graft_tk.reference.tree_attention``, the default:
a GQA group's heads share one matmul per kv head, no K/V copies) or the Triton kernel
(``graft_tk.kernels.tree_attention``: flash-style, each row's prefix keys read without a mask).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..reference.tree_attention import tree_attention as reference_attention
from . import cpu_paths
from .attention import AttentionPlan

ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # llama3-style frequency scaling as sorted (key, value) pairs; None for plain RoPE.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} is not one of {ARCHS}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference checkpoints were
        # trained; in bf16 doing the multiply in fp32 instead changes greedy outputs.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2], with llama3 long-context scaling if configured."""
    # fp32 as the checkpoints' reference code computes it: with theta = 5e5 an fp64 table drifts
    # from it by 4e-3 in the logits within 40 positions.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    if cfg.rope_scaling is None:
        return inv_freq
    s = dict(cfg.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> (cos, sin) [B, 1, T, Dh] for ``apply_rope``."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, Dh/2]
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, H, T, Dh]; cos/sin: [B, 1, T, Dh] (frequencies repeated over both halves).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class RopeTable:
    """cos / sin [S, Dh] of positions 0 .. S - 1, built once with the cache they serve."""
    cos: Tensor
    sin: Tensor

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] (each < S) -> (cos, sin) [B, 1, T, Dh], as ``rope_tables`` computes them."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def new_cache(n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
              weight: Tensor, inv_freq: Tensor) -> tuple[Tensor, RopeTable]:
    """A static KV cache ``[n_layers, 2, B, Hkv, S, Dh]`` and the RoPE table for its S positions.

    The cache holds the weights' dtype on a GPU and float32 on a CPU: a CPU without AVX-512 BF16
    multiplies bf16 matrices several times slower than fp32 ones, and a bf16 K or V value is
    stored exactly in fp32, so attention sees the same numbers (it accumulates in fp32 either way).
    A token's RoPE position never exceeds its cache slot, so S positions cover every forward.
    """
    dtype = torch.float32 if weight.device.type == "cpu" else weight.dtype
    # Normal tensors even when called under inference_mode: an inference tensor could not be
    # written in place (or saved for backward) later by a caller outside inference_mode.
    with torch.inference_mode(False):
        kv = torch.zeros(n_layers, 2, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=dtype, device=weight.device)
        cos, sin = rope_tables(torch.arange(max_seq_len, device=weight.device)[None], inv_freq, weight.dtype)
    return kv, RopeTable(cos[0, 0], sin[0, 0])


CACHE_SLOTS_MULTIPLE = 512


def ensure_cache(module: nn.Module, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int,
                 head_dim: int, weight: Tensor) -> None:
    """Give ``module`` (its ``kv``, ``rope`` and ``inv_freq``) a cache of at least ``max_seq_len``
    slots for this batch size; an existing one that is large enough is kept. A new one gets a
    multiple of 512 slots: the cache's size is a shape of the compiled forwards, so requests of
    similar length share one graph instead of each compiling its own."""
    kv = module.kv
    if kv is not None and kv.shape[2] == batch_size and kv.shape[4] >= max_seq_len:
        return
    slots = -(-max_seq_len // CACHE_SLOTS_MULTIPLE) * CACHE_SLOTS_MULTIPLE
    module.kv, module.rope = new_cache(n_layers, batch_size, n_kv_heads, slots, head_dim, weight, module.inv_freq)
    if kv is not None and kv.shape[2] == batch_size:   # grown: what it held is kept (a batch's rows in flight)
        module.kv[:, :, :, :, :kv.shape[4]] = kv


@dataclass(frozen=True, eq=False)
class Part:
    """One group of batch rows in a packed forward (``Transformer.forward_packed``): its new
    tokens, their positions and plan, the cache rows they attend over and write (``rows``
    [start, stop) of the cache the forward is given), and what to return of them, as
    ``Transformer.forward``'s arguments of the same names. A decode step's verify (B rows of N
    nodes) and a prompt's next chunk (one row of C tokens) are two parts of ONE forward: their
    linear layers read each weight once for both."""
    tokens: Tensor                  # [b, t]
    positions: Tensor               # [b, t]
    plan: AttentionPlan
    rows: tuple[int, int]
    logits_at: int | Tensor | None = None
    hidden_layers: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class _Packed:
    part: Part
    cos: Tensor
    sin: Tensor


class Linear(nn.Linear):
    """``nn.Linear`` that on a CPU multiplies the way its plan says for each call width
    (``cpu_paths``: measured by graft-autotune; None, the default, is plain ``F.linear``)."""
    paths: tuple[str, ...] | None = None
    min_rows: int = 1          # calls narrower than this are padded (exact mode: models.exact)

    def forward(self, x: Tensor) -> Tensor:
        return cpu_paths.linear(x, self.weight, self.bias, self.paths, self.min_rows)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one weight read instead of three per token (a decode step on
        # CPU is memory-bound).
        self.wqkv = Linear(cfg.dim, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(q_size, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, qkv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, in] -> q [B, H, T, Dh], k, v [B, Hkv, T, Dh], RoPE applied (``qkv``: ``wqkv(x)``)."""
        B, T, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = (self.wqkv(x) if qkv is None else qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, layer: int, plan: AttentionPlan,
                attention: Callable) -> Tensor:
        # x: [B, T, dim]; kv: the whole cache [L, 2, B, Hkv, S, Dh]; the plan's slots [B, T]: where the new K/V go
        return self.wo(self.attend(x, cos, sin, kv, layer, plan, attention))

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, layer: int, plan: AttentionPlan,
               attention: Callable, qkv: Tensor | None = None) -> Tensor:
        """The attention's output before ``wo``: [B, T, H * Dh]. ``qkv``: ``wqkv(x)`` already
        computed (a packed forward projects all its parts in one GEMM)."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin, qkv)
        write_kv(kv, layer, plan.slots, k, v)
        out = attention(q.to(kv.dtype), kv[layer, 0], kv[layer, 1], plan.prefix, plan.block, plan.keys,
                        validate=layer == 0).to(x.dtype)
        return out.transpose(1, 2).reshape(B, T, -1)

    def forward_packed(self, x: Tensor, parts: Sequence[_Packed], kv: Tensor, layer: int,
                       attention: Callable) -> Tensor:
        """x [n, dim]: the rows of every part, in order; each part attends over its own cache rows
        and plan, the projections run once over all of them."""
        qkv, outs, at = self.wqkv(x), [], 0
        for p in parts:
            b, t = p.part.tokens.shape
            rows = slice(at, at + b * t)
            outs.append(self.attend(x[rows].view(b, t, -1), p.cos, p.sin, kv[:, :, p.part.rows[0]:p.part.rows[1]],
                                    layer, p.part.plan, attention, qkv[rows].view(b, t, -1)).view(b * t, -1))
            at += b * t
        return self.wo(torch.cat(outs))


def write_kv(kv: Tensor, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """kv[layer, 0 / 1, b, :, slots[b]] = k / v ([B, Hkv, T, Dh]) for every row b: one indexed
    write into the cache (``slots`` [B, T], each row its own).

    Indexed on the whole cache, not on a per-layer view: a compiled forward (torch.compile) then
    writes the T new slots in place, where a write through a view of a graph input makes inductor
    copy the entire cache in every layer.
    """
    device = kv.device
    rows = torch.arange(k.shape[0], device=device)[None, :, None]      # index tensors broadcast to [2, B, T]
    at_layer = torch.full((1, 1, 1), layer, dtype=torch.long, device=device)
    new = torch.stack([k, v]).to(kv.dtype).transpose(2, 3)               # [2, B, T, Hkv, Dh]
    kv[at_layer, torch.arange(2, device=device)[:, None, None], rows, :, slots[None]] = new


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.w13 = Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, kv, layer, plan, attention):
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, layer, plan, attention)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_packed(self, x, parts, kv, layer, attention):
        x = x + self.attention.forward_packed(self.attention_norm(x), parts, kv, layer, attention)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.output = None if cfg.tie_word_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.kv: Tensor | None = None  # [L, 2, B, Hkv, S, Dh], see setup_cache
        self.rope: RopeTable | None = None
        self.head_paths: tuple[str, ...] | None = None   # a tied head's CPU plan (cpu_paths.apply)
        self.head_min_rows = 1                            # and its padded width (models.exact)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def lm_head_weight(self) -> Tensor:
        """The LM head's float weight [V, dim] (dequantized when the head is quantized)."""
        if self.output is None:
            return self.tok_embeddings.weight
        return self.output.dequantized() if hasattr(self.output, "dequantized") else self.output.weight

    @property
    def compute_weight(self) -> Tensor:
        """A weight in the compute dtype on the model's device (the embedding: never quantized)."""
        return self.tok_embeddings.weight

    @property
    def cache_len(self) -> int:
        return 0 if self.kv is None else self.kv.shape[4]

    @contextmanager
    def cache_rows(self, start: int, stop: int):
        """Forwards inside see only batch rows [start, stop) of the cache: a view, so what they
        write lands in those rows (``graft_tk.batch`` prefills and drafts one request's row)."""
        full = self.kv
        self.kv = view = full[:, :, start:stop]
        try:
            yield view
        finally:
            replaced = self.kv is not view
            self.kv = full
            if replaced:
                raise RuntimeError("the KV cache was reallocated inside cache_rows; size it before (setup_cache)")

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Allocate the static KV cache and RoPE tables; kept when already large enough for this batch."""
        c = self.config
        ensure_cache(self, c.n_layers, batch_size, c.n_kv_heads, max_seq_len, c.head_dim, self.compute_weight)

    def forward(self, tokens: Tensor, positions: Tensor, plan: AttentionPlan | int, logits_at: int | Tensor | None = None,
                hidden_layers: tuple[int, ...] | None = None, attention: Callable | None = None,
                kv: Tensor | None = None, rope: RopeTable | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run new tokens against the cache and return logits (fp32).

        tokens:      [B, T] int64 token ids
        positions:   [B, T] or [T] int64 RoPE positions (prefix_len + depth for tree nodes)
        plan:        where the new K/V go and what each token sees (``AttentionPlan``); an int
                     ``start`` is the causal plan at slots start .. start + T - 1 (a prefill)
        logits_at:   the one position per row whose logits to return ([B, 1, V]): an int (-1:
                     the last, e.g. after a prefill) or [B] (each row its own: left-aligned rows
                     of different lengths); None: every position
        hidden_layers: also return the residual stream after these decoder layers (0-based, in
                     this order), i.e. the target features an EAGLE-3 head fuses; the output of
                     layer i before the final norm (HF's ``output_hidden_states[i + 1]``, except
                     for the last layer, where HF's entry is after the norm).
        returns      [B, T, V] float32, or with hidden_layers (logits, hidden), hidden
                     [B, T, len(hidden_layers) * dim] in the model's dtype, every token even with
                     logits_at (a drafter reads the whole prompt's features after prefill)
        attention:   the tree attention to run (``ops.tree_attention``); None = the torch reference
        kv, rope:    the cache and its RoPE table (None: ``self.kv``, ``self.rope``); a compiled
                     forward is passed them, so they are graph inputs, never constants of a frozen
                     graph (which would recompile for every new cache, or a view of one)
        """
        B, T = tokens.shape
        kv = self.kv if kv is None else kv
        if kv is None:
            raise RuntimeError("the model has no KV cache; call setup_cache first")
        cache_len = kv.shape[4]
        if isinstance(plan, int):
            if plan + T > cache_len:
                raise RuntimeError(f"KV cache holds {cache_len} slots; call setup_cache(>= {plan + T})")
            plan = AttentionPlan.causal(plan, B, T, tokens.device)
        plan.check(B, T, cache_len)
        if positions.dim() == 1:
            positions = positions[None].expand(B, -1)
        self._check_hidden_layers(hidden_layers)
        attention = attention or reference_attention
        x = self.tok_embeddings(tokens)
        cos, sin = (self.rope if rope is None else rope).at(positions)
        taken: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv, i, plan, attention)
            if hidden_layers is not None and i in hidden_layers:
                taken[i] = x
        logits = self.logits(select_positions(x, logits_at))
        if hidden_layers is None:
            return logits
        return logits, torch.cat([taken[i] for i in hidden_layers], dim=-1)

    def _check_hidden_layers(self, hidden_layers: tuple[int, ...] | None) -> None:
        if hidden_layers is not None and not (hidden_layers and all(0 <= i < len(self.layers) for i in hidden_layers)):
            raise InputError(f"hidden_layers must be layer indices in [0, {len(self.layers)}), got {hidden_layers}")

    def forward_packed(self, parts: Sequence[Part], attention: Callable | None = None
                       ) -> list[Tensor | tuple[Tensor, Tensor]]:
        """Several parts' new tokens in ONE forward: what ``forward`` returns for each, in order
        (its ``logits_at`` and ``hidden_layers``). The parts' rows are stacked for every linear
        layer (each weight read once: on a CPU a decode step's weight read is most of its cost,
        and a prompt chunk's GEMM takes a few more rows nearly free) and each part attends over
        its own cache rows with its own plan, in order: a later part of the same row sees what
        an earlier one wrote. Eager only (a step carrying a chunk, a shape no graph is kept for)."""
        kv = self.kv
        if kv is None:
            raise RuntimeError("the model has no KV cache; call setup_cache first")
        packed = []
        for p in parts:
            b, t = p.tokens.shape
            start, stop = p.rows
            if not 0 <= start < stop <= kv.shape[2] or stop - start != b:
                raise InputError(f"a part of {b} rows reads cache rows {p.rows}; the cache has {kv.shape[2]}")
            p.plan.check(b, t, kv.shape[4])
            self._check_hidden_layers(p.hidden_layers)
            packed.append(_Packed(p, *self.rope.at(p.positions)))
        x = self.tok_embeddings(torch.cat([p.tokens.reshape(-1) for p in parts]))
        taken: dict[int, Tensor] = {}
        wanted = {i for p in parts for i in p.hidden_layers or ()}
        for i, layer in enumerate(self.layers):
            x = layer.forward_packed(x, packed, kv, i, attention or reference_attention)
            if i in wanted:
                taken[i] = x
        # every part's selected positions through the LM head at once (its weight read once too)
        selected, hidden, at = [], [], 0
        for p in parts:
            b, t = p.tokens.shape
            rows = slice(at, at + b * t)
            selected.append(select_positions(x[rows].view(b, t, -1), p.logits_at))
            hidden.append(None if p.hidden_layers is None else
                          torch.cat([taken[i][rows].view(b, t, -1) for i in p.hidden_layers], dim=-1))
            at += b * t
        logits = self.logits(torch.cat([s.reshape(-1, s.shape[-1]) for s in selected]))
        out, at = [], 0
        for p, s, h in zip(parts, selected, hidden):
            n = s.shape[0] * s.shape[1]
            part_logits = logits[at:at + n].view(s.shape[0], s.shape[1], -1)
            out.append(part_logits if h is None else (part_logits, h))
            at += n
        return out

    def logits(self, x: Tensor) -> Tensor:
        """The LM head over the last layer's residual stream x [..., dim]: fp32 logits [..., V]."""
        h = self.norm(x)
        if self.output is None:
            return cpu_paths.linear(h, self.tok_embeddings.weight, None, self.head_paths,
                                    self.head_min_rows).float()
        return self.output(h).float()


def select_positions(x: Tensor, at: int | Tensor | None) -> Tensor:
    """x [B, T, ...] -> x [B, 1, ...] at position ``at`` of every row (an int, or [B]); None: all."""
    if at is None:
        return x
    if isinstance(at, int):
        return x[:, at:at + 1] if at != -1 else x[:, -1:]
    return x[torch.arange(x.shape[0], device=x.device), at][:, None]
