"""Candidate sources grafted into the drafter's tree: what each proposes, and how it learns.

A ``CandidateSource`` proposes, for every row of the batch, a fixed layout of C candidates (their
template ``parents`` never change: -1 = a child of the root, else an earlier candidate of the
source) with tokens (-1: none this step) and estimated log P(accepted | parent accepted, no drafted
sibling accepted: ``build_tree`` multiplies in the share the drafted siblings leave); after
the verify it ``observe``s which of its nodes were accepted. The step concatenates the sources in
``GRAFTED`` order (an earlier source's node wins a token two of them propose) and ``build_tree``
grafts them all onto the drafted tree in one op. The drafter itself is the ``draft`` source
(``graft_tk.drafting``): its pool is ranked by score before anything is grafted.

A new source is a module here with a class following the protocol, added to ``GRAFTED``, and its
name in the ``Method`` entries that use it (``graft_tk.methods``).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor

from ..tree import BuiltTree


class StepView(NamedTuple):
    """What a source may read of the step, every row at once (all on the device)."""
    roots: Tensor      # int64 [B]: each row's last committed token (the tree's root)
    context: Tensor    # int64 [B, L]: each row's committed tokens, context[b, :length[b]]
    length: Tensor     # int64 [B]
    # This step's drafted candidates (``graft_tk.drafting.DraftPool``; None: no row drafted):
    pool_tokens: Tensor | None = None   # int64 [B, P]
    pool_parents: Tensor | None = None  # int64 [B, P]: -1 = child of the root, else an earlier entry
    pool_depth: Tensor | None = None    # int64 [B, P]: root children 1
    pool_n: Tensor | None = None        # int64 [B]: valid entries of each row
    pool_values: Tensor | None = None   # float32 [B, P]: each entry's estimated log P(its path accepted)


class Candidates(NamedTuple):
    tokens: Tensor             # int64 [B, C]: -1 = no candidate there this step
    values: Tensor             # float32 [B, C]: log P(accepted | its parent accepted and no drafted sibling)
    note: Tensor | None = None  # what ``observe`` needs back (prompt lookup: the matched n-gram length;
                                # suffix: each candidate's rate cell)
    source: Tensor | None = None  # int8 [B, C]: the source code of each candidate (None: the source's
                                  # own code for all; a source re-proposing drafted nodes marks them DRAFT)


class CandidateSource(Protocol):
    name: str          # as methods name it (graft_tk.methods.SOURCES)
    code: int          # the ``Tree.source`` code of the nodes it adds
    parents: Tensor    # int32 [C]: template parent of each candidate
    rate_tables: tuple  # its ``graft_tk.acceptance.Rates`` (the engine sets their decay)

    def propose(self, view: StepView) -> Candidates:
        """This step's candidates for every row."""

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        """Count the outcome: ``on_path`` bool [B, N] the accepted nodes, ``nodes`` int32 [B, C] the
        tree node each candidate landed on (-1: not in the tree), ``note`` as proposed."""


from .adjacency import AdjacencySource  # noqa: E402  (the protocol above is what they implement)
from .prompt_lookup import PromptLookupSource  # noqa: E402
from .suffix import SuffixSource  # noqa: E402

# Order: an earlier source owns a token two propose (its node, its counts). Prompt lookup first:
# its chain, its rates and the DraftGate reading them stay as they were beside suffix decoding, whose
# counts are then what it adds; both before M's candidates, which match the text less closely.
GRAFTED = {"prompt_lookup": PromptLookupSource, "suffix": SuffixSource, "adjacency": AdjacencySource}

__all__ = ["CandidateSource", "Candidates", "StepView", "GRAFTED", "AdjacencySource", "PromptLookupSource",
           "SuffixSource"]
