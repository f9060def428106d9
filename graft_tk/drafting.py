"""Drafting a token tree: EAGLE-2 style expansion with dynamic depth, behind a small interface.

The engine talks to a ``Drafter``: ``start`` (after the target's prefill), ``draft`` (one step's
candidate pool) and ``commit`` (after acceptance). Two implementations share the expansion loop
(``expand``), which runs ONE drafter forward per depth over the whole frontier (K nodes) with a
tree mask over scratch cache slots, never one per node:

* ``ModelDrafter``: a small model with the target's tokenizer. It keeps its own KV cache; its
  first ``kv_len`` slots hold committed tokens (the prompt runs in ``start``, with the target's
  prefill), the committed tokens it has not seen yet (the root last) run in the step's first
  forward, which also gives the root's next-token distribution.
  After acceptance the KV of accepted draft nodes is moved into place, never recomputed.
* ``Eagle3Drafter``: an EAGLE-3 head over the target's fused features (``target_layers``, which
  the engine requests in its prefill and verify forwards). Head entry j pairs the target features
  of committed token x_j with the token x_{j+1} and predicts x_{j+2}; draft nodes feed their
  parent entry's own ``hidden`` instead (EAGLE's test-time behaviour). After acceptance the head
  must see the TARGET features of the accepted path, so ``commit`` keeps those rows and the next
  step's first forward re-runs the accepted tokens (the draft entries' KV is discarded).

``draft`` returns every candidate it created (the *pool*); choosing which of them enter the tree
(tau, best N-1, grafting retrieval) is ``build_tree``'s job, in one op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor, nn

from .backend import HOST_READS
from .compiled import StepForward
from .config import GraftConfig
from .models import Model
from .models.eagle3 import Eagle3Head
from .ops import Ops


@dataclass
class DraftPool:
    """The drafter's candidates in creation order (parents before children); see ``build_tree``."""
    tokens: Tensor      # int64 [P]
    parents: Tensor     # int64 [P]  -1 = child of the root, else an earlier pool index
    scores: Tensor      # float32 [P] cumulative drafter log-prob
    depth: Tensor       # int64 [P]
    n: int              # valid entries (a host count: F*K per depth, known without a sync)
    slots: Tensor       # int64 [P] drafter cache slot holding each entry's KV, -1 if never run
    widths: tuple[int, ...]   # tokens in each drafter forward of this step (the cost model prices them)

    @classmethod
    def empty(cls, device) -> "DraftPool":
        """No drafter: retrieval-only methods graft onto the bare root."""
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z, torch.zeros(0, device=device), z, 0, z, ())

    @property
    def forwards(self) -> int:
        """Drafter forward passes this step."""
        return len(self.widths)

    def slots_of(self, pool_index: Tensor) -> Tensor:
        """Drafter cache slot of each tree node (``build_tree``'s pool_index; -1: not drafted or never run)."""
        if self.slots.shape[0] == 0:
            return torch.full_like(pool_index, -1)
        return self.slots[pool_index.clamp(min=0)].masked_fill(pool_index < 0, -1)


class Drafter(Protocol):
    """What the engine needs from a drafter (see the module docstring)."""
    net: nn.Module                          # the drafter's network
    target_layers: tuple[int, ...] | None   # target features to request in prefill / verify (None: none)

    def start(self, prompt: Tensor, max_len: int, features: Tensor | None, ops: Ops) -> None:
        """A new request: the target prefilled ``prompt`` [n] (``features`` [n, F] when asked for);
        the drafter runs its own pass over the prompt here, so that a step's first forward holds
        only the tokens committed since."""

    def draft(self, context: Tensor, length: int, cfg: GraftConfig, log_tau: float, ops: Ops) -> DraftPool:
        """The candidate pool under the root ``context[length - 1]`` (``context[:length]``: the
        committed tokens, on the device)."""

    def commit(self, path: Tensor, path_slots: Tensor, path_slots_host: list[int], features: Tensor | None,
               ops: Ops) -> None:
        """After acceptance: ``path`` [m] tree nodes accepted (root first), ``path_slots`` [>= m]
        their drafter cache slots on the device (-1: not drafted / never run), the first m of them
        as read on the host, ``features`` [N, F] the verify forward's."""


