"""Row-invariant forwards: every row of a forward computes bitwise what it computes alone.

Why: a verify forward of N tree nodes must give each node the logits that plain decoding's 1-row
forward gives at the same position, or greedy output and seeded sampling drift with the tree and
the batch wherever the top two logits are closer than the rounding (often, in bf16). torch's CPU
GEMMs choose their blocking, and so their order of summation, by the shape of the call, and
attention sums a row's keys in an order that depends on where they sit in the cache. So exact mode
makes every reduction a function of the row alone:

  * **linear layers**: a GEMM's rows agree with each other from some number of rows on (each
    CPU's library picks one kernel family for all wider calls). ``probe_min_rows`` measures that
    width per layer shape on this CPU, and ``Linear`` pads a narrower call (a 1-token decode) to
    it. A shape whose rows never agree is an error, never a silent fallback.
  * **attention** (``attention``, the ``tree_attention`` op of exact mode): a query's keys are
    taken in *logical* order (the cached prefix, then its visible block keys in slot order, which
    for a tree are its ancestors by depth), so a tree node at position p and plain decoding's query
    at p see the same sequence whatever slots hold it. Every sum then runs in a shape fixed by the
    query alone: keys in blocks of ``BLOCK`` at fixed logical offsets (a block below the row's
    cached prefix is read in place, the last ones gathered per query), one GEMM shape for a block's
    scores and one for its values and softmax sum (a column of ones beside the values), and the
    blocks summed pairwise in a tree over a power of two, which blocks past the query's own add
    exact zeros to.
  * norms, RoPE, activations and residuals are per row already (checked by the tests).
  * prompts: every prompt is read in the same forwards (cut at multiples of ``PREFILL_GRID``
    tokens, however a server schedules its chunks), so the prompt's keys and values are the same
    bits whatever method or batch decodes after it; a prompt chunk keeps torch's fused attention.

The cost: a 1-row forward padded to the probed width, and attention in blocks (measured in
docs/benchmarks). Off by default; ``exact=True`` / ``--exact``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..reference.tree_attention import check_tree_attention_args
from ..reference.tree_attention import tree_attention as reference_attention

BLOCK = 128         # keys per block of a query's logical sequence (a GEMM's fixed reduction)
PREFILL_GRID = 256  # exact mode cuts every prompt into forwards at multiples of this many tokens


def attention(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None, keys: int,
              scale: float | None = None, validate: bool = True, min_rows: int = 1) -> Tensor:
    """``reference.tree_attention``'s contract (same arguments and result), with each query's
    output a function of that query and its logical key sequence alone (see the module).

    ``min_rows``: the GEMM rows from which this CPU's blocked matmuls agree row by row
    (``probe_min_rows``); narrower calls are padded to it.
    """
    if validate:
        check_tree_attention_args(q, k, v, prefix, block, keys)
    B, Hq, T, D = q.shape
    if block is None and T > 1:
        # A prompt chunk: exact mode cuts every prompt into the same forwards (PREFILL_GRID), so
        # its keys and values are the same bits whatever decodes it; torch's fused kernel reads it.
        return reference_attention(q, k, v, prefix, block, keys, scale, validate=False)
    Hkv = k.shape[1]
    G, R = Hq // Hkv, T * Hq // Hkv                              # query heads per kv head; GEMM rows (t, g)
    L = T if block is None else block.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dev = q.device
    nb = -(-keys // BLOCK)
    nk = nb * BLOCK
    if nk > k.shape[2]:
        raise ValueError(f"exact attention reads whole blocks of {BLOCK} keys: the cache holds {k.shape[2]} "
                         f"slots, fewer than {nk}")

    # ---- each query's logical sequence: idx[b, t, l] = the slot of its l-th key
    if block is None:                                            # one decoded token: its row's slots in order
        seen = (prefix[:, None] + torch.arange(1, T + 1, device=dev))[:, :, None]       # [B, T, 1]
        idx = torch.arange(nk, device=dev).expand(B, T, nk)
    else:
        seen = (prefix[:, None] + block.sum(-1))[:, :, None]
        to = torch.where(block, prefix[:, None, None] + block.cumsum(-1) - 1, nk)         # a visible key's rank
        idx = torch.arange(nk + 1, device=dev).expand(B, T, nk + 1).clone()
        idx.scatter_(2, to, (prefix[:, None, None] + torch.arange(L, device=dev)).expand(B, T, L))   # spare: invisible
        idx = idx[:, :, :nk]

    # ---- every cached key's score in place, one [rows, D] x [D, BLOCK] GEMM per block of slots
    rows = (q.float() * scale).view(B, Hkv, G, T, D).transpose(2, 3).reshape(B, Hkv, 1, R, D)
    kf = k[:, :, :nk].float().view(B, Hkv, nb, BLOCK, D)
    s = _rows_matmul(rows.expand(B, Hkv, nb, R, D), kf.transpose(-1, -2), min_rows)      # [B, Hkv, nb, R, BLOCK]

    # ---- the blocks from base = prefix // BLOCK on, in logical order: keys gathered per query.
    # Blocks below base hold every query's keys in logical order already (its cached prefix).
    base = prefix // BLOCK                                       # [B]
    first, last = int(base.min()), int(base.max())               # host reads: exact mode runs on CPUs
    nt = int((prefix % BLOCK).max() + L - 1) // BLOCK + 1        # logical blocks from base to the last key
    logical = (base * BLOCK)[:, None] + torch.arange(nt * BLOCK, device=dev)              # [B, nt * BLOCK]
    valid = (logical[:, None, :] < seen) & (logical < nk)[:, None, :]                    # [B, T, nt * BLOCK]
    slots = idx.gather(2, logical.clamp(max=nk - 1)[:, None, :].expand(B, T, -1))
    # a key's score is the same bits wherever it sits (the GEMMs agree row by row): read from s
    at_score = (((slots // BLOCK) * T + torch.arange(T, device=dev)[None, :, None])[:, :, None, :] * G
                + torch.arange(G, device=dev)[None, None, :, None]) * BLOCK + (slots % BLOCK)[:, :, None, :]
    s_tail = s.view(B, Hkv, -1).gather(2, at_score.view(B, 1, -1).expand(B, Hkv, -1))
    s_tail = s_tail.view(B, Hkv, T, G, nt, BLOCK).transpose(3, 4)                          # [B, Hkv, T, nt, G, BLOCK]
    s_tail = s_tail.masked_fill(~valid.view(B, 1, T, nt, 1, BLOCK), float("-inf"))

    # ---- the max of a query's keys (the same in any order): its blocks below base, and its tail
    below = (torch.arange(last, device=dev)[None, :] < base[:, None]).view(B, 1, last, 1)
    s = s[:, :, :last]                                           # the blocks some row reads in place
    top = s_tail.amax(dim=(3, 5))                                # [B, Hkv, T, G]
    if last:
        top = torch.maximum(top, s.amax(-1).masked_fill(~below, float("-inf")).view(B, Hkv, last, T, G).amax(2))
    top = torch.where(torch.isfinite(top), top, 0)               # a query that sees no key: all zeros below

    # ---- each block's sum of e * [v | 1] (its output and softmax sum) in one [rows, BLOCK] x
    # [BLOCK, D + 1] GEMM: in place below base, gathered per query from base on
    vf = torch.ones(B, Hkv, nk, D + 1, device=dev)
    vf[..., :D] = v[:, :, :nk]
    e = s.view(B, Hkv, last, T, G, BLOCK).sub_(top[:, :, None, :, :, None]).exp_()
    num = torch.zeros(B, Hkv, nb, R, D + 1, device=dev)
    v_in_place = vf[:, :, :last * BLOCK].view(B, Hkv, last, BLOCK, D + 1)
    num[:, :, :last] = _rows_matmul(e.view(B, Hkv, last, R, BLOCK), v_in_place, min_rows)
    if first < last:                                             # a ragged batch: a row's blocks from its base
        num[:, :, :last].masked_fill_(~below[..., None], 0)      # on hold its tail (or garbage) in place
    e_tail = torch.exp(s_tail - top.view(B, Hkv, T, 1, G, 1))
    pick = (torch.arange(B * Hkv, device=dev).view(B, Hkv, 1) * nk + slots.view(B, 1, -1)).flatten()
    v_tail = vf.view(-1, D + 1).index_select(0, pick).view(B, Hkv, T, nt, BLOCK, D + 1)
    num_tail = _rows_matmul(e_tail, v_tail, min_rows)            # [B, Hkv, T, nt, G, D + 1]

    # ---- the tail onto the zeros of blocks >= base (a tail block past the keys is all zeros:
    # clamped in), then every block summed pairwise
    at = (base[:, None] + torch.arange(nt, device=dev)).clamp(max=nb - 1).view(B, 1, nt, 1, 1)
    num.scatter_add_(2, at.expand(B, Hkv, nt, R, D + 1), num_tail.transpose(2, 3).reshape(B, Hkv, nt, R, D + 1))
    num = _tree_sum(num, dim=2)                                  # [B, Hkv, R, D + 1]
    den = num[..., D:]
    out = num[..., :D] / torch.where(den > 0, den, 1)
    return out.view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, Hq, T, D).to(q.dtype)


def _rows_matmul(a: Tensor, b: Tensor, min_rows: int) -> Tensor:
    """a @ b (batched), a's rows padded with zeros to ``min_rows`` first (its GEMMs agree from there)."""
    rows = a.shape[-2]
    if rows >= min_rows:
        return a @ b
    pad = torch.zeros(*a.shape[:-2], min_rows - rows, a.shape[-1], dtype=a.dtype, device=a.device)
    return (torch.cat([a, pad], dim=-2) @ b)[..., :rows, :].contiguous()


