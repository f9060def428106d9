"""Token trees: ``Tree``, one validated tree, and ``BuiltTree``, a batch of them as the step builds them.

A tree of N nodes. Node 0 is the root: the last committed token, not yet in the target's KV
cache. Links are int32 node indices and parents precede children (``parents[i] < i``), so a
single forward sweep over the nodes sees every parent before its children and the ancestors
of a node are exactly the set bits of its mask row, in increasing index = increasing depth.

Worked example (6 nodes, prefix of 7 tokens already in the KV cache)::

    node     0   1   2   3   4   5          0 ─┬─ 1 ─┬─ 3 ── 5
    tokens   r   a   b   c   d   e             │     └─ 4
    parents -1   0   0   1   1   3             └─ 2
    depth    0   1   1   2   2   3

    attn_mask (row i attends to column j)   packed_mask (one int32 word, bit j = column j)
          0 1 2 3 4 5
      0 [ 1 . . . . . ]                     0b000001 =  1
      1 [ 1 1 . . . . ]                     0b000011 =  3
      2 [ 1 . 1 . . . ]                     0b000101 =  5
      3 [ 1 1 . 1 . . ]                     0b001011 = 11
      4 [ 1 1 . . 1 . ]                     0b010011 = 19
      5 [ 1 1 . 1 . 1 ]                     0b101011 = 43

    positions(prefix_len=7) = prefix_len + depth = [7, 8, 8, 9, 9, 10]
    leaf_paths()            = [[0, 2, -1, -1],     leaves in index order: 2, 4, 5;
                               [0, 1,  4, -1],     row = root -> leaf, padded with -1
                               [0, 1,  3,  5]]     to max_depth + 1 = 4 columns

Bit order of ``packed_mask``: column j is bit ``j % 32`` (LSB first) of word ``j // 32``, the
little-endian order flashinfer's packed custom masks use. Words are int32, so column 31 sets the
sign bit; a kernel reads the word as uint32 bits.

``validate`` is the one place the invariants are checked; it syncs with the host (``.tolist``)
and is meant for constructors on the CPU path and tests, not the decode hot path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor


# Node sources (int8 codes in ``Tree.source``): who proposed the node.
ROOT = 0
DRAFT = 1
RETRIEVAL = 2
PROMPT_LOOKUP = 3
SUFFIX = 4
# code -> name in stats; a source registered from outside the package gets the next code
# (``graft_tk.sources.register``). int8 codes: 127 at most.
SOURCE_NAMES = {ROOT: "root", DRAFT: "draft", RETRIEVAL: "retrieval", PROMPT_LOOKUP: "prompt_lookup",
                SUFFIX: "suffix"}


def add_source_code(name: str) -> int:
    """A new source's node code, named ``name`` in stats."""
    code = max(SOURCE_NAMES) + 1
    if code > 127:
        raise ValueError("no source code left (int8)")
    SOURCE_NAMES[code] = name
    return code

_DTYPES = {"tokens": torch.int64, "parents": torch.int32, "depth": torch.int32,
           "source": torch.int8, "scores": torch.float32}


