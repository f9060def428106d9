"""Root-parallel retrieval (Token Recycling), every template level in ONE launch.

The torch reference (``graft_tk.reference.retrieve.retrieve``) walks the template level by level,
one gather per level, because a level reads the tokens the previous level wrote. Here each
template node is walked from the root on its own, along its cached rank path
(``RetrievalTemplate.rank_paths``): node i at depth D does D dependent gathers
``tok = M[tok, rank_paths[i, d]]``. Nodes share prefixes, so the 80-node default template does
80 * <depth ~3> ~ 250 gathers of 4 bytes instead of 80 — trivial — and no program ever reads
another's output: no level barrier, no second launch, no host sync (the root token is read from
device memory).

Worked example (the reference's, k = 2)::

    M[5] = [7, 9]   M[7] = [3, -1]   M[9] = [-1, -1]     root token 5
    rank_paths [[0, -1], [1, -1], [0, 0], [0, 1], [1, 0]]
    node 3: 5 -rank 0-> 7 -rank 1-> -1           node 4: 5 -rank 1-> 9 -rank 0-> -1 (empty row)
    retrieve -> [7, 9, 3, -1, -1]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..adjacency import RetrievalTemplate
from ._common import launch, next_pow2


@triton.jit
def _retrieve_kernel(
    adj_ptr, root_ptr, rank_paths_ptr, depth_ptr, out_ptr,
    # sizes
    n_nodes, n_vocab, max_depth,
    # strides
    stride_adj_v, stride_adj_k, stride_rp_t,
    # meta-parameters
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)    # batch row: its root, its output row
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = offs < n_nodes
    depth = tl.load(depth_ptr + offs, mask=valid, other=0)
    root = tl.load(root_ptr + row).to(tl.int64)
    tok = tl.zeros([BLOCK_T], dtype=tl.int64) + root
    for d in range(0, max_depth):
        step = valid & (d < depth)
        rank = tl.load(rank_paths_ptr + offs * stride_rp_t + d, mask=step, other=0)
        # -1 (empty row / column) stays -1 for the rest of the path: the subtree of a missing node
        # is missing. Tokens outside [0, V) are treated as empty rather than read out of bounds.
        live = step & (tok >= 0) & (tok < n_vocab)
        nxt = tl.load(adj_ptr + tok * stride_adj_v + rank * stride_adj_k, mask=live, other=-1)
        tok = tl.where(step, nxt.to(tl.int64), tok)
    tl.store(out_ptr + row * n_nodes + offs, tok, mask=valid)


def _config(n_nodes: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps): one program covers up to 128 template nodes (the default has 80);
    larger templates use more programs, which are independent."""
    block_t = min(next_pow2(n_nodes), 128)
    return block_t, 1 if block_t <= 64 else 2


def retrieve(adj: Tensor, roots: Tensor, template: RetrievalTemplate) -> Tensor:
    """Tokens of every template node, walked from each row's root through ``adj`` (one launch).

    Parameters
    ----------
    adj : Tensor, int32 [V, k]
        The successor matrix, ``k >= template.k``; -1 marks an empty entry.
    roots : Tensor, int64 [B]
        Each row's last committed token (read on the device: no host sync).
    template : RetrievalTemplate
        T nodes in BFS order, on ``adj``'s device.

    Returns
    -------
    Tensor, int64 [B, T]
        Same as the reference: -1 where the parent's token is -1 or the M entry is empty, so a
        missing node's subtree is -1. (A root token outside [0, V) gives all -1 here; the
        reference raises an IndexError.) T = 0 or B = 0 returns an empty tensor without a launch.
    """
    if adj.dim() != 2 or adj.dtype != torch.int32:
        raise ValueError(f"adj must be int32 [V, k], got {adj.dtype} {list(adj.shape)}")
    if adj.shape[1] < template.k:
        raise ValueError(f"template reads k={template.k} columns but adj has only {adj.shape[1]}")
    if roots.dim() != 1:
        raise ValueError(f"roots must be [B], got shape {list(roots.shape)}")
    if template.parents.device != adj.device or roots.device != adj.device:
        raise ValueError(f"adj ({adj.device}), roots ({roots.device}) and template "
                         f"({template.parents.device}) must share a device (see RetrievalTemplate.to)")
    B = roots.shape[0]
    out = torch.empty(B, template.n, dtype=torch.int64, device=adj.device)
    if out.numel() == 0:
        return out
    rank_paths = template.rank_paths
    block_t, num_warps = _config(template.n)
    launch(_retrieve_kernel, (triton.cdiv(template.n, block_t), B),
           adj, roots.contiguous(), rank_paths, template.depth, out,
           template.n, adj.shape[0], len(template.levels),
           adj.stride(0), adj.stride(1), rank_paths.stride(0),
           BLOCK_T=block_t, num_warps=num_warps)
    return out
