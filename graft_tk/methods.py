"""Methods as data: which candidate sources a decode step draws on, and whether drafting prunes.

A method is a frozen ``Method``; the names users type (``graft``, ``pld``, ...) are entries of
``METHODS``. Every method verifies the same budget N per step, so they compare at equal cost.
The sources (``graft_tk.sources``; the drafter is ``graft_tk.drafting``):

    draft          the drafter's token tree (EAGLE-2 style expansion, top-K per depth)
    adjacency      root-parallel retrieval from the token-successor matrix M (Token Recycling)
    prompt_lookup  the tokens that followed the last n-gram's latest earlier occurrence
    suffix         suffix decoding: what followed the latest occurrences of the longest repeated
                   suffix, several continuations merged into a trie

Whenever a method has several sources, the budget goes to the candidates likeliest to be accepted
(``graft_tk.acceptance`` estimates it online; ``build_tree`` allocates). ``prune``: drafting
stops where every frontier node falls below tau, and drafted nodes below tau are cut (dynamic
depth, the paper's "pruned" drafter); without it the drafter runs all D depths (EAGLE-2's tree).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

# The names methods may use: the drafter and the grafted sources (``graft_tk.sources.register``
# adds one from outside the package).
SOURCES = ["draft", "adjacency", "prompt_lookup", "suffix"]


def add_source_name(name: str) -> None:
    if name not in SOURCES:
        SOURCES.append(name)


@dataclass(frozen=True)
class Method:
    name: str
    sources: tuple[str, ...] = ()
    prune: bool = False

    def __post_init__(self):
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown:
            raise InputError(f"method {self.name!r} names unknown sources {unknown}; known: {', '.join(SOURCES)}")
        if self.prune and not self.drafts:
            raise InputError(f"method {self.name!r} prunes but does not draft")

    @property
    def drafts(self) -> bool:
        return "draft" in self.sources

    @property
    def speculates(self) -> bool:
        """False for plain decoding: the step's tree is the root alone."""
        return bool(self.sources)

    def uses(self, source: str) -> bool:
        return source in self.sources


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar"),                                                         # plain decoding
    Method("tree", ("draft",)),                                           # drafter tree of fixed depth D
    Method("pruned", ("draft",), prune=True),                             # dynamic depth; freed budget unused
    Method("retrieval", ("adjacency",)),                                  # Token Recycling
    Method("pld", ("prompt_lookup",)),                                    # prompt lookup
    Method("suffix", ("suffix",)),                                        # suffix decoding
    Method("tree+pld", ("draft", "prompt_lookup")),
    Method("retrieval+pld", ("adjacency", "prompt_lookup")),
    Method("graft-paper", ("draft", "adjacency"), prune=True),            # the paper's hybrid: drafter + M
    # The default: the pruned drafter and every retrieval source, the budget to the likeliest
    # candidates and the drafter run only where it pays (the draft gate, the cost policy).
    Method("graft", ("draft", "adjacency", "prompt_lookup", "suffix"), prune=True),
)}

# Names earlier versions used, and what they are now (``method`` says so in its error).
RENAMED = {"graft+suffix": "graft", "graft+pld": "graft (every source) or graft-paper (drafter + M)"}


def method(name: str | Method) -> Method:
    """The ``Method`` a name stands for (a Method passes through); InputError listing them if unknown."""
    if isinstance(name, Method):
        return name
    if name in RENAMED:
        raise InputError(f"method {name!r} is gone since graft_tk 0.5: use {RENAMED[name]}")
    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]