def drafter_cache_slots(tokens: int, top_k: int, max_depth: int) -> int:
    """Slots a drafter's cache needs for a request of ``tokens`` (prompt + new tokens): each of them
    once committed, and a step's scratch above them: ``top_k`` nodes per depth and the root."""
    return tokens + top_k * max_depth + 1


# Runs one depth's frontier: (tokens [F], parent_rows [F] = each node's parent's row in the previous
# forward's logits, positions [F], start, attn_mask, mask_prefix) -> logits [F, V].
FrontierForward = Callable[[Tensor, Tensor, Tensor, int, Tensor, int], Tensor]


def expand(logits: Tensor, first_width: int, forward: FrontierForward, root_slot: int, cfg: GraftConfig,
           log_tau: float, ops: Ops, vocab_map: Tensor | None = None) -> DraftPool:
    """Expand from the root (``logits`` [1, V], its next-token logits, from a forward of
    ``first_width`` tokens) up to ``cfg.max_depth`` depths. ``vocab_map`` [V]: the logits are over
    a drafter vocabulary and entry i is the token of its id i (an EAGLE-3 head's ``draft_ids``):
    the K best of each row are ranked there and only they are mapped.

    The root's KV is in cache slot ``root_slot``; each depth's frontier gets scratch slots after it.
    Expansion stops early once every new child scores below ``log_tau`` (scores only fall with
    depth, so nothing deeper could pass); ``log_tau = -inf`` drafts the full depth D (``tree``).
    """
    tree = Expansion(logits.device, cfg, root_slot, first_width)
    for depth in range(1, cfg.max_depth + 1):
        stop = tree.grow(logits, log_tau, ops, vocab_map)
        # One host sync per depth: stopping decides whether another drafter forward is launched.
        if depth == cfg.max_depth or (log_tau > -math.inf and HOST_READS.read(stop)):
            break
        # Run the new frontier (F <= K nodes) through the drafter in ONE forward with a tree mask
        # over the scratch slots; every committed slot and the root are visible to all of them.
        tokens, parent_rows, positions, start, block = tree.next_forward()
        logits = forward(tokens, parent_rows, positions, start, block, root_slot + 1)
    return tree.pool()


