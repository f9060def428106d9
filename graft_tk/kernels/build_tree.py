"""build_tree in one Triton launch for every row: prune + rerank the drafter's pool, graft every
candidate, give the N - 1 places to the nodes likeliest to be accepted, write fixed-shape tree
tensors and the bit-packed ancestor mask. Same signature and outputs as
``graft_tk.reference.build_tree.build_tree``.

One program per batch row (grid (B,)): a row's work is a few hundred dependent steps over <= ~256
nodes, far too little to spread over programs, and a single program can synchronise with
``tl.debug_barrier``; rows are independent (each its own scratch).
Phases:
  1. select  rank every valid pool entry by the key (score desc, index asc) against all others,
             blocked [P_PAD, BLOCK_J] compares; keep rank < N-1 and score >= log_tau.
  2. close   keep an entry only if all its ancestors are kept, and clamp its value to theirs:
             pointer doubling over the pool, ceil(log2 P) rounds through scratch buffers (AND and
             min over ancestors at distance < 2^s).
  3. place   union index = inclusive cumsum of kept (root is 0); parents remapped through scratch;
             the drafted nodes are scattered into union buffers and read back per node.
  4. graft   one loop iteration per candidate, all state in registers ([U_PAD] union vectors,
             [C_PAD] candidate -> union node map): dedup by (parent, token) match (raising the
             node's value), else a new union node valued parent's value + its estimate (a
             candidate's estimate is log P(accepted | its parent accepted, no drafted sibling
             accepted)) + log of the share its drafted siblings leave free.
  5. choose  rank every union node by (value desc, index asc), blocked [U_PAD, BLOCK_UJ] compares;
             keep rank < N-1 (closed under parents: a child never outranks its parent); output
             index = cumsum of kept, parents and candidates remapped through scratch.
  6. mask    own bit, then ceil(log2 N) pointer-doubling rounds: row |= row[jump], jump = jump[jump],
             with the output mask itself as the scratch the rows are gathered from.

Why the barriers: a tensor is spread over the program's threads, so a value one thread stores to
global memory (scratch, or an output read back) is loaded by ANOTHER thread of the same program.
On a GPU nothing orders those accesses without ``tl.debug_barrier()`` (bar.sync: all threads
arrive, and their prior global writes are visible to the CTA). Every round trip therefore has a
barrier between the stores and the loads (read-after-write) AND between the loads and the next
round's stores to the same buffer (write-after-read: a fast thread must not overwrite a value a
slow thread has not read yet). The interpreter runs a program's ops in order, so it cannot catch a
missing barrier; the comments at each barrier say which hazard it closes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.build_tree import FREE_FLOOR
from ..tree import DRAFT, ROOT, BuiltTree
from ._common import launch, next_pow2
from .draft_expand import _MIN_KEY, _desc_key

_DRAFT = tl.constexpr(DRAFT)
_FREE_FLOOR = tl.constexpr(FREE_FLOOR)
_ROOT = tl.constexpr(ROOT)
_RANK_TILE = 2048   # pool-rank compares per step: P_PAD * BLOCK_J


@triton.jit
def _build_tree_kernel(
    # pointers: inputs (per row, but cand_parents: every row alike)
    pool_tokens_ptr, pool_parents_ptr, pool_scores_ptr, pool_values_ptr, pool_depth_ptr, n_pool_ptr, root_ptr,
    log_tau_ptr, cand_tokens_ptr, cand_parents_ptr, cand_source_ptr, cand_values_ptr,
    # pointers: outputs, then per-row scratch: int32 [2, S_PAD], float32 [S_PAD], union int64 [2, U_PAD], float32 [U_PAD]
    tokens_ptr, parents_ptr, depth_ptr, source_ptr, scores_ptr, pool_index_ptr, mask_ptr, n_nodes_ptr,
    cand_node_ptr, values_ptr, scratch_ptr, scratch_f_ptr, union_ptr, union_f_ptr,
    # sizes
    P, C, N, W,
    # meta-parameters
    P_PAD: tl.constexpr, C_PAD: tl.constexpr, N_PAD: tl.constexpr, U_PAD: tl.constexpr, W_PAD: tl.constexpr,
    S_PAD: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_UJ: tl.constexpr, LOG_P: tl.constexpr, LOG_N: tl.constexpr,
    HAS_VALUES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)   # batch row: every per-row pointer moves to its row
    pool_tokens_ptr += b * P
    pool_parents_ptr += b * P
    pool_scores_ptr += b * P
    pool_values_ptr += b * P
    pool_depth_ptr += b * P
    cand_tokens_ptr += b * C
    cand_source_ptr += b * C
    cand_values_ptr += b * C
    tokens_ptr += b * N
    parents_ptr += b * N
    depth_ptr += b * N
    source_ptr += b * N
    scores_ptr += b * N
    pool_index_ptr += b * N
    mask_ptr += b * N * W
    cand_node_ptr += b * C
    values_ptr += b * N
    scratch_ptr += b * 2 * S_PAD
    scratch_f_ptr += b * S_PAD
    union_ptr += b * 2 * U_PAD
    union_f_ptr += b * U_PAD
    log_tau = tl.load(log_tau_ptr + b)
    scr_a = scratch_ptr
    scr_b = scratch_ptr + S_PAD
    u_tok = union_ptr                   # int64: token of each union node
    u_pidx = union_ptr + U_PAD          # int64: pool entry of each drafted union node
    # ---------------------------------------------------------------- 1. select (prune + rerank)
    n_pool = tl.minimum(tl.maximum(tl.load(n_pool_ptr + b).to(tl.int32), 0), P)
    pi = tl.arange(0, P_PAD)
    in_pool = pi < n_pool
    score = tl.load(pool_scores_ptr + pi, mask=in_pool, other=float("-inf")).to(tl.float32)
    eligible = in_pool & (score >= log_tau)
    key = tl.where(eligible, _desc_key(score, pi), _MIN_KEY)
    rank = tl.zeros([P_PAD], tl.int32)                  # eligible entries ranked above each entry
    for j0 in range(0, P_PAD, BLOCK_J):
        pj = j0 + tl.arange(0, BLOCK_J)
        in_j = pj < n_pool
        sj = tl.load(pool_scores_ptr + pj, mask=in_j, other=float("-inf")).to(tl.float32)
        kj = tl.where(in_j & (sj >= log_tau), _desc_key(sj, pj), _MIN_KEY)
        rank += tl.sum((kj[None, :] > key[:, None]).to(tl.int32), 1)
    chosen = eligible & (rank < N - 1)

    # ---------------------------------------------------------------- 2. close under parents
    # ... and clamp each entry's value to its ancestors' (a path is never likelier than its prefix).
    pool_par = tl.load(pool_parents_ptr + pi, mask=in_pool, other=-1).to(tl.int32)
    if HAS_VALUES:
        val = tl.load(pool_values_ptr + pi, mask=in_pool, other=0.0).to(tl.float32)
    else:
        val = tl.zeros([P_PAD], tl.float32)
    ok = chosen.to(tl.int32)
    jump = pool_par
    for _ in tl.static_range(LOG_P):
        tl.store(scr_a + pi, ok)
        tl.store(scr_b + pi, jump)
        tl.store(scratch_f_ptr + pi, val)
        tl.debug_barrier()      # RAW: the loads below read other threads' stores
        has = jump >= 0
        ok_up = tl.load(scr_a + jump, mask=has, other=1)
        jump_up = tl.load(scr_b + jump, mask=has, other=-1)
        val_up = tl.load(scratch_f_ptr + jump, mask=has, other=0.0)
        tl.debug_barrier()      # WAR: next round's stores must wait for every thread's loads
        ok = ok & ok_up
        val = tl.minimum(val, val_up)
        jump = tl.where(has, jump_up, -1)
    kept = ok > 0
    val = tl.minimum(val, 0.0)                          # the root's value is log 1

    # ---------------------------------------------------------------- 3. place the drafted nodes
    node = tl.cumsum(kept.to(tl.int32), 0)              # union index of a kept entry (root = 0)
    n_draft = tl.sum(kept.to(tl.int32), 0)
    tl.store(scr_a + pi, tl.where(kept, node, -1))
    tl.debug_barrier()          # RAW: parents are looked up in other threads' node indices
    tree_par = tl.load(scr_a + pool_par, mask=kept & (pool_par >= 0), other=0)
    tl.store(u_tok + node, tl.load(pool_tokens_ptr + pi, mask=kept, other=0), mask=kept)
    tl.store(u_pidx + node, pi.to(tl.int64), mask=kept)
    tl.store(scratch_f_ptr + node, score, mask=kept)     # drafter scores, read back in phase 6
    tl.store(union_f_ptr + node, val, mask=kept)
    tl.store(scr_b + node, tree_par, mask=kept)
    tl.store(depth_ptr + node, tl.load(pool_depth_ptr + pi, mask=kept, other=0).to(tl.int32), mask=kept & (node < N))
    tl.debug_barrier()          # RAW: the per-node reads below gather what the pool threads scattered
    ui = tl.arange(0, U_PAD)
    is_draft = (ui >= 1) & (ui <= n_draft)
    tok_vec = tl.where(ui == 0, tl.load(root_ptr + b), tl.load(u_tok + ui, mask=is_draft, other=-1))
    par_vec = tl.where(ui == 0, -1, tl.load(scr_b + ui, mask=is_draft, other=-1))
    dep_vec = tl.load(depth_ptr + ui, mask=is_draft & (ui < N), other=0)
    src_vec = tl.where(ui == 0, _ROOT, tl.where(is_draft, _DRAFT, -1))
    val_vec = tl.where(ui == 0, 0.0, tl.load(union_f_ptr + ui, mask=is_draft, other=float("-inf")))
    tl.debug_barrier()          # WAR: phase 5 stores to the same buffers

    # ---------------------------------------------------------------- 4. graft every candidate into the union
    ci = tl.arange(0, C_PAD)
    mapped = tl.full([C_PAD], -1, tl.int32)            # candidate -> union node, -1 = missing
    n = n_draft + 1
    for c in range(0, C):
        tok = tl.load(cand_tokens_ptr + c).to(tl.int64)
        tpar = tl.load(cand_parents_ptr + c).to(tl.int32)
        src = tl.load(cand_source_ptr + c).to(tl.int32)
        if HAS_VALUES:
            cval = tl.load(cand_values_ptr + c).to(tl.float32)
        else:
            cval = tl.full([], 0.0, tl.float32)
        parent = tl.where(tpar < 0, 0, tl.max(tl.where(ci == tpar, mapped, -1), 0))
        live = (tok >= 0) & (parent >= 0)
        match = (ui >= 1) & (ui < n) & (par_vec == parent) & (tok_vec == tok)
        found = tl.max(tl.where(match, ui, -1), 0)
        parent_val = tl.max(tl.where(ui == parent, val_vec, float("-inf")), 0)
        v = parent_val + tl.minimum(cval, 0.0)
        if HAS_VALUES:   # + log of the share its drafted siblings leave free (reference: free_share)
            sibling = is_draft & (par_vec == parent) & (ui != found)
            # (a missing candidate's parent value is -inf: clamp it so no -inf - -inf is formed)
            taken = tl.sum(tl.exp(tl.where(sibling, val_vec, float("-inf")) - tl.maximum(parent_val, -3.0e38)), 0)
            v += tl.log(tl.maximum(1.0 - taken, _FREE_FLOOR))
        add = live & (found < 0)
        target = tl.where(add, n, tl.where(live, found, -1))
        mapped = tl.where(ci == c, target, mapped)
        slot = add & (ui == n)
        parent_depth = tl.max(tl.where(ui == parent, dep_vec, -1), 0)
        tok_vec = tl.where(slot, tok, tok_vec)
        par_vec = tl.where(slot, parent, par_vec)
        dep_vec = tl.where(slot, parent_depth + 1, dep_vec)
        src_vec = tl.where(slot, src, src_vec)
        val_vec = tl.where(slot | (live & (ui == found)), tl.maximum(val_vec, v), val_vec)
        n += add.to(tl.int32)

    # ---------------------------------------------------------------- 5. the N - 1 likeliest nodes
    # rank = union nodes j in [1, n) with a larger (value desc, index asc) key; keys via scratch
    in_union = (ui >= 1) & (ui < n)
    ukey = tl.where(in_union, _desc_key(val_vec, ui), _MIN_KEY)
    tl.store(union_f_ptr + ui, val_vec)
    tl.debug_barrier()          # RAW: every thread reads every node's value
    urank = tl.zeros([U_PAD], tl.int32)
    for j0 in range(0, U_PAD, BLOCK_UJ):
        uj = j0 + tl.arange(0, BLOCK_UJ)
        vj = tl.load(union_f_ptr + uj)
        kj = tl.where((uj >= 1) & (uj < n), _desc_key(vj, uj), _MIN_KEY)
        urank += tl.sum((kj[None, :] > ukey[:, None]).to(tl.int32), 1)
    keep = (ui == 0) | (in_union & (urank < N - 1))
    new_idx = tl.cumsum(keep.to(tl.int32), 0) - 1
    n_out = tl.sum(keep.to(tl.int32), 0)
    tl.store(scr_a + ui, tl.where(keep, new_idx, -1))
    tl.debug_barrier()          # RAW: parents and candidates look up other threads' new indices
    new_par = tl.where(ui == 0, -1, tl.load(scr_a + par_vec, mask=keep & (par_vec >= 0), other=-1))
    tl.store(cand_node_ptr + ci, tl.load(scr_a + mapped, mask=(ci < C) & (mapped >= 0), other=-1), mask=ci < C)

    # ---------------------------------------------------------------- 6. outputs + ancestor mask
    drafted_kept = keep & is_draft
    u_score = tl.load(scratch_f_ptr + ui, mask=drafted_kept, other=float("-inf"))
    u_score = tl.where(ui == 0, 0.0, u_score)
    u_pool = tl.load(u_pidx + ui, mask=drafted_kept, other=-1)
    tl.debug_barrier()          # WAR: the depth loads above and the stores below share depth_ptr
    dst = tl.where(keep, new_idx, 0)
    tl.store(tokens_ptr + dst, tok_vec, mask=keep)
    tl.store(parents_ptr + dst, new_par, mask=keep)
    tl.store(depth_ptr + dst, dep_vec, mask=keep)
    tl.store(source_ptr + dst, src_vec.to(tl.int8), mask=keep)
    tl.store(scores_ptr + dst, u_score, mask=keep)
    tl.store(pool_index_ptr + dst, u_pool, mask=keep)
    tl.store(values_ptr + dst, val_vec, mask=keep)
    ni = tl.arange(0, N_PAD)
    pad = (ni >= n_out) & (ni < N)
    tl.store(tokens_ptr + ni, tl.full([N_PAD], -1, tl.int64), mask=pad)
    tl.store(parents_ptr + ni, tl.full([N_PAD], -1, tl.int32), mask=pad)
    tl.store(depth_ptr + ni, tl.zeros([N_PAD], tl.int32), mask=pad)
    tl.store(source_ptr + ni, tl.full([N_PAD], -1, tl.int8), mask=pad)
    tl.store(scores_ptr + ni, tl.full([N_PAD], float("-inf"), tl.float32), mask=pad)
    tl.store(pool_index_ptr + ni, tl.full([N_PAD], -1, tl.int64), mask=pad)
    tl.store(values_ptr + ni, tl.full([N_PAD], float("-inf"), tl.float32), mask=pad)
    tl.store(n_nodes_ptr + b, n_out.to(tl.int64))
    tl.debug_barrier()          # RAW: the mask rows follow the parents other threads just stored

    out = ni < N
    par_out = tl.load(parents_ptr + ni, mask=ni < n_out, other=-1)
    wi = tl.arange(0, W_PAD)
    # Own bit: column i is bit i % 32 of word i // 32 (bit 31 is the int32 sign bit).
    bits = tl.where(wi[None, :] == (ni // 32)[:, None], (1 << (ni % 32))[:, None], 0)   # [N_PAD, W_PAD]
    row_ptr = mask_ptr + ni[:, None] * W + wi[None, :]
    row_ok = out[:, None] & (wi[None, :] < W)
    jump = par_out                                      # root and padding have no ancestors
    for _ in tl.static_range(LOG_N):
        tl.store(row_ptr, bits, mask=row_ok)
        tl.store(scr_b + ni, jump)
        tl.debug_barrier()      # RAW: rows and jumps of ancestors were stored by other threads
        has = jump >= 0
        up = tl.load(mask_ptr + jump[:, None] * W + wi[None, :], mask=has[:, None] & (wi[None, :] < W), other=0)
        jump_up = tl.load(scr_b + jump, mask=has, other=-1)
        tl.debug_barrier()      # WAR: next round overwrites the rows and jumps just read
        bits = bits | up
        jump = tl.where(has, jump_up, -1)
    tl.store(row_ptr, bits, mask=row_ok)


def _config(P: int, C: int, N: int) -> dict:
    """Heuristic meta-parameters. One program runs a dependent chain of small reductions, so few
    warps (cheaper reductions and barriers) beat many; pads are >= 2 so no tile has a size-1 dim.
    The union (root + drafted + every candidate) has at most N + C nodes."""
    p_pad, n_pad, u_pad = max(2, next_pow2(P)), max(2, next_pow2(N)), max(2, next_pow2(N + C))
    return {"P_PAD": p_pad, "C_PAD": max(2, next_pow2(C)), "N_PAD": n_pad, "U_PAD": u_pad,
            "W_PAD": max(2, next_pow2((N + 31) // 32)), "S_PAD": max(p_pad, u_pad),
            "BLOCK_J": max(1, min(p_pad, _RANK_TILE // p_pad)), "BLOCK_UJ": max(1, min(u_pad, _RANK_TILE // u_pad)),
            "LOG_P": (p_pad - 1).bit_length(), "LOG_N": (n_pad - 1).bit_length(),
            "num_warps": 2 if max(p_pad, u_pad) <= 128 else 4}


def build_tree(pool_tokens: torch.Tensor, pool_parents: torch.Tensor, pool_scores: torch.Tensor,
               pool_depth: torch.Tensor, n_pool: torch.Tensor, roots: torch.Tensor, log_tau: torch.Tensor,
               cand_tokens: torch.Tensor, cand_parents: torch.Tensor, cand_source: torch.Tensor, budget_n: int,
               pool_values: torch.Tensor | None = None, cand_values: torch.Tensor | None = None) -> BuiltTree:
    """Triton version of ``graft_tk.reference.build_tree.build_tree``: same arguments, same
    ``BuiltTree`` (shapes fixed by B, P, C, N; padding as documented there). One launch for every
    row, no host sync. Inputs must be well formed (parents before children); that is not checked
    on device.
    """
    B, P = pool_tokens.shape
    C, N = cand_tokens.shape[-1], budget_n
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"budget_n must be an int >= 1, got {budget_n!r}")
    if pool_tokens.dim() != 2 or any(t.shape != (B, P) for t in (pool_parents, pool_scores, pool_depth)):
        raise ValueError(f"pool tensors must be [B, P] of one shape, got {list(pool_tokens.shape)}")
    if n_pool.shape != (B,) or roots.shape != (B,) or log_tau.shape != (B,):
        raise ValueError(f"n_pool, roots and log_tau must be [B={B}]")
    if cand_tokens.shape != (B, C) or cand_parents.shape != (C,) or cand_source.shape not in ((C,), (B, C)):
        raise ValueError(f"cand_tokens must be [B={B}, C], cand_parents [C={C}], cand_source [C] or [B, C]")
    if pool_values is not None and pool_values.shape != (B, P):
        raise ValueError(f"pool_values must be [B={B}, P={P}], got {list(pool_values.shape)}")
    if cand_values is not None and cand_values.shape != (B, C):
        raise ValueError(f"cand_values must be [B={B}, C={C}], got {list(cand_values.shape)}")
    cand_source = cand_source.expand(B, C)
    dev = pool_tokens.device
    tensors = (pool_parents, pool_scores, pool_depth, cand_tokens, cand_parents, cand_source, n_pool, roots, log_tau,
               pool_values, cand_values)
    if any(isinstance(t, torch.Tensor) and t.device != dev for t in tensors):
        raise ValueError(f"every tensor argument must be on the pool's device ({dev})")
    has_values = pool_values is not None or cand_values is not None
    if has_values:   # one given: the other side ties at log 1, as in the reference
        pool_values = (pool_values if pool_values is not None else torch.zeros(B, P, device=dev)).float().contiguous()
        cand_values = (cand_values if cand_values is not None else torch.zeros(B, C, device=dev)).float().contiguous()
    cfg = _config(P, C, N)
    W = (N + 31) // 32
    out = BuiltTree(tokens=torch.empty(B, N, dtype=torch.int64, device=dev),
                    parents=torch.empty(B, N, dtype=torch.int32, device=dev),
                    depth=torch.empty(B, N, dtype=torch.int32, device=dev),
                    source=torch.empty(B, N, dtype=torch.int8, device=dev),
                    scores=torch.empty(B, N, dtype=torch.float32, device=dev),
                    pool_index=torch.empty(B, N, dtype=torch.int64, device=dev),
                    mask=torch.empty(B, N, W, dtype=torch.int32, device=dev),
                    n_nodes=torch.empty(B, dtype=torch.int64, device=dev),
                    cand_node=torch.empty(B, C, dtype=torch.int32, device=dev),
                    values=torch.empty(B, N, dtype=torch.float32, device=dev))
    if B == 0:
        return out
    scratch = torch.empty(B, 2 * cfg["S_PAD"], dtype=torch.int32, device=dev)
    scratch_f = torch.empty(B, cfg["S_PAD"], dtype=torch.float32, device=dev)
    union = torch.empty(B, 2 * cfg["U_PAD"], dtype=torch.int64, device=dev)
    union_f = torch.empty(B, cfg["U_PAD"], dtype=torch.float32, device=dev)
    values = (pool_values, cand_values) if has_values else (pool_scores, pool_scores)  # unread without values
    launch(_build_tree_kernel, (B,),
           pool_tokens.contiguous(), pool_parents.contiguous(), pool_scores.float().contiguous(), values[0],
           pool_depth.contiguous(), n_pool.to(torch.int64).contiguous(), roots.to(torch.int64).contiguous(),
           log_tau.float().contiguous(), cand_tokens.contiguous(), cand_parents.contiguous(),
           cand_source.contiguous(), values[1],
           *out, scratch, scratch_f, union, union_f, P, C, N, W, HAS_VALUES=has_values, **cfg)
    return out
