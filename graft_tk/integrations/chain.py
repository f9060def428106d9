"""Graft as one chain per request: the proposer for engines whose verifier takes a chain, not a tree.

vLLM (``graft_tk.integrations.vllm``) verifies at most ``k`` proposed tokens per request, in a
line. Graft's idea still applies, in one dimension: the drafter stops where it is unsure, and the
places it leaves are filled with retrieved tokens that cost no forward. Each step, for every
request of the batch:

1. **Observe** what the engine accepted of the previous proposal (``len(sampled) - 1`` tokens)
   and count it for the source of every position tried: drafter, prompt lookup, M.
2. **Prompt lookup**: the tokens after the latest earlier match of the context's last n-gram
   (``ops.prompt_lookup``), each valued by the online rate at which that position is accepted
   after a match of that length.
3. **Draft less**: the drafter runs only where prompt lookup's chain is expected to accept fewer
   tokens than a drafted chain has been accepting (a decayed mean). It drafts greedily (one
   child per depth: ``ModelDrafter`` with K = 1, every drafting request in one forward per
   depth) and stops where the chain's drafter probability falls below ``tau`` (the calibrated
   dynamic depth).
4. **Retrieve more**: either chain is continued from its last token by the target's own
   successor matrix M (column 0: the token the target last ranked first after it), each token
   valued by the online rate of its position, while the chain's estimated probability stays at
   or above ``fill_min``.
5. **Choose** the chain with the larger expected number of accepted tokens (the sum of its
   prefix probabilities) and propose it.

M is written from the target's verification logits (``observe_logits``), the rule of
``graft_tk.adjacency.update_adjacency``. Per-request state (the drafter's cache row, the last
proposal) is keyed by the engine's request ids and freed by ``forget``.

Everything here is on the host or in one drafter forward per depth: an engine's proposer runs
between target forwards, on the lists the engine hands it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..acceptance import PRIOR_WEIGHT, Rates
from ..adjacency import new_adjacency, update_adjacency
from ..drafting import DraftRequest, ModelDrafter, drafter_cache_slots
from ..errors import InputError
from ..models import Model
from ..ops import ops_for
from ..tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, SOURCE_NAMES

CATCH_UP_ALONE = 16    # a request whose drafter cache lags more tokens than this prefills alone


@dataclass(frozen=True)
class ChainConfig:
    k: int                   # tokens proposed per request at most (the engine's num_speculative_tokens)
    max_len: int             # the engine's longest sequence (prompt + output)
    tau: float = 0.1         # the drafter stops where its chain's probability falls below tau
    fill_min: float = 0.05   # a retrieved token joins while P(the chain up to it accepted) >= fill_min
    pld_max_ngram: int = 3   # longest suffix n-gram prompt lookup matches (down to 1)
    draft: bool = True       # False: prompt lookup and M only (no drafter forward)

    def __post_init__(self):
        for name in ("k", "max_len", "pld_max_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"ChainConfig.{name} must be an int >= 1, got {value!r}")
        if not 0.0 < self.tau <= 1.0:
            raise InputError(f"ChainConfig.tau must be in (0, 1], got {self.tau!r}")
        if not 0.0 < self.fill_min <= 1.0:
            raise InputError(f"ChainConfig.fill_min must be in (0, 1], got {self.fill_min!r}")


@dataclass
class _Row:
    """One request's state in its drafter cache row."""
    req_id: str
    base: int = 0                  # committed tokens when the drafter last ran
    fed: list[int] = field(default_factory=list)   # drafted tokens whose K/V the cache holds after ``base``
    proposal: list[tuple[int, int]] = field(default_factory=list)   # (source, rate cell) per proposed token
    drafted: bool = False          # the proposal came from the drafter's chain


@dataclass
class ChainStats:
    steps: int = 0                 # propose calls
    proposals: int = 0             # requests given a non-empty chain
    drafter_rows: int = 0          # requests the drafter ran for
    drafter_forwards: int = 0      # drafter forwards (each covers every drafting request)
    proposed: dict[str, int] = field(default_factory=dict)   # tokens proposed, by source
    tried: dict[str, int] = field(default_factory=dict)      # tokens verified (none before them rejected), by source
    accepted: dict[str, int] = field(default_factory=dict)   # tokens accepted, by source
    verified: int = 0              # proposals whose outcome was observed
    adjacency_rows: int = 0        # target logits rows written into M

    def as_dict(self) -> dict:
        return dict(self.__dict__, accepted_per_proposal=sum(self.accepted.values()) / max(self.verified, 1))