class Expansion:
    """One request's draft tree under its root, grown a depth at a time (``expand``; a batch of
    requests grows one each, with one drafter forward per depth for all of them)."""

    def __init__(self, device, cfg: GraftConfig, root_slot: int, first_width: int):
        K, D = cfg.top_k, cfg.max_depth
        self.K, self.root_slot, self.widths = K, root_slot, [first_width]
        pool_max = K + (D - 1) * K * K
        self.tokens = torch.zeros(pool_max, dtype=torch.long, device=device)
        self.parents = torch.full((pool_max,), -1, dtype=torch.long, device=device)
        self.scores = torch.full((pool_max,), -math.inf, device=device)
        self.depths = torch.zeros(pool_max, dtype=torch.long, device=device)
        self.slots = torch.full((pool_max,), -1, dtype=torch.long, device=device)
        # anc[s]: which scratch slots are ancestors-or-self of the node whose KV is in scratch slot s.
        n_scratch_max = K * (D - 1)
        self.anc = torch.zeros(n_scratch_max, n_scratch_max, dtype=torch.bool, device=device)
        self.frontier = None                  # pool ids of the nodes whose logits we hold; None = root
        self.frontier_scores = torch.zeros(1, device=device)
        self.child_par = None
        self.n = self.n_scratch = self.depth = 0

    def grow(self, logits: Tensor, log_tau: float, ops: Ops, vocab_map: Tensor | None) -> Tensor:
        """Add the next depth's children from the frontier's ``logits`` [F, V]; returns the stop flag
        (every new child below ``log_tau``), on the device."""
        self.depth += 1
        child_tok, child_par, child_score, nxt, stop = ops.draft_expand(self.frontier_scores, logits, self.K, log_tau)
        if vocab_map is not None:
            child_tok = vocab_map[child_tok]
        n, m = self.n, child_tok.shape[0]
        self.tokens[n:n + m], self.scores[n:n + m], self.depths[n:n + m] = child_tok, child_score, self.depth
        if self.frontier is not None:
            self.parents[n:n + m] = self.frontier[child_par]
        self.frontier, self.frontier_scores, self.child_par = n + nxt, child_score[nxt], child_par[nxt]
        self.n += m
        return stop

    def next_forward(self) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
        """The new frontier's forward: (tokens [F], each one's parent's row in the last forward,
        positions [F], its first scratch slot, its visibility [F, n_scratch + F] over the scratch
        slots from ``root_slot + 1``); the scratch slots are taken."""
        F, device = self.frontier.shape[0], self.tokens.device
        new = torch.arange(self.n_scratch, self.n_scratch + F, device=device)
        self.slots[self.frontier] = self.root_slot + 1 + new
        p = self.parents[self.frontier]
        rows = self.anc[(self.slots[p.clamp(min=0)] - self.root_slot - 1).clamp(min=0)] & (p >= 0)[:, None]
        rows[torch.arange(F, device=device), new] = True
        self.anc[new] = rows
        positions = torch.full((F,), self.root_slot + self.depth, dtype=torch.long, device=device)
        start = self.root_slot + 1 + self.n_scratch
        self.n_scratch += F
        self.widths.append(F)
        return self.tokens[self.frontier], self.child_par, positions, start, self.anc[new, :self.n_scratch]

    def pool(self) -> DraftPool:
        return DraftPool(self.tokens, self.parents, self.scores, self.depths, self.n, self.slots, tuple(self.widths))


class ModelDrafter:
    """A small drafter model with the target's tokenizer (its own KV cache, kept across steps)."""
    target_layers = None

    def __init__(self, model: Model, compile: bool = False):
        self.model, self.net = model, model.net
        self.step = StepForward(model.net, compile, dynamic=True)   # its forwards change width
        self.kv_len = 0          # committed tokens whose KV is in the drafter's cache

    def start(self, prompt: Tensor, max_len: int, features: Tensor | None, ops: Ops) -> None:
        self.net.setup_cache(max_len)
        n = prompt.shape[0]
        self.net(prompt[None], torch.arange(n, device=prompt.device), 0, last_only=True,
                 attention=ops.tree_attention)     # eager, like the target's prefill
        self.kv_len = n

    def draft(self, context: Tensor, length: int, cfg: GraftConfig, log_tau: float, ops: Ops) -> DraftPool:
        # Run the committed tokens not yet in the cache (the root last), then expand from the root.
        step, device, kv_len = self.step, self.model.device, self.kv_len
        P = length - kv_len
        logits = step(context[kv_len:length][None], torch.arange(kv_len, length, device=device),
                      kv_len, last_only=True, attention=ops.tree_attention)[0]      # [1, V]
        self.kv_len = length

        def forward(tokens, parent_rows, positions, start, attn_mask, mask_prefix):
            return step(tokens[None], positions, start, attn_mask=attn_mask, mask_prefix=mask_prefix,
                        attention=ops.tree_attention)[0]

        return expand(logits, P, forward, kv_len + P - 1, cfg, log_tau, ops)

    def commit(self, path: Tensor, path_slots: Tensor, path_slots_host: list[int], features: Tensor | None,
               ops: Ops) -> None:
        # Keep the KV of the path's longest drafted-and-run prefix (the rest stays pending and
        # runs in the next step's first forward).
        ran = [slot >= 0 for slot in path_slots_host[1:]] + [False]
        keep = ran.index(False)
        if keep:
            ops.commit_kv(self.net.kv, path_slots[1:1 + keep], self.kv_len)
        self.kv_len += keep


