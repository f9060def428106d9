"""Drafting with an EAGLE-3 head (a ``Drafter`` of ``graft_tk.drafting``).

The head reads the target's fused features (``target_layers``, which the step asks of its
prefill and verify forwards). Head entry j pairs the target features of committed token x_j with
x_{j+1} and predicts x_{j+2}; draft nodes feed their parent's own ``hidden`` instead (EAGLE's
test-time behaviour). The accepted path's TARGET features wait (``pending``) and run in the next
step's catch-up, one forward for every row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .drafting import CachedDrafter, DraftPool, DraftRequest, expand
from .models.eagle3 import Eagle3Head
from .ops import Ops


class Eagle3Drafter(CachedDrafter):
    """An EAGLE-3 head drafting from the target's fused features (see the module docstring).

    Head cache slot j holds entry j = (target features of committed x_j, token x_{j+1}), RoPE
    position j; a draft node at depth d under the root (committed index R) sits at position R - 1 + d.
    """

    def __init__(self, head: Eagle3Head):
        super().__init__(head)
        self.head = head
        self.target_layers = tuple(head.target_layers)
        self.pending: list[Tensor | None] = []   # per row: target features of committed[kv_len:], not yet run

    def reserve(self, rows: int, slots: int) -> None:
        super().reserve(rows, slots)
        self.pending += [None] * (rows - len(self.pending))

    def move_row(self, src: int, dst: int) -> None:
        super().move_row(src, dst)
        self.pending[dst] = self.pending[src]

    def start(self, row: int, prompt: Tensor, features: Tensor | None, ops: Ops) -> None:
        # Entries 0 .. n - 2 pair the prompt's features with its next tokens; the last one waits
        # for the root (the token after the prompt), the first step's catch-up.
        n = prompt.shape[0]
        if n > 1:
            with self.head.cache_rows(row, row + 1):
                self.head(prompt[None, 1:], torch.arange(n - 1, device=prompt.device), 0, logits_at=-1,
                          features=features[None, :n - 1], attention=ops.tree_attention)
        self.kv_len[row], self.pending[row] = n - 1, features[n - 1:]

    def draft(self, request: DraftRequest, ops: Ops) -> DraftPool:
        head, B, device = self.head, len(request.length), request.context.device
        counts = [self.pending[b].shape[0] if a else 0 for b, a in enumerate(request.active)]
        kv_len, T = self.kv_len[:B], max(counts)
        feats = torch.zeros(B, T, head.config.fused_size, dtype=head.fc.weight.dtype, device=device)
        for b, c in enumerate(counts):
            if c:
                feats[b, :c] = self.pending[b]
        up = self.catch_up(counts, device)      # entry j pairs features of x_j with token x_{j+1}
        tokens = request.context.gather(1, (up.at + 1).clamp(max=request.context.shape[1] - 1)).masked_fill(~up.real, 0)
        state = {}
        with head.cache_rows(0, B):
            # Logits over the head's draft vocabulary (often ~32k of 152k tokens): ranked there, the
            # K winners mapped to tokens (``expand``'s vocab_map), never scattered into a target-wide row.
            logits, state["hidden"] = head(tokens, up.at.clamp(max=self.trash_slot), up.plan, logits_at=up.last,
                                           features=feats, attention=ops.tree_attention, draft_vocab=True)
            root_slot = torch.tensor([k + c - 1 for k, c in zip(kv_len, counts)], device=device)
            for b, c in enumerate(counts):
                if c:
                    self.kv_len[b] += c
                    self.pending[b] = self.pending[b][:0]

            def frontier(tokens, parent_rows, positions, plan):
                lg, state["hidden"] = head(tokens, positions, plan, features=state["hidden"].gather(
                    1, parent_rows[:, :, None].expand(-1, -1, state["hidden"].shape[-1])),
                    attention=ops.tree_attention, draft_vocab=True)
                return lg

            return expand(request, logits, T, frontier, root_slot, max(k + c for k, c in zip(kv_len, counts)),
                          self.trash_slot, ops,
                          vocab_map=None if head.identity_vocab else head.draft_ids)

    def commit(self, path: Tensor, n_path: list[int], path_slots: list[list[int]], node_slots: Tensor,
               features: Tensor | None, ops: Ops) -> None:
        # Each row's accepted path's TARGET features (root .. last accepted node) pair with the tokens
        # after them (the accepted nodes, then the bonus); they run in the next step's catch-up.
        for b, m in enumerate(n_path):
            if self.pending[b] is not None:
                self.pending[b] = torch.cat([self.pending[b], features[b, path[b, :m]]])
