"""Candidate sources grafted into the drafter's tree: what each proposes, and how it learns.

A source is a complete plug-in: everything the step does with it goes through the hooks of
``CandidateSource`` below, so the step, the batch and the engine never name one. It

* proposes, for every row of the batch, a fixed layout of C candidates (their template
  ``parents`` never change: -1 = a child of the root, else an earlier candidate of the source)
  with tokens (-1: none this step) and estimated log P(accepted | parent accepted, no drafted
  sibling accepted: ``build_tree`` multiplies in the share the drafted siblings leave);
* ``observe``s, after the verify, which of its nodes were accepted;
* may ``warm`` itself from a request's prompt at prefill (``warms_from_prompt``), own the
  successor table the accept op fills from the verify's logits (``successors``), give the draft
  gate its signal (``expected_accepted``), and save and restore its priors (``learnt``, and the
  constructor's ``priors``: graft-calibrate keeps them in the pair's profile, by source name).

The step concatenates the sources in registration order (an earlier source's node wins a token
two of them propose) and ``build_tree`` grafts them all onto the drafted tree in one op. The
drafter itself is the ``draft`` source (``graft_tk.drafting``): its pool is ranked by score
before anything is grafted; sources with ``reads_pool`` propose after it (the adjacency source
continues the drafted tips), the others before it, where the draft gate reads them.

A new source is a subclass of ``CandidateSource`` passed to ``register`` (from any module: the
tests register one of their own) and its name in the ``Method``s that use it.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..acceptance import Rates, SourcePriors
from ..config import GraftConfig
from ..errors import InputError
from ..methods import add_source_name
from ..ops import Ops
from ..tree import BuiltTree, add_source_code


class StepView(NamedTuple):
    """What a source may read of the step, every row at once (all on the device)."""
    roots: Tensor      # int64 [B]: each row's last committed token (the tree's root)
    context: Tensor    # int64 [B, L]: each row's committed tokens, context[b, :length[b]]
    length: Tensor     # int64 [B]
    # This step's drafted candidates (``graft_tk.drafting.DraftPool``; None: no row drafted, or
    # the source proposes before drafting):
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


class CandidateSource:
    """The hooks of a grafted source; the defaults are no-ops, so a source overrides what it uses.

    A subclass sets ``name`` (as methods name it) and, once ``register``ed, has its ``code``
    (the ``BuiltTree.source`` code of its nodes, the stats' key). Its constructor takes
    ``(config, ops, device, priors, vocab_size)``: ``priors`` is what ``learnt`` returned on a
    calibration run of the same pair (None: its generic guess)."""
    name: str = ""
    code: int = -1
    parents: Tensor                  # int32 [C]: template parent of each candidate
    reads_pool: bool = False         # ``propose`` reads the drafted pool (it runs after the drafter)
    warms_from_prompt: bool = False  # ``warm`` wants the prompt's last-layer states at prefill
    successors: Tensor | None = None  # int64 [V, k]: a table ``accept`` fills from the verify's logits
    gates: bool = False              # ``expected_accepted`` gives the draft gate its signal

    def __init__(self, config: GraftConfig, ops: Ops, device, priors: SourcePriors | None = None,
                 vocab_size: int = 0):
        self.ops, self.device = ops, device

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        """Its ``Rates`` (the state sets their decay)."""
        return ()

    def propose(self, view: StepView) -> Candidates:
        """This step's candidates for every row."""
        raise NotImplementedError

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        """Count the outcome: ``on_path`` bool [B, N] the accepted nodes, ``nodes`` int32 [B, C] the
        tree node each candidate landed on (-1: not in the tree), ``note`` as proposed."""

    def warm(self, prompt: Tensor, hidden: Tensor, head, start: int = 0) -> None:
        """A request's prompt as the target reads it (``warms_from_prompt``): ``prompt`` int64 [n]
        the whole prompt, ``hidden`` [m, dim] the target's last-layer states of its positions
        ``start .. start + m - 1`` (one chunk; called chunk by chunk, in order), ``head(hidden
        rows)`` their logits."""

    def expected_accepted(self, cand: Candidates) -> Tensor | None:
        """float32 [B]: the tokens its candidates are expected to get accepted, the draft gate's
        signal (``graft_tk.policy.DraftGate``); None: it gives none."""
        return None

    def learnt(self) -> SourcePriors | None:
        """The priors its counts support now (a host read), or None when it learns none."""
        return None

    def summary(self):
        """Its current estimates, for stats and reports (a host read)."""
        return None


_REGISTERED: dict[str, type[CandidateSource]] = {}   # in graft order: an earlier source owns a shared token


def register(cls: type[CandidateSource], *, before: str | None = None) -> type[CandidateSource]:
    """Make ``cls`` a source methods may name (``Method(name, ("draft", cls.name))``), grafted
    after the sources registered so far, or just before ``before``. Returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, CandidateSource)) or not cls.name:
        raise InputError(f"a source is a CandidateSource subclass with a name, got {cls!r}")
    if cls.name in _REGISTERED or cls.name == "draft":
        raise InputError(f"a source named {cls.name!r} is registered already; pick another name")
    if before is not None and before not in _REGISTERED:
        raise InputError(f"cannot register {cls.name!r} before {before!r}: no such source "
                         f"(registered: {', '.join(_REGISTERED)})")
    if cls.code < 0:
        cls.code = add_source_code(cls.name)
    add_source_name(cls.name)
    order = list(_REGISTERED.items())
    at = len(order) if before is None else [n for n, _ in order].index(before)
    order.insert(at, (cls.name, cls))
    _REGISTERED.clear()
    _REGISTERED.update(order)
    return cls


def registered() -> dict[str, type[CandidateSource]]:
    """Name -> class of every grafted source, in graft order."""
    return dict(_REGISTERED)


from .prompt_lookup import PromptLookupSource  # noqa: E402  (they subclass CandidateSource)
from .suffix import SuffixSource  # noqa: E402
from .adjacency import AdjacencySource  # noqa: E402

# Order: prompt lookup first: its chain, its rates and the DraftGate reading them stay as they
# are beside suffix decoding, whose counts are then what it adds; both before M's candidates,
# which match the text less closely.
for _cls in (PromptLookupSource, SuffixSource, AdjacencySource):
    register(_cls)

__all__ = ["CandidateSource", "Candidates", "StepView", "register", "registered", "AdjacencySource",
           "PromptLookupSource", "SuffixSource"]