@dataclass(frozen=True, eq=False)  # eq=False: elementwise tensor == would make `==` ambiguous
class Tree:
    """A token tree of N nodes, node 0 = root, parents before children.

    Attributes
    ----------
    tokens : Tensor, int64 [N]
        Token id of each node.
    parents : Tensor, int32 [N]
        Parent node index; -1 for the root, ``0 <= parents[i] < i`` otherwise.
    depth : Tensor, int32 [N]
        Distance from the root (root 0).
    source : Tensor, int8 [N]
        ``ROOT`` / ``DRAFT`` / ``RETRIEVAL`` / ``PROMPT_LOOKUP`` / ``SUFFIX``.
    scores : Tensor, float32 [N]
        Drafter cumulative log-prob; 0 for the root, -inf for nodes the drafter did not propose.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    source: Tensor
    scores: Tensor

    # ----------------------------------------------------------------- constructors
    @classmethod
    def root(cls, token: int | Tensor, device: torch.device | str = "cpu") -> "Tree":
        """The one-node tree holding only the root ``token`` (int, or int tensor of 0-dim or [1])."""
        tokens = torch.as_tensor(token, dtype=torch.int64, device=device).reshape(1)
        return cls(tokens=tokens,
                   parents=torch.full((1,), -1, dtype=torch.int32, device=device),
                   depth=torch.zeros(1, dtype=torch.int32, device=device),
                   source=torch.full((1,), ROOT, dtype=torch.int8, device=device),
                   scores=torch.zeros(1, dtype=torch.float32, device=device))

    @classmethod
    def from_lists(cls, tokens: Sequence[int] | Tensor, parents: Sequence[int] | Tensor,
                   source: Sequence[int] | Tensor | None = None, scores: Sequence[float] | Tensor | None = None,
                   device: torch.device | str = "cpu") -> "Tree":
        """Build and validate a tree from host lists (or tensors); ``depth`` is computed.

        source defaults to ROOT for node 0 and DRAFT for the rest; scores default to 0 for the
        root and -inf elsewhere. Raises ValueError when an invariant fails (see ``validate``).
        """
        tokens_l = [int(t) for t in (tokens.tolist() if isinstance(tokens, Tensor) else tokens)]
        parents_l = [int(p) for p in (parents.tolist() if isinstance(parents, Tensor) else parents)]
        n = len(tokens_l)
        if source is None:
            source = [ROOT] + [DRAFT] * (n - 1)
        if scores is None:
            scores = [0.0] + [float("-inf")] * (n - 1)
        # Depth in one forward sweep (parents precede children); a bad parent gets depth 0 here
        # and is reported by validate() with its index, instead of failing on an IndexError.
        depth_l: list[int] = []
        for i, p in enumerate(parents_l):
            depth_l.append(depth_l[p] + 1 if 0 <= p < i else 0)
        tree = cls(tokens=torch.tensor(tokens_l, dtype=torch.int64, device=device),
                   parents=torch.tensor(parents_l, dtype=torch.int32, device=device),
                   depth=torch.tensor(depth_l, dtype=torch.int32, device=device),
                   source=torch.as_tensor(source, device=device).to(torch.int8),
                   scores=torch.as_tensor(scores, device=device).to(torch.float32))
        tree.validate()
        return tree

    # ----------------------------------------------------------------- views
    @property
    def n(self) -> int:
        """Number of nodes N (from the shape: no host sync)."""
        return self.tokens.shape[0]

    def attn_mask(self) -> Tensor:
        """bool [N, N]: row i is True at i and at every ancestor of i.

        Pointer doubling, no host sync: after step s, ``mask`` holds ancestors at distance < 2**s
        and ``jump`` the 2**s-th ancestor (saturating at the root, whose parent is clamped to
        itself). Depth <= N - 1, so ceil(log2 N) steps close the relation: O(N^2 log N) work.
        """
        n = self.n
        idx = torch.arange(n, device=self.tokens.device)
        mask = idx[:, None] == idx[None, :]
        jump = self.parents.long().clamp(min=0)
        for _ in range((n - 1).bit_length()):
            mask = mask | mask[jump]
            jump = jump[jump]
        return mask

    def packed_mask(self) -> Tensor:
        """int32 [N, ceil(N / 32)]: ``attn_mask`` rows bit-packed, column j = bit j % 32 of word j // 32."""
        return pack_mask(self.attn_mask())

    def positions(self, prefix_len: int | Tensor) -> Tensor:
        """int64 [N]: position ids ``prefix_len + depth`` (siblings share a position)."""
        return self.depth.to(torch.int64) + prefix_len

    def leaf_paths(self) -> Tensor:
        """int32 [n_leaves, max_depth + 1]: node indices root -> leaf, padded with -1.

        Leaves (nodes that are nobody's parent) in increasing index order. The output shape
        depends on the data, so this syncs with the host; use it off the hot path.
        """
        n, dev = self.n, self.tokens.device
        is_parent = torch.zeros(n, dtype=torch.bool, device=dev)
        is_parent[self.parents[1:].long()] = True
        leaves = torch.nonzero(~is_parent).flatten()
        max_depth = int(self.depth.max())
        paths = torch.full((leaves.shape[0], max_depth + 1), -1, dtype=torch.int32, device=dev)
        # The ancestors of a leaf are the set bits of its mask row; node j sits in column depth[j].
        row, col = torch.nonzero(self.attn_mask()[leaves], as_tuple=True)
        paths[row, self.depth[col].long()] = col.to(torch.int32)
        return paths

    # ----------------------------------------------------------------- invariants
    def validate(self) -> None:
        """Raise ValueError naming the first broken invariant. Syncs with the host."""
        n = self.n
        for name, dtype in _DTYPES.items():
            t = getattr(self, name)
            if not isinstance(t, Tensor):
                raise ValueError(f"Tree.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"Tree.{name} must have shape [N={n}], got {list(t.shape)}")
            if t.dtype != dtype:
                raise ValueError(f"Tree.{name} must be {dtype}, got {t.dtype}")
            if t.device != self.tokens.device:
                raise ValueError(f"Tree.{name} is on {t.device}, tokens on {self.tokens.device}")
        if n < 1:
            raise ValueError("a Tree needs at least the root node (N >= 1), got N = 0")
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        depth, source = self.depth.tolist(), self.source.tolist()
        if parents[0] != -1:
            raise ValueError(f"root (node 0) must have parent -1, got {parents[0]}")
        if depth[0] != 0:
            raise ValueError(f"root (node 0) must have depth 0, got {depth[0]}")
        if source[0] != ROOT:
            raise ValueError(f"root (node 0) must have source ROOT={ROOT}, got {source[0]}")
        seen: dict[tuple[int, int], int] = {}
        for i in range(n):
            if tokens[i] < 0:
                raise ValueError(f"node {i} has token {tokens[i]}; token ids must be >= 0")
            if i == 0:
                continue
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede children (0 <= parent < {i})")
            if depth[i] != depth[p] + 1:
                raise ValueError(f"node {i} has depth {depth[i]} but its parent {p} has depth {depth[p]}")
            if source[i] not in SOURCE_NAMES or source[i] == ROOT:
                raise ValueError(f"node {i} has source {source[i]}; non-root nodes need DRAFT, RETRIEVAL, "
                                 f"PROMPT_LOOKUP or SUFFIX ({DRAFT}, {RETRIEVAL}, {PROMPT_LOOKUP}, {SUFFIX})")
            key = (p, tokens[i])
            if key in seen:
                raise ValueError(f"nodes {seen[key]} and {i} are both children of node {p} with token "
                                 f"{tokens[i]}; (parent, token) pairs must be unique")
            seen[key] = i


def pack_mask(mask: Tensor) -> Tensor:
    """bool [..., N, N] -> int32 [..., N, ceil(N / 32)]: column j = bit j % 32 of word j // 32."""
    *lead, n, cols = mask.shape
    words = (cols + 31) // 32
    wide = torch.zeros(*lead, n, words * 32, dtype=torch.int64, device=mask.device)
    wide[..., :cols] = mask.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64, device=mask.device)
    packed = (wide.view(*lead, n, words, 32) * weights).sum(-1)  # in [0, 2**32), exact in int64
    # Reinterpret as signed 32-bit two's complement explicitly (int64->int32 casts of values
    # >= 2**31 are not guaranteed to wrap on every backend).
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_mask(bits: Tensor, n: int) -> Tensor:
    """bool [..., N, n] from packed ancestor bits [..., N, W] (``pack_mask``'s layout)."""
    j = torch.arange(n, device=bits.device)
    return ((bits[..., j // 32] >> (j % 32)) & 1).bool()


class BuiltTree(NamedTuple):
    """``build_tree``'s outputs: one tree per batch row, fixed shapes (N = budget_n), each row's
    valid prefix ``n_nodes[b]``. The step's tree: what the target verifies and ``accept`` walks.

    Padding (entries ``n_nodes[b] .. N-1``) is inert: token -1, parent -1, depth 0, source -1,
    score -inf, pool_index -1, value -inf, and a mask row holding only its own bit, so an attention
    over all N rows never meets an empty row and no real row ever sees a padding column.
    """

    tokens: Tensor      # int64 [B, N]
    parents: Tensor     # int32 [B, N]  -1 for the root
    depth: Tensor       # int32 [B, N]
    source: Tensor      # int8 [B, N]   ROOT / DRAFT / RETRIEVAL / PROMPT_LOOKUP / SUFFIX (cand_source)
    scores: Tensor      # float32 [B, N] drafter score; 0 root, -inf grafted nodes
    pool_index: Tensor  # int64 [B, N]  pool entry of each drafted node, -1 otherwise
    mask: Tensor        # int32 [B, N, ceil(N/32)] ancestor bits (``pack_mask``'s layout)
    n_nodes: Tensor     # int64 [B]     valid prefix length
    cand_node: Tensor   # int32 [B, C]  tree node each candidate landed on (new or shared), -1 if not in the tree
    values: Tensor      # float32 [B, N] estimated log P(on the accepted path) the node was chosen by; 0 root, -inf padding

    def attn_mask(self) -> Tensor:
        """bool [B, N, N]: the ancestor-or-self mask (the verify's attention block)."""
        return unpack_mask(self.mask, self.tokens.shape[1])

    def row(self, b: int) -> Tree:
        """Row b's valid nodes as a validated ``Tree`` (reads the device: tests and tools)."""
        n = int(self.n_nodes[b])
        tree = Tree(tokens=self.tokens[b, :n], parents=self.parents[b, :n], depth=self.depth[b, :n],
                    source=self.source[b, :n], scores=self.scores[b, :n])
        tree.validate()
        return tree
