"""EAGLE-3 draft heads: one decoder layer over fused target features, a reduced draft vocabulary.

An EAGLE-3 head (Li et al., arXiv 2503.01840) drafts from the *target's* hidden states instead of
running a separate small model. For one entry it reads

  * ``features``: the target's residual stream after three of its layers (low, middle, high;
    ``Eagle3Head.target_layers``), concatenated, ``[n * target_dim]``, for token x_t, fused to the
    head's width by ``fc``; or, deeper in the draft tree, the head's own ``hidden`` output of the
    parent node, ``[hidden]``, used as is (EAGLE-3 feeds its own output back);
  * the embedding of the NEXT token x_{t+1} (the target's embedding table, shared, not copied);

and predicts x_{t+2}. The layer's attention reads ``[embed_norm(emb), hidden_norm(h)]``
(``2 * hidden`` wide), then attention residual, MLP, final ``norm`` and ``lm_head`` over
``draft_vocab_size`` tokens; ``d2t`` maps draft id -> target id (``target = draft + d2t[draft]``).
``forward`` returns logits over the TARGET vocabulary (-inf outside the draft vocabulary), so the
drafting ops (``draft_expand``) run unchanged, plus the pre-norm hidden state for the children.

The head keeps its own static KV cache ``kv[1, 2, B, Hkv, S, Dh]`` and takes the same tree-mask
arguments as ``Transformer.forward`` (tokens, positions, an ``AttentionPlan``). RoPE is
relative, so any constant position offset between the (feature, next token) pairs and the target's
positions gives the same logits.

Checkpoints: ``eagle3_checkpoint.py`` (load_eagle3 / save_eagle3, published layouts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from ..reference.tree_attention import tree_attention as reference_attention
from .attention import AttentionPlan
from .transformer import (Attention, FeedForward, ModelConfig, RMSNorm, Transformer, ensure_cache, rope_inv_freq,
                          select_positions)

__all__ = ["Eagle3Config", "Eagle3Head", "default_target_layers"]


def default_target_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high target layers for an ``n_layers`` target (outputs, 0-based)."""
    layers = (1, n_layers // 2 - 1, n_layers - 4)
    if min(layers) < 0:
        raise InputError(f"a {n_layers}-layer target is too shallow for EAGLE-3's default layers "
                         f"(1, L//2 - 1, L - 4); pass target_layers explicitly")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig          # the decoder layer: dim = head hidden size, vocab_size = TARGET vocab
    target_hidden_size: int
    draft_vocab_size: int
    target_layers: tuple[int, ...]
    norm_before_residual: bool = False   # speculators variant: the residual is hidden_norm(h)

    @property
    def hidden_size(self) -> int:
        return self.layer.dim

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def fused_size(self) -> int:
        return len(self.target_layers) * self.target_hidden_size

    def __post_init__(self):
        if self.layer.arch != "llama":
            raise ValueError(f"an EAGLE-3 layer is a llama layer, got arch {self.layer.arch!r}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if not self.target_layers:
            raise ValueError("target_layers is empty")
        if self.fused_size == self.hidden_size:
            # forward tells target features from fed-back head states by their width
            raise ValueError(f"fused feature width {self.fused_size} equals hidden_size; unsupported")

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None,
                   target_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None,
                   norm_before_residual: bool = False) -> Eagle3Config:
        """A head the way EAGLE-3 trains one: the target's width, heads and RoPE, one layer."""
        layer = ModelConfig(
            arch="llama", vocab_size=target.vocab_size, dim=target.dim, n_layers=1, n_heads=target.n_heads,
            n_kv_heads=target.n_kv_heads, head_dim=target.head_dim,
            intermediate_size=intermediate_size or target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
            tie_word_embeddings=False, rope_scaling=target.rope_scaling)
        return cls(layer, target.dim, draft_vocab_size or target.vocab_size,
                   tuple(target_layers or default_target_layers(target.n_layers)), norm_before_residual)


class Eagle3Layer(nn.Module):
    """The decoder layer; our Attention / FeedForward, with q/k/v reading 2 * hidden inputs."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.embed_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)     # published: input_layernorm
        self.hidden_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        a = self.attention
        self.attention.wqkv = nn.Linear(2 * cfg.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)       # published: post_attention_layernorm
        self.feed_forward = FeedForward(cfg)

    def attention_input(self, emb: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """-> (the attention's input [.., 2 * hidden], the residual stream [.., hidden])."""
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        return torch.cat([self.embed_norm(emb), normed], dim=-1), residual   # embedding first, as published

    def mlp(self, h: Tensor) -> Tensor:
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, emb, h, cos, sin, kv, layer, plan, attention):
        x, residual = self.attention_input(emb, h)
        return self.mlp(residual + self.attention(x, cos, sin, kv, layer, plan, attention))


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head. ``embedding``: the target's token embedding weight [V, hidden] to
    share (not saved, not moved by ``.to()``); None = the head owns one (``tok_embeddings``)."""

    # The same cache bookkeeping as the Transformer's (they only touch self.kv).
    cache_len = Transformer.cache_len
    cache_rows = Transformer.cache_rows

    def __init__(self, cfg: Eagle3Config, embedding: Tensor | None = None):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        if embedding is None:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, H)
        else:
            if tuple(embedding.shape) != (cfg.vocab_size, H):
                raise InputError(f"embedding is {list(embedding.shape)}, the head needs [{cfg.vocab_size}, {H}]")
            self.tok_embeddings = None
            self._shared_embedding = embedding.detach()   # a plain tensor: no copy, not a parameter
        self.fc = nn.Linear(cfg.fused_size, H, bias=False)
        self.layer = Eagle3Layer(cfg.layer, cfg.norm_before_residual)
        self.norm = RMSNorm(H, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer), persistent=False)
        # The vocabulary map is set through set_vocab_map only (validated); identity by default.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size, persistent=False)
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size), persistent=False)
        self._identity_vocab = cfg.draft_vocab_size == cfg.vocab_size
        self.kv: Tensor | None = None   # [1, 2, B, Hkv, S, Dh], see setup_cache
        self.rope = None                 # RopeTable, see setup_cache
        self.name: str = "eagle3"          # load_eagle3 sets name and path; profiles key on them
        self.path: Path | None = None

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    @property
    def identity_vocab(self) -> bool:
        """Draft id i is token i for every token: the head's logits are over the target vocabulary."""
        return self._identity_vocab

    @property
    def embedding_weight(self) -> Tensor:
        return self._shared_embedding if self.tok_embeddings is None else self.tok_embeddings.weight

    def set_vocab_map(self, d2t: Tensor) -> None:
        """Set ``d2t`` [draft_vocab] (target id = draft id + d2t); ``t2d`` follows from it."""
        c = self.config
        d2t = torch.as_tensor(d2t).to(device=self.lm_head.weight.device, dtype=torch.long)
        if tuple(d2t.shape) != (c.draft_vocab_size,):
            raise InputError(f"d2t is {list(d2t.shape)}, expected [{c.draft_vocab_size}] (draft_vocab_size)")
        ids = torch.arange(c.draft_vocab_size, device=d2t.device) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise InputError(f"d2t maps draft ids to [{int(ids.min())}, {int(ids.max())}], outside the "
                             f"target vocabulary [0, {c.vocab_size})")
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=d2t.device)
        t2d[ids] = True
        if int(t2d.sum()) != c.draft_vocab_size:
            raise InputError("d2t maps two draft ids to the same target id")
        self.d2t, self.t2d, self.draft_ids = d2t, t2d, ids
        self._identity_vocab = bool((d2t == 0).all()) and c.draft_vocab_size == c.vocab_size

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Allocate the static KV cache and RoPE table; kept when already large enough for this batch."""
        a = self.layer.attention
        ensure_cache(self, 1, batch_size, a.n_kv_heads, max_seq_len, a.head_dim, self.lm_head.weight)

    def forward(self, tokens: Tensor, positions: Tensor, plan: AttentionPlan | int, logits_at: int | Tensor | None = None,
                *, features: Tensor, attention: Callable | None = None, draft_vocab: bool = False
                ) -> tuple[Tensor, Tensor]:
        """Run new entries against the head's cache (``plan``, ``logits_at`` as ``Transformer.forward``).

        tokens:   [B, T] the token of each entry (the one AFTER the token the features describe)
        features: [B, T, n * target_dim] target features (``Transformer.forward(hidden_layers=
                  head.target_layers)``), fused by ``fc``; or [B, T, hidden], the head's own
                  ``hidden`` output of each entry's parent, used as is
        returns   (logits [B, T, V] float32 over the target vocabulary, -inf outside the draft
                  vocabulary; hidden [B, T, hidden], the pre-norm output to feed to children);
                  logits_at keeps that entry of both
        draft_vocab: logits over the draft vocabulary [B, T, draft_vocab_size] instead, not
                  scattered into a target-wide row (``draft_ids`` maps a draft id to its token):
                  a drafter ranks these and maps only the K winners
        """
        c = self.config
        B, T = tokens.shape
        if self.kv is None:
            raise RuntimeError("the head has no KV cache; call setup_cache first")
        if isinstance(plan, int):
            if plan + T > self.cache_len:
                raise RuntimeError(f"KV cache holds {self.cache_len} slots; call setup_cache(>= {plan + T})")
            plan = AttentionPlan.causal(plan, B, T, tokens.device)
        plan.check(B, T, self.cache_len)
        if features.shape[:2] != tokens.shape or features.shape[-1] not in (c.fused_size, c.hidden_size):
            raise InputError(f"features must be [B, T, {c.fused_size}] (target) or [B, T, {c.hidden_size}] "
                             f"(head), got {list(features.shape)} for tokens {list(tokens.shape)}")
        if positions.dim() == 1:
            positions = positions[None].expand(B, -1)
        w = self.fc.weight
        h = features.to(w.dtype)
        if h.shape[-1] == c.fused_size:
            h = self.fc(h)
        emb = F.embedding(tokens, self.embedding_weight).to(w.dtype)
        h = self.layer(emb, h, *self.rope.at(positions), self.kv, 0, plan, attention or reference_attention)
        h = select_positions(h, logits_at)
        draft = F.linear(self.norm(h), self.lm_head.weight).float()   # [B, T, draft_vocab]
        if self._identity_vocab or draft_vocab:
            return draft, h
        logits = draft.new_full((*draft.shape[:-1], c.vocab_size), -math.inf)
        return logits.index_copy_(-1, self.draft_ids, draft), h