class ChainProposer:
    """Graft's proposals as one chain per request (see the module docstring).

    ``drafter``: a graft_tk model with the target's tokenizer (None: prompt lookup and M only).
    ``vocab_size``: the target's vocabulary (M's rows).
    """

    def __init__(self, config: ChainConfig, vocab_size: int, drafter: Model | None = None,
                 device: torch.device | str = "cpu"):
        self.config, self.device = config, torch.device(device)
        self.ops = ops_for("auto", self.device)
        self.matrix = new_adjacency(vocab_size, 1, self.device)      # M[:, 0]: the target's top successor
        self.drafter = ModelDrafter(drafter) if drafter is not None and config.draft else None
        self.rows: list[_Row | None] = []
        k, G = config.k, config.pld_max_ngram
        # graft_tk.acceptance's online rates (decayed counts and a prior), host tensors
        rates = lambda prior: Rates(prior, torch.full_like(prior, PRIOR_WEIGHT))   # noqa: E731
        # P(position i accepted | i - 1 accepted) after a match of length g + 1: cell g * k + i
        self.pld_rates = rates((0.3 + 0.2 * torch.arange(G)).clamp(max=0.7)[:, None].repeat(1, k))
        self.fill_rates = rates(torch.full((k,), 0.4))     # M's token at the j-th place after a chain
        self.draft_gain = rates(torch.ones(1))             # tokens a drafted chain gets accepted (a mean)
        self.stats = ChainStats()

    # ------------------------------------------------------------------ the engine's calls
    def propose(self, req_ids: list[str], sampled: list[list[int]], num_tokens, token_ids) -> list[list[int]]:
        """One chain per batch row: ``req_ids[b]`` the row's request, ``sampled[b]`` the tokens the
        last step committed for it (empty: the row is mid-prefill, nothing to propose),
        ``token_ids[b, :num_tokens[b]]`` its committed tokens."""
        cfg, B = self.config, len(sampled)
        if len(req_ids) < B:
            raise InputError(f"{B} rows of sampled tokens but {len(req_ids)} request ids")
        self.stats.steps += 1
        self._arrange(req_ids[:B])
        lengths = [int(n) for n in np.asarray(num_tokens[:B])]
        live = [bool(s) and 0 < n < cfg.max_len for s, n in zip(sampled, lengths)]
        self._observe([(self.rows[b], len(sampled[b]) - 1) for b in range(B) if sampled[b]])
        out: list[list[int]] = [[] for _ in range(B)]
        if not any(live):
            return out
        width = max(n for n, ok in zip(lengths, live) if ok)
        context = torch.as_tensor(np.asarray(token_ids[:B, :width]), device=self.device).long()
        length = torch.tensor(lengths, device=self.device).clamp(max=width)

        # Prompt lookup for every row, then the drafter where prompt lookup is the weaker bet.
        pl_tokens, ngram = self.ops.prompt_lookup(context, length, cfg.pld_max_ngram, 1, cfg.k)
        pl_tokens, ngram = pl_tokens.tolist(), ngram.tolist()
        pld_rate, fill_rate = self.pld_rates.rate().tolist(), self.fill_rates.rate().tolist()
        chains = [self._prompt_lookup_chain(pl_tokens[b], ngram[b], context[b, lengths[b] - 1].item(),
                                            pld_rate, fill_rate)
                  if live[b] else None for b in range(B)]
        gain = self.draft_gain.rate().item()
        drafting = [live[b] and self.drafter is not None and _expected(chains[b][1]) < gain for b in range(B)]
        if any(drafting):
            for b, chain in zip(range(B), self._draft(context, lengths, drafting, fill_rate)):
                if chain is not None and _expected(chain[1]) > _expected(chains[b][1]):
                    chains[b] = chain
        for b in range(B):
            row = self.rows[b]
            row.proposal, row.drafted = [], False
            if not live[b]:
                continue
            tokens, values, cells = chains[b]
            out[b] = tokens
            row.proposal = cells
            row.drafted = any(source == DRAFT for source, _ in cells)
            if tokens:
                self.stats.proposals += 1
            for source, _ in cells:
                name = SOURCE_NAMES[source]
                self.stats.proposed[name] = self.stats.proposed.get(name, 0) + 1
        return out

    def observe_logits(self, tokens: Tensor, logits: Tensor) -> None:
        """M learns from a verification: ``logits[i]`` [N, V] are the target's at an input token
        ``tokens[i]`` [N] (the row before each proposed token, and after the last)."""
        tokens = tokens.to(self.device).long()
        logits = logits[:, :self.matrix.shape[0]].to(self.device)
        update_adjacency(self.matrix, tokens, logits)
        self.stats.adjacency_rows += int(tokens.shape[0])

    def forget(self, req_ids) -> None:
        """Drop the state of finished or preempted requests (their cache rows become free)."""
        gone = set(req_ids)
        for i, row in enumerate(self.rows):
            if row is not None and row.req_id in gone:
                self.rows[i] = None

    @property
    def live_requests(self) -> list[str]:
        return [row.req_id for row in self.rows if row is not None]

    # ------------------------------------------------------------------ chains
    def _prompt_lookup_chain(self, tokens: list[int], ngram: int, root: int, pld_rate: list[list[float]],
                             fill_rate: list[float]):
        """(tokens, P(prefix accepted) per token, (source, rate cell) per token): prompt lookup's
        chain, cut where its value falls below fill_min, continued by M."""
        g = max(ngram, 1) - 1
        out, values, cells, value = [], [], [], 1.0
        for i, t in enumerate(tokens):
            value *= pld_rate[g][i]
            if t < 0 or value < self.config.fill_min:
                break
            out.append(t)
            values.append(value)
            cells.append((PROMPT_LOOKUP, g * self.config.k + i))
        return self._fill(out, values, cells, out[-1] if out else root, fill_rate)

    def _fill(self, tokens: list[int], values: list[float], cells: list, last: int, rate: list[float]):
        """Continue a chain from its last token along M's top successors (``rate``: per place)."""
        value = values[-1] if values else 1.0
        column = self.matrix[:, 0]
        for j in range(self.config.k - len(tokens)):
            t = int(column[last])
            value *= rate[j]
            if t < 0 or value < self.config.fill_min:
                break
            tokens.append(t)
            values.append(value)
            cells.append((RETRIEVAL, j))
            last = t
        return tokens, values, cells

    def _draft(self, context: Tensor, lengths: list[int], drafting: list[bool], fill_rate: list[float]):
        """The drafter's greedy chain for every drafting row, cut at tau and continued by M (None elsewhere)."""
        cfg, drafter, B = self.config, self.drafter, len(lengths)
        self._reserve(B, max(lengths))
        for b in range(B):
            if drafting[b]:
                drafter.kv_len[b] = self._catch_up(b, context[b, :lengths[b]], lengths[b])
        log_tau = math.log(cfg.tau)
        pool = drafter.draft(DraftRequest(context, lengths, drafting, [log_tau] * B, 1, cfg.k), self.ops)
        self.stats.drafter_forwards += len(pool.widths)
        tokens, scores, n = pool.tokens.tolist(), pool.scores.tolist(), pool.n.tolist()
        chains = []
        for b in range(B):
            if not drafting[b]:
                chains.append(None)
                continue
            self.stats.drafter_rows += 1
            row = self.rows[b]
            row.base, row.fed = lengths[b], tokens[b][:max(pool.forwards[b] - 1, 0)]
            out, values, cells = [], [], []
            for i in range(n[b]):
                if scores[b][i] < log_tau:
                    break
                out.append(tokens[b][i])
                values.append(math.exp(scores[b][i]))
                cells.append((DRAFT, i))
            root = int(context[b, lengths[b] - 1])
            chains.append(self._fill(out, values, cells, out[-1] if out else root, fill_rate))
        return chains

    def _catch_up(self, b: int, context: Tensor, n: int) -> int:
        """Bring row b's drafter cache to within a few tokens of its n committed tokens; returns
        how many it then holds (at most n - 1: the draft's catch-up runs the last one)."""
        row, net = self.rows[b], self.drafter.net
        held = row.base
        fed = context[row.base:n].tolist()
        for t, f in zip(fed, row.fed):
            if t != f:
                break
            held += 1
        held = min(held, n - 1) if row.base else 0
        if n - 1 - held > CATCH_UP_ALONE:     # a new request, or a long gap: a prefill of its own
            with torch.inference_mode(), net.cache_rows(b, b + 1):
                net(context[None, held:n - 1], torch.arange(held, n - 1, device=self.device), held,
                    logits_at=-1, attention=self.ops.tree_attention)
            held = n - 1
        row.base, row.fed = held, []
        return held

    # ------------------------------------------------------------------ bookkeeping
    def _observe(self, outcomes: list[tuple[_Row, int]]) -> None:
        """Count each row's last proposal, of which the first ``accepted`` tokens were accepted, and
        decay every rate once (one ``Rates.count`` per table per step)."""
        seen = {PROMPT_LOOKUP: [], RETRIEVAL: [], "gain": []}     # (cell, tried, accepted) per count
        for row, accepted in outcomes:
            if not row.proposal:
                continue
            self.stats.verified += 1
            for p, (source, cell) in enumerate(row.proposal[:accepted + 1]):
                name = SOURCE_NAMES[source]
                self.stats.tried[name] = self.stats.tried.get(name, 0) + 1
                if p < accepted:
                    self.stats.accepted[name] = self.stats.accepted.get(name, 0) + 1
                if source in seen:            # drafted tokens are valued by the drafter's own probabilities
                    seen[source].append((cell, 1.0, float(p < accepted)))
            if row.drafted:
                seen["gain"].append((0, 1.0, float(min(accepted, len(row.proposal)))))
            row.proposal = []
        for key, rates in ((PROMPT_LOOKUP, self.pld_rates), (RETRIEVAL, self.fill_rates), ("gain", self.draft_gain)):
            cells, tried, accepted = zip(*seen[key]) if seen[key] else ((), (), ())
            rates.count(torch.tensor(cells, dtype=torch.long), torch.tensor(tried), torch.tensor(accepted))

    def _arrange(self, req_ids: list[str]) -> None:
        """Put request ``req_ids[b]`` in row b (the drafter drafts rows 0 .. B - 1 of its cache):
        rows are swapped; a new request takes a free row, else the row of a request not in this
        batch (its cache refills on its first draft)."""
        while len(self.rows) < len(req_ids):
            self.rows.append(None)
        if self.drafter is not None:
            self._reserve(len(self.rows))
        where = {row.req_id: i for i, row in enumerate(self.rows) if row is not None}
        for b, rid in enumerate(req_ids):
            j = where.get(rid)
            if j is None:
                unplaced = set(req_ids[b:])
                free = [i for i in range(b, len(self.rows)) if self.rows[i] is None]
                spare = [i for i in range(b, len(self.rows)) if self.rows[i].req_id not in unplaced] if not free else []
                if not free and not spare:
                    self.rows.append(None)
                    if self.drafter is not None:
                        self._reserve(len(self.rows))
                    free = [len(self.rows) - 1]
                j = (free or spare)[0]
                if self.rows[j] is not None:
                    del where[self.rows[j].req_id]
                self.rows[j] = _Row(rid)
            if j != b:
                self._swap(b, j)
                for i in (b, j):
                    if self.rows[i] is not None:
                        where[self.rows[i].req_id] = i

    def _swap(self, a: int, b: int) -> None:
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
        kv = self.drafter.net.kv if self.drafter is not None else None
        if kv is not None and max(a, b) < kv.shape[2]:
            kv[:, :, [a, b]] = kv[:, :, [b, a]]

    def _reserve(self, rows: int, tokens: int = 0) -> None:
        """A drafter cache of at least ``rows`` rows with room for ``tokens`` committed tokens; it
        grows with the longest request seen (not to the engine's max_len up front: a row of
        32k slots of a 0.5B drafter is 0.8 GB), and what existing rows hold is kept."""
        net, slots = self.drafter.net, drafter_cache_slots(tokens, 1, self.config.k)
        old = net.kv
        if old is not None and old.shape[2] >= rows:
            net.setup_cache(slots, old.shape[2])       # grows the slots if needed, rows kept
            return
        net.kv = None
        self.drafter.kv_len = []
        self.drafter.reserve(max(rows, len(self.rows)), max(slots, old.shape[4] if old is not None else 0))
        if old is not None:
            net.kv[:, :, :old.shape[2], :, :old.shape[4]] = old


def _expected(values: list[float]) -> float:
    """Expected accepted tokens of a chain whose prefix i is accepted with probability values[i]."""
    return float(sum(values))