def _tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over ``dim`` pairwise, halving its length rounded up to a power of two (the missing
    entries are zeros, never added): appending exact zeros does not change the result, so a
    query's sum is the same whatever the call's width."""
    while x.shape[dim] > 1:
        n = x.shape[dim]
        half = 1 << (n - 1).bit_length() - 1                     # the padded length's half
        head = x.narrow(dim, 0, half).clone()
        head.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
        x = head
    return x.squeeze(dim)


# ------------------------------------------------------------------ probing this CPU's GEMMs

KERNEL = "exact_rows"    # probe results in the autotune cache: {"min_rows": m}, 0 where rows never agree
PROBE_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)   # widths a probe calls
MAX_MIN_ROWS = 64        # padding every narrower call to more would cost more than speculation gains
_probed: dict[str, int | None] = {}


def heavy(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> Tensor:
    """Values 2^-12 .. 2^12 in magnitude with 8-bit mantissas (exact in bf16), random signs."""
    mantissa = 1 + torch.randint(0, 128, shape, generator=gen) / 128
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (sign * mantissa * torch.exp2(torch.randint(-12, 13, shape, generator=gen).float())).to(dtype)


def cancelling(n: int, k: int, rows: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A weight [n, k] and inputs [rows, k] whose every product sums to nothing but rounding error:
    x = (u, u, r), w = (v, -v, s) over the halves of k. Any change in the order of summation
    changes almost every output (a random input shows one flip in ~10^4, after bf16 rounding)."""
    gen = torch.Generator().manual_seed(seed)
    h = k // 2
    v, u = heavy((n, h), gen, dtype), heavy((rows, h), gen, dtype)
    return (torch.cat([v, -v, heavy((n, k - 2 * h), gen, dtype)], 1),
            torch.cat([u, u, heavy((rows, k - 2 * h), gen, dtype)], 1))