class Eagle3Drafter:
    """An EAGLE-3 head drafting from the target's fused features (see the module docstring).

    Head cache slot j holds entry j = (target features of committed x_j, token x_{j+1}), RoPE
    position j; a draft node at depth d under the root (committed index R) sits at position R - 1 + d.
    """

    def __init__(self, head: Eagle3Head):
        self.head = self.net = head
        self.target_layers = tuple(head.target_layers)
        self.kv_len = 0                  # entries in the head's cache
        self.features: Tensor | None = None   # [P, F] target features of committed[kv_len:kv_len + P]

    def start(self, prompt: Tensor, max_len: int, features: Tensor | None, ops: Ops) -> None:
        # Entries 0 .. n - 2 pair the prompt's features with its next tokens; the last one waits
        # for the root (the token after the prompt), the first step's forward.
        self.head.setup_cache(max_len)
        n = prompt.shape[0]
        if n > 1:
            self.head(prompt[None, 1:], torch.arange(n - 1, device=prompt.device), 0, last_only=True,
                      features=features[None, :n - 1], attention=ops.tree_attention)
        self.kv_len, self.features = n - 1, features[n - 1:]

    def draft(self, context: Tensor, length: int, cfg: GraftConfig, log_tau: float, ops: Ops) -> DraftPool:
        head, feats = self.head, self.features
        P = feats.shape[0]                       # == length - 1 - kv_len: every entry up to the root
        device = feats.device
        tokens = context[self.kv_len + 1:self.kv_len + 1 + P][None]
        # Logits over the head's draft vocabulary (often ~32k of 152k tokens): ranked there, the
        # K winners mapped to tokens (``expand``'s vocab_map), never scattered into a target-wide row.
        logits, hidden = head(tokens, torch.arange(self.kv_len, self.kv_len + P, device=device), self.kv_len,
                              last_only=True, features=feats[None], attention=ops.tree_attention,
                              draft_vocab=True)                                                  # [1, 1, Vd]
        root_slot = self.kv_len + P - 1
        self.kv_len += P
        self.features = feats[:0]
        state = {"hidden": hidden[0]}            # rows of the last forward, children's features

        def forward(tokens, parent_rows, positions, start, attn_mask, mask_prefix):
            lg, h = head(tokens[None], positions, start, attn_mask=attn_mask, mask_prefix=mask_prefix,
                         features=state["hidden"][parent_rows][None], attention=ops.tree_attention, draft_vocab=True)
            state["hidden"] = h[0]
            return lg[0]

        return expand(logits[0], P, forward, root_slot, cfg, log_tau, ops,
                      vocab_map=None if head.identity_vocab else head.draft_ids)

    def commit(self, path: Tensor, path_slots: Tensor, path_slots_host: list[int], features: Tensor | None,
               ops: Ops) -> None:
        # The accepted path's TARGET features (root .. last accepted node) pair with the tokens after
        # them (the accepted nodes, then the bonus); they run in the next step's first forward.
        self.features = torch.cat([self.features, features[path]])


def as_drafter(drafter: Model | Eagle3Head | Drafter | None, compile: bool = False) -> Drafter | None:
    """Wrap what a caller passes as ``drafter=`` into a ``Drafter``; ``compile``: a drafter model's
    step forwards run compiled (an EAGLE-3 head, one layer, always runs eagerly)."""
    if drafter is None:
        return None
    if isinstance(drafter, Eagle3Head):
        return Eagle3Drafter(drafter)
    if isinstance(drafter, Model):
        return ModelDrafter(drafter, compile)
    return drafter
