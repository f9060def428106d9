"""One depth of EAGLE-2 style tree expansion (torch reference).

Every frontier node proposes its top-K next tokens; a child's score is its path's cumulative
log-probability under the drafter; the K best children over the whole frontier become the next
frontier. Scores only fall with depth (log p <= 0), so "every frontier score < log tau" means no
deeper node can pass the threshold either: drafting may stop there exactly.
"""
from __future__ import annotations

import torch
from torch import Tensor


def draft_expand(frontier_scores: Tensor, logits: Tensor, top_k: int, log_tau: float
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Expand a frontier of F nodes by one depth.

    Parameters
    ----------
    frontier_scores : float32 [F]   cumulative log-prob of each frontier node (0 for the root)
    logits          : float32 [F, V] drafter logits at each frontier node
    top_k           : K, children per node and width of the next frontier
    log_tau         : log of the pruning threshold (-inf: never prune)

    Returns
    -------
    child_tokens  : int64 [F*K]   candidate tokens, frontier-major (node f's children at f*K..f*K+K-1)
    child_parents : int64 [F*K]   index into the frontier of each child's parent
    child_scores  : float32 [F*K] cumulative log-probs
    next_frontier : int64 [min(K, F*K)] indices into the children of the next frontier, best first
    stop          : bool []       True when every child scores below log_tau (nothing left to expand)
    """
    F = frontier_scores.shape[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_logp, child_tokens = logp.topk(top_k, dim=-1)                     # [F, K]
    child_scores = (frontier_scores[:, None] + top_logp).reshape(-1)      # [F*K]
    child_parents = torch.arange(F, device=logits.device).repeat_interleave(top_k)
    next_frontier = child_scores.topk(min(top_k, child_scores.shape[0])).indices
    stop = child_scores.max() < log_tau
    return child_tokens.reshape(-1), child_parents, child_scores, next_frontier, stop
