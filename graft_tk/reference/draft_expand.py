"""One depth of EAGLE-2 style tree expansion (torch reference).

Every frontier node proposes its top-K next tokens; a child's score is its path's cumulative
log-probability under the drafter; the K best children over the whole frontier become the next
frontier. Scores only fall with depth (log p <= 0), so "every frontier score < log tau" means no
deeper node can pass the threshold either: drafting may stop there exactly.

Tie order is part of the contract, so the Triton kernel (``graft_tk.kernels.draft_expand``) can
be compared with ``torch.equal``: torch.topk on CPU breaks ties arbitrarily (top-5 of
[1, 3, 3, 2, 3, 0, 3] * 1000 gave indices [1, 4, 6, 8, 2]), so every ranking here has the order
of ``desc_key``: larger value first, then the LOWER index first (a stable descending sort's order). Per-row top-K ranks the raw logits (log_softmax is ``x - lse`` with one lse per row, the
same order, but rounding ``x - lse`` can merge two distinct logits into a tie), so which tokens
are picked never depends on how the log-sum-exp was rounded.
"""
from __future__ import annotations

import torch
from torch import Tensor

_LOW_MAX = 2 ** 31 - 1  # indices live in the low 32 bits of a key as _LOW_MAX - index (index < 2**31)


def desc_key(values: Tensor, index: Tensor) -> Tensor:
    """int64 keys whose descending order is (value descending, index ascending); unique per index.

    High 32 bits: the float32 bits of ``values`` mapped to an order-preserving signed int
    (negative floats have their magnitude bits flipped; -0.0 is folded onto +0.0 so the two tie,
    as they compare equal). Low 32 bits: ``2**31 - 1 - index``. NaN has no defined place.
    The kernels build the same key (``graft_tk.kernels.draft_expand._desc_key``), so ties break identically.
    """
    v = values.float()
    bits = torch.where(v == 0, 0, v.contiguous().view(torch.int32))
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    return (ordered << 32) + (_LOW_MAX - index.long())


def key_index(key: Tensor) -> Tensor:
    """The index a ``desc_key`` was built from."""
    return _LOW_MAX - (key - ((key >> 32) << 32))


def top_k_lowest_index(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest ``values`` along the last dim, best first, ties -> lower index.

    The order of ``desc_key`` (and of a stable descending sort) without sorting all V entries:
    int64 keys for 16 x 151936 logits took ~180 ms here, this ~10 ms (a float topk alone ~3 ms).
    torch.topk gets the right VALUES; only which of several entries equal to the k-th value it
    returns is arbitrary. Entries above the k-th value are all in its answer and are just
    reordered stably; when more entries equal the k-th value than fit (rare with real logits:
    one extra compare pass detects it), the remaining slots go to the lowest-index ones, found by
    a second topk. That check is a host sync, free on the CPU where this reference runs in the
    decode loop.
    """
    vals, ind = values.topk(k, dim=-1)                                  # values exact, ties arbitrary
    # Stable order of the k pairs: sort by index, then stably by value (descending).
    by_index = ind.sort(dim=-1).indices
    vals, ind = vals.gather(-1, by_index), ind.gather(-1, by_index)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    vals, ind = vals.gather(-1, order), ind.gather(-1, order)
    kth = vals[..., -1:]
    n_at_kth = (vals == kth).sum(-1, keepdim=True)
    is_kth = values == kth
    if torch.equal(is_kth.sum(-1, keepdim=True), n_at_kth):
        return ind                                                      # no entry equal to the k-th left out
    # The lowest-index entries equal to the k-th value, ascending (-index is unique among them;
    # exact in float32 for V < 2**24), fill the slots from the first k-th valued one on.
    pos = torch.arange(values.shape[-1], device=values.device, dtype=torch.float32)
    ties = torch.where(is_kth, -pos, float("-inf")).topk(k, dim=-1).indices
    slot = torch.arange(k, device=values.device)
    n_above = k - n_at_kth
    return torch.where(slot < n_above, ind, ties.gather(-1, (slot - n_above).clamp(min=0)))


def draft_expand(frontier_scores: Tensor, logits: Tensor, top_k: int, log_tau: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Expand every row's frontier of F nodes by one depth.

    Parameters
    ----------
    frontier_scores : float32 [B, F]   cumulative log-prob of each frontier node (0 for the root)
    logits          : float [B, F, V]  drafter logits at each frontier node (computed in float32)
    top_k           : K, children per node and width of the next frontier, 1 <= K <= V
    log_tau         : float32 [B]      log of each row's pruning threshold (-inf: never prune)

    Returns
    -------
    child_tokens  : int64 [B, F*K]   candidate tokens, frontier-major (node f's children at f*K..f*K+K-1),
                                     each node's best first; equal logits -> lower token id first
    child_parents : int64 [F*K]      index into the frontier of each child's parent (every row alike)
    child_scores  : float32 [B, F*K] cumulative log-probs: frontier score + log_softmax(x)[token]
    next_frontier : int64 [B, min(K, F*K)] indices into the children of the next frontier, best
                                     first; equal scores -> lower child index first
    stop          : bool [B]         True when every child of the row scores below its log_tau
    """
    B, F, V = logits.shape
    if not 1 <= top_k <= V:
        raise ValueError(f"top_k must be in [1, V={V}], got {top_k}")
    x = logits.float()
    child_tokens = top_k_lowest_index(x, top_k)                                # [B, F, K]
    # ATen's CPU log_softmax computes (x - max) - log(sum(exp(x - max))), the kernel's formula;
    # the full [B, F, V] output is cheaper than a separate max / exp-sum (one fused vectorised pass).
    top_logp = torch.log_softmax(x, dim=-1).gather(2, child_tokens)           # [B, F, K]
    child_scores = (frontier_scores.float()[:, :, None] + top_logp).reshape(B, -1)   # [B, F*K]
    child_parents = torch.arange(F, device=logits.device).repeat_interleave(top_k)
    next_frontier = top_k_lowest_index(child_scores, min(top_k, child_scores.shape[1]))
    stop = child_scores.max(-1).values < log_tau.float()
    return child_tokens.reshape(B, -1), child_parents, child_scores, next_frontier, stop