def probe_min_rows(f: Callable[[Tensor], Tensor], x: Tensor) -> int | None:
    """The fewest rows from which ``f`` (a row-wise map, e.g. a linear layer) gives every row of
    ``x`` [R, ...] bitwise what the widest call gives it, at each of PROBE_ROWS up to R and with
    the rows reversed; None when not even the widest calls agree."""
    full = f(x)
    if not torch.equal(f(x.flip(0)).flip(0), full):
        return None
    found = None
    for rows in reversed([r for r in PROBE_ROWS if r <= x.shape[0]]):
        if not torch.equal(f(x[:rows]), full[:rows]):
            break
        found = rows
    return found


def linear_min_rows(fmt: str, n: int, k: int, dtype: torch.dtype) -> int | None:
    """``probe_min_rows`` of a linear layer of this format and shape on this CPU (torch's kernel
    choice depends on shapes, never on values: the probe's weight is ``cancelling``'s)."""
    def probe() -> int | None:
        from .quant import QuantLinear
        w, x = cancelling(n, k, PROBE_ROWS[-1], dtype)
        if fmt in ("int8", "int4", "a8w8"):
            layer = QuantLinear.from_float(w, None, "int8" if fmt == "a8w8" else fmt, dtype)
            if fmt == "a8w8":
                layer.use_int8_activations()
            return probe_min_rows(layer, x)
        return probe_min_rows(lambda a: torch.nn.functional.linear(a, w), x)
    return _cached(f"linear,format={fmt},n={n},k={k}", probe)


def attention_min_rows(head_dim: int) -> int | None:
    """``probe_min_rows`` of the two GEMM shapes exact ``attention`` runs per block of keys (fp32);
    None too when a column's result depends on its place (``attention`` reads a key's score from
    wherever its block GEMM computed it)."""
    def probe() -> int | None:
        found = []
        for depth, width in ((head_dim, BLOCK), (BLOCK, head_dim + 1)):
            w, x = cancelling(3 * width, depth, PROBE_ROWS[-1], torch.float32, seed=depth)
            b = w.view(3, width, depth).transpose(1, 2)                  # [3, depth, width]: three GEMMs
            found.append(probe_min_rows(lambda a: (a[None] @ b).transpose(0, 1), x))
            turn = torch.randperm(width, generator=torch.Generator().manual_seed(width))
            if not torch.equal((x[None] @ b[:, :, turn]), (x[None] @ b)[:, :, turn]):
                found.append(None)
        return None if None in found else max(found)
    return _cached(f"attention,head_dim={head_dim},block={BLOCK}", probe)


def _cached(bucket: str, probe: Callable[[], int | None]) -> int | None:
    """A probe's result: this process's, the autotune cache's (same CPU, threads, versions and
    this file), or probed now and stored there."""
    import time
    import warnings

    from ..autotune import cache

    if bucket not in _probed:
        key = cache.Key.make(KERNEL, bucket, probe_source(), cache.environment())
        with warnings.catch_warnings():         # a stale entry is probed again and replaced, never used
            warnings.simplefilter("ignore", cache.AutotuneWarning)
            entry = cache.lookup(key)
        if entry is not None and isinstance(entry.config.get("min_rows"), int):
            _probed[bucket] = entry.config["min_rows"] or None
        else:
            t = time.perf_counter()
            found = probe()
            ms = (time.perf_counter() - t) * 1e3
            cache.update([cache.Entry(key, {"min_rows": found or 0}, ms, None, cache.now())], drop_stale=True)
            _probed[bucket] = found
    return _probed[bucket]


def probe_source() -> str:
    """The hash of this module's source its probe results are stored under (an edit re-probes)."""
    import sys

    from ..autotune.tuner import source_hash
    return source_hash(sys.modules[__name__])


def enable(net: torch.nn.Module) -> int:
    """Make ``net``'s forwards row-invariant on this CPU: every linear layer takes one path at every
    width (``native``) and pads calls narrower than its probed ``min_rows``. Returns the rows the
    attention's GEMMs need (``attention(min_rows=)``). Raises InputError naming a layer whose
    rows do not agree. The probes take seconds per layer shape, once per CPU (autotune cache)."""
    from ..errors import InputError
    from . import cpu_paths

    def check(name: str, found: int | None) -> int:
        if found is None or found > MAX_MIN_ROWS:
            why = "not even its widest calls agree" if found is None else f"only from {found} rows on"
            raise InputError(f"exact mode: on this CPU {name} does not give a row the same result at every call "
                             f"width ({why}); decode without exact=True / --exact (docs/exactness.md)")
        return found

    dtype = net.compute_weight.dtype
    for holder, attr, fmt, n, k in cpu_paths.layers(net):
        setattr(holder, attr, None)
        rows = check(f"a {fmt} linear layer {k} -> {n}", linear_min_rows(fmt, n, k, dtype))
        setattr(holder, "head_min_rows" if attr == "head_paths" else "min_rows", rows)
    return check("attention's blocked matmul", attention_min_rows(net.config.head_dim))
