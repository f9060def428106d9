"""The speculative decode loop: draft -> retrieve -> graft -> verify -> accept -> commit.

An ``Engine`` holds what should outlive one request: the target, the drafter, the config, the
token-successor adjacency matrix M and the acceptance estimates the budget is allocated by, so a
second request starts with both already warm.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from .acceptance import SCORE_EDGES, AcceptanceEstimates
from .backend import HOST_READS, LAUNCHES
from .compiled import StepForward
from .config import PRUNES, USES_DRAFTER, USES_PROMPT_LOOKUP, USES_RETRIEVAL, GraftConfig
from .drafting import DraftPool, Drafter, as_drafter, drafter_cache_slots
from .errors import InputError
from .models import Model
from .models.eagle3 import Eagle3Head
from .ops import ops_for
from .adjacency import new_adjacency, template_from_level_sizes, warm_adjacency
from .policy import StepPolicy
from .sampling import next_token
from .tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, ROOT, SOURCE_NAMES, BuiltTree, Tree
from .verify_chain import Verdict, VerifyChain, accept_and_commit

# Launched inside model forwards (the attention, its split-KV combine, quantized matmuls): not step ops.
FORWARD_KERNELS = ("_tree_attention_kernel", "_combine_splits_kernel", "_quant_matmul_kernel")
DEPTH_STAGE_KERNEL = "_draft_expand_partial_kernel"   # a depth's expansion over many programs (GPU): stage 1


class Engine:
    def __init__(self, target: Model, drafter: Model | Eagle3Head | None = None, config: GraftConfig | None = None,
                 backend: str = "auto", static_shapes: bool | None = None, compile: bool = False):
        # drafter: what the caller passed (a small Model or an EAGLE-3 head); drafting: it behind
        # the Drafter interface (start / draft / commit), the only way the loop talks to it.
        # compile: the step forwards of the target and of a drafter model run compiled
        # (graft_tk.compiled), which needs the fixed verify shape.
        if compile and static_shapes is False:
            raise InputError("compile=True verifies every tree at its fixed budget; drop static_shapes=False")
        self.target, self.drafter, self.drafting = target, drafter, as_drafter(drafter, compile)
        self.config = config or GraftConfig()
        self.ops = ops_for(backend, target.device)
        self.compile = compile
        self.target_step = StepForward(target.net, compile)
        # Verify every tree at the full budget N (padding masked, never accepted): one shape for
        # every step and no host read of the tree's size. The default on a GPU and when compiled;
        # on a CPU, where an eager verify costs nearly in proportion to its rows and a host read
        # is free, the exact size.
        if static_shapes is None:
            static_shapes = compile or target.device.type == "cuda"
        self.static_shapes = static_shapes
        self.template = template_from_level_sizes(self.config.template, self.config.retrieval_k).to(target.device)
        # M[V, k]: row t = the k tokens the target last ranked most likely after t (-1 = unknown).
        self.adjacency = new_adjacency(target.config.vocab_size, self.config.retrieval_k, target.device)
        # P(accepted) of each source's candidates, learnt online: what build_tree ranks the budget by.
        self.estimates = AcceptanceEstimates(self.template, self.config.pld_tokens, self.config.pld_max_ngram,
                                             target.device, self.config.priors)
        # With the device's cost model: depth and budget chosen per step by expected gain.
        self.policy = (StepPolicy(self.config.cost, self.config.budget, self.config.top_k, target.device,
                                  fixed_budget=static_shapes) if self.config.cost is not None else None)
        # Set to a list to record, per verified node, (source, depth, drafter score, accepted?):
        # graft-calibrate fits its score -> acceptance map from it. Off by default (host syncs).
        self.acceptance_log: list[tuple[int, int, float, bool]] | None = None

    def _candidate_layout(self, use_pld: bool, use_retrieval: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(parents, source, spans) of the grafted candidates: the prompt-lookup chain (node i under
        i - 1), then the retrieval template (parents shifted past the chain); spans[s] = the
        [start, end) of source s (pld, retrieval) in the list, None when unused."""
        device, L = self.target.device, self.config.pld_tokens
        parents = [torch.zeros(0, dtype=torch.long, device=device)]
        source = [torch.zeros(0, dtype=torch.long, device=device)]
        pld_span = retrieval_span = None
        if use_pld:
            parents.append(torch.arange(-1, L - 1, device=device))
            source.append(torch.full((L,), PROMPT_LOOKUP, device=device))
            pld_span = (0, L)
        if use_retrieval:
            shift = L if use_pld else 0
            tp = self.template.parents.long()
            parents.append(torch.where(tp < 0, -1, tp + shift))
            source.append(torch.full((self.template.n,), RETRIEVAL, device=device))
            retrieval_span = (shift, shift + self.template.n)
        return torch.cat(parents).to(torch.int32), torch.cat(source).to(torch.int8), (pld_span, retrieval_span)

    def generate(self, ids: list[int], method: str, max_new_tokens: int, temperature: float, top_p: float,
                 generator, on_tokens) -> tuple[list[int], dict]:
        """Speculative decoding of ``ids``: returns (new tokens, stats). The step, top to bottom:
        ``propose`` (draft, retrieve, graft: the tree), one target forward verifies it and
        ``accept`` moves the outcome into place on the device (accept, update M, write the
        context, move the KV: one ``VerifyChain`` program for a greedy fixed-shape step),
        ``settle`` (the estimates, the step's one host read, streaming, the drafter's commit).
        ``graft_tk.batch`` runs the same step for several requests with one forward."""
        tnet = self.target.net
        tnet.setup_cache(len(ids) + max_new_tokens + self.config.budget + 1)
        seq = self.begin(ids, method, max_new_tokens, temperature, top_p, generator, on_tokens)
        layers = seq.drafter.target_layers if seq.drafter is not None else None
        # A greedy fixed-shape step verifies, accepts and commits in one device program (a CUDA
        # graph on CUDA); otherwise the forward, then accept_and_commit.
        chain = (VerifyChain(tnet, self.ops, seq.budget, self.adjacency if method in USES_RETRIEVAL else None,
                             seq.context, layers, self.compile)
                 if seq.static_shapes and temperature == 0 and not seq.done else None)
        while not seq.done:
            proposal = self.propose(seq)
            # 7. Verify the whole tree in one target forward with tree attention (8-9's device part too, chained).
            t, tree, start = seq.stats.clock(), proposal.tree, seq.target_len
            if chain is not None:
                launches = LAUNCHES.snapshot()
                verdict = chain(proposal.built, start, seq.length)
                seq.step_launches += LAUNCHES.snapshot() - launches
            else:
                tokens = tree.tokens.clamp(min=0)[None]   # padding (token -1) runs as token 0, masked off
                logits, features = _forward(self.target_step, layers, tokens, tree.positions(start), start,
                                            attn_mask=tree.attn_mask(), mask_prefix=start,
                                            attention=self.ops.tree_attention)
                verdict = self.accept(seq, proposal, logits, features, tnet.kv, start)
            seq.stats.add_time("verify", t)
            self.settle(seq, proposal, verdict)
        stats = self.finish(seq)
        stats["verify_chain"] = ("off" if chain is None else "cuda graph" if chain.graph is not None else "eager")
        return seq.out, stats

    def begin(self, ids: list[int], method: str, max_new_tokens: int, temperature: float, top_p: float,
              generator, on_tokens, drafter: Drafter | None = None, batched: bool = False,
              speculating: bool = True, drafting: bool = True, max_budget: int | None = None) -> DecodeState:
        """A request's state, after its prefill into the target cache as it stands (the caller
        sized it, or shows one row of a batch's cache). ``drafter``: the request's own drafter
        state (a batch gives each row one); default the engine's. ``batched``: verified at the full
        budget with others (static shapes, no per-step policy). ``speculating=False``: it starts in
        a batch that does not speculate, so its prefill neither warms M nor starts its drafter;
        ``drafting=False``: it starts in one that speculates without drafting (D = 0), so its
        drafter does not start (the batch starts it when drafting begins). ``max_budget``: the
        largest tree a step may verify for it (a batch's policy may exceed the engine's N)."""
        cfg, ops, target, tnet = self.config, self.ops, self.target, self.target.net
        device = target.device
        cand_parents, cand_source, spans = self._candidate_layout(method in USES_PROMPT_LOOKUP,
                                                                   method in USES_RETRIEVAL)
        # D = 0 alone: no drafter at all (a batch keeps each row's, for the sizes that draft)
        drafter = (drafter or self.drafting) if method in USES_DRAFTER and (batched or cfg.max_depth > 0) else None
        # Adaptive (a cost model, a method that prunes): the drafting depth every step, and the
        # budget too where the verify's size may change (not with static shapes).
        policy = self.policy if method in PRUNES and not batched else None
        seq = DecodeState(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          generator=generator, on_tokens=on_tokens, drafter=drafter, policy=policy,
                          static_shapes=self.static_shapes or batched,
                          budget=1 if method == "ar" else cfg.budget,
                          log_tau=math.log(cfg.tau) if method in PRUNES else -math.inf,
                          cand_parents=cand_parents, cand_source=cand_source, spans=spans,
                          stats=_Stats(method, ops.backend, device), prompt_tokens=len(ids))
        n = len(ids)
        # Target features the drafter reads (EAGLE-3: fused low/mid/high layers), from every target forward.
        layers = drafter.target_layers if drafter is not None else None

        # Prefill: the last position's logits give the first token; with warm-up, every position's
        # last-layer state goes to warm M (its logits made a chunk at a time, never [n, V] at once).
        warm = speculating and method in USES_RETRIEVAL and cfg.warm_from_prefill
        prompt = torch.tensor([ids], device=device)
        taken = (*(layers or ()), tnet.config.n_layers - 1) if warm else layers
        logits, features = _forward(tnet, taken, prompt, torch.arange(n, device=device), 0, last_only=True,
                                    attention=ops.tree_attention)
        if warm:
            dim = tnet.config.dim
            warm_adjacency(self.adjacency, prompt[0], features[:, -dim:], tnet.logits)
            features = features[:, :-dim] if layers is not None else None
        if drafter is not None and speculating and drafting:
            drafter.start(prompt[0], drafter_cache_slots(n + max_new_tokens, cfg.top_k, cfg.max_depth), features, ops)
        seq.root = next_token(logits[-1:], temperature, top_p, generator)[0]   # on the device, as each step's bonus
        first = HOST_READS.read(seq.root)
        seq.out = [first]
        # The committed tokens on the device: context[:length] (prompt, then every committed token).
        # Prompt lookup searches it and a drafter reads its unseen tokens from it; the host keeps
        # only ``length`` and the tokens it streams.
        seq.context = torch.full((n + max_new_tokens + max(cfg.budget, max_budget or 0) + 1,), -1,
                                 dtype=torch.long, device=device)
        seq.context[:n] = prompt[0]
        seq.context[n] = seq.root
        seq.length = n + 1
        seq.target_len = n   # tokens whose KV is in the target cache; the root is the last committed
        seq.stats.prefill_seconds = time.perf_counter() - seq.t0
        seq.done = first in target.eos_token_ids or max_new_tokens <= 1
        if on_tokens and on_tokens([first]):
            seq.done = True
        # The score -> acceptance map the depth threshold reads (refreshed by each step's host read).
        seq.draft_rates = HOST_READS.read(self.estimates.draft_rates()) if policy is not None else None
        return seq

    def propose(self, seq: DecodeState, pool: DraftPool | None = None) -> Proposal:
        """Steps 1-6 for one request: its drafter's pruned tree, the prompt-lookup chain and
        root-parallel retrieval grafted into the freed budget, as one tree of ``seq.budget`` nodes.
        ``pool``: the drafter's candidates when they were drafted already (a batch drafts for all
        its requests at once)."""
        cfg, ops, estimates, policy, device = self.config, self.ops, self.estimates, seq.policy, self.target.device
        launches_before, reads_before = LAUNCHES.snapshot(), HOST_READS.count
        # 1-2. Draft with calibrated pruning: the drafter's candidate pool (empty without a drafter).
        t = seq.stats.clock()
        if pool is None and seq.drafter is not None and (policy is None or policy.should_draft()):
            step_tau = (seq.log_tau if policy is None
                        else policy.depth_log_tau(seq.draft_rates, SCORE_EDGES, seq.log_tau))
            pool = seq.drafter.draft(seq.context, seq.length, cfg, step_tau, ops)
        elif pool is None:
            pool = DraftPool.empty(device)
        seq.stats.add_time("draft", t)
        # 3-6. Candidates for the freed budget: the prompt-lookup chain and root-parallel retrieval
        # from M, each with its estimated acceptance; one op prunes and reranks the pool, grafts
        # the candidates, gives the N - 1 places to the likeliest nodes and emits the tree.
        t = seq.stats.clock()
        candidates, values, ngram = [], [], None
        if seq.method in USES_PROMPT_LOOKUP:
            chain, ngram = ops.prompt_lookup(seq.context, seq.length, cfg.pld_max_ngram, 1, cfg.pld_tokens)
            candidates.append(chain)
            values.append(estimates.pld_values(ngram))
        if seq.method in USES_RETRIEVAL:
            candidates.append(ops.retrieve(self.adjacency, seq.root, self.template))
            values.append(estimates.retrieval_values())
        cand_tokens = torch.cat(candidates) if candidates else torch.zeros(0, dtype=torch.long, device=device)
        cand_values = torch.cat(values) if values else torch.zeros(0, device=device)
        pool_values = estimates.draft_values(pool.scores)

        def build(budget: int):
            return ops.build_tree(pool.tokens, pool.parents, pool.scores, pool.depth, pool.n, seq.root, seq.log_tau,
                                  cand_tokens, seq.cand_parents, seq.cand_source, budget, pool_values, cand_values)

        built = build(seq.budget)
        if policy is not None and not seq.static_shapes:   # the best n of the tree built at N, then that tree
            budget = policy.budget(estimates.node_probs(built))
            if budget < seq.budget:
                built = build(budget)
        tree = built.as_tree() if seq.static_shapes else built.to_tree()   # to_tree: a host read
        seq.stats.add_time("retrieve", t)
        seq.step_launches = LAUNCHES.snapshot() - launches_before
        seq.stats.host_reads += HOST_READS.count - reads_before
        return Proposal(pool, built, tree, ngram)

    def accept(self, seq: DecodeState, proposal: Proposal, logits: torch.Tensor, features: torch.Tensor | None,
               kv: torch.Tensor, tree_start: int) -> Verdict:
        """Steps 8-9's device part for one request, from its verify ``logits`` [n, V]
        (``features`` for an EAGLE-3 drafter): accept, update M, write the new tokens to the
        context, move the path's KV from the tree's slots [tree_start, tree_start + n) of ``kv``
        to the prefix's end (what ``VerifyChain`` does in one program)."""
        tree, launches = proposal.tree, LAUNCHES.snapshot()
        uniforms = (torch.rand(tree.n, generator=seq.generator, device=logits.device)
                    if seq.temperature > 0 else None)
        path, n_path, bonus = accept_and_commit(
            self.ops, tree, logits, self.adjacency if seq.method in USES_RETRIEVAL else None, seq.temperature,
            seq.top_p, uniforms, seq.context, seq.length, kv, tree_start, seq.target_len)
        seq.step_launches += LAUNCHES.snapshot() - launches
        return Verdict(path, n_path, bonus, features)

    def settle(self, seq: DecodeState, proposal: Proposal, verdict: Verdict) -> None:
        """The rest of steps 8-9 for one request, once ``verdict`` is on the device (accepted,
        context written, target KV committed): update the acceptance estimates, read the step's
        outcome (one host read), stream the new tokens, bring the drafter up to date."""
        estimates, policy = self.estimates, seq.policy
        launches_before, reads_before = LAUNCHES.snapshot(), HOST_READS.count
        pool, built, tree = proposal.pool, proposal.built, proposal.tree
        path, n_path, bonus, features = verdict
        t = seq.stats.clock()
        seq.stats.expect(built, estimates.node_probs(built))   # before the update: a prediction
        pld_span, retrieval_span = seq.spans
        estimates.update(built, path, pld_span, proposal.ngram, retrieval_span)
        # One host read for all the host needs from this step: the path's length, its tokens,
        # the bonus, its nodes' drafter slots, sources and depths; the tree's nodes per source;
        # the refreshed score -> acceptance map when the policy reads it.
        p = path.clamp(min=0)
        node_slots = pool.slots_of(built.pool_index[:tree.n])
        (m, b), *per_node, nodes_by_source, rates = HOST_READS.read_many(
            torch.stack([n_path.long(), bonus.long()]), path, tree.tokens[p], node_slots[p], tree.source[p],
            tree.depth[p], torch.bincount(tree.source.long() + 1, minlength=len(SOURCE_NAMES) + 1)[1:],
            estimates.draft_rates() if policy is not None else path[:0])
        path_list, path_tokens, path_slots, path_source, path_depth = (x[:m] for x in per_node)
        seq.draft_rates = rates or seq.draft_rates
        path = path[:m]
        new = path_tokens[1:] + [b]
        # EOS inside the path and the max_new_tokens limit truncate what is committed.
        eos = self.target.eos_token_ids
        for i, tok in enumerate(new):
            if tok in eos or len(seq.out) + i + 1 >= seq.max_new_tokens:
                new, seq.done = new[:i + 1], True
                break
        seq.stats.record_step(path_source, path_depth, nodes_by_source, len(new), pool.forwards, tree.n)
        if policy is not None:
            policy.observe(len(new), tree.n, pool.widths, drafted=pool.forwards > 0,
                           drafted_accepted=path_source[1:].count(DRAFT))
        if self.acceptance_log is not None:
            on_path = set(path_list)
            source, depth, scores = HOST_READS.read(torch.stack([tree.source.float(), tree.depth.float(),
                                                                 tree.scores]))
            self.acceptance_log += [(int(s), int(d), sc, i in on_path)
                                    for i, (s, d, sc) in enumerate(zip(source, depth, scores)) if i > 0 and s >= 0]
        seq.length += len(new)
        seq.out += new
        if seq.on_tokens and seq.on_tokens(new):
            seq.done = True
        # 9. Commit (the target's KV is in place already): bring the drafter up to date (a small
        # model keeps the KV of accepted drafted nodes; an EAGLE-3 head keeps the path's target features).
        if not seq.done:
            seq.target_len += m
            if seq.drafter is not None:
                seq.drafter.commit(path, node_slots[p], path_slots, features, self.ops)
            seq.root = bonus      # the last committed token is the next step's root
        seq.stats.add_time("commit", t)
        seq.stats.record_launches(seq.step_launches + (LAUNCHES.snapshot() - launches_before), pool.forwards)
        seq.stats.host_reads += HOST_READS.count - reads_before

    def finish(self, seq: DecodeState) -> dict:
        """The request's stats (``DecodeResult.stats``)."""
        return seq.stats.finish(seq.prompt_tokens, len(seq.out), time.perf_counter() - seq.t0)


class Proposal(NamedTuple):
    """A step's tree for one request, and what settling it needs."""
    pool: DraftPool
    built: BuiltTree
    tree: Tree
    ngram: torch.Tensor | None


@dataclass(eq=False)
class DecodeState:
    """One request in decoding: its sampling settings, drafter state, context and counters.
    Shared across requests (on the Engine): M, the acceptance estimates, the step policy."""
    method: str
    max_new_tokens: int
    temperature: float
    top_p: float
    generator: torch.Generator | None
    on_tokens: Callable[[list[int]], bool | None] | None
    drafter: Drafter | None       # None: the method drafts nothing
    policy: StepPolicy | None       # per-step depth and budget by expected gain (not batched)
    static_shapes: bool             # verified at the full budget, padding masked
    budget: int                     # N (1 for ar)
    log_tau: float                  # pruning threshold; -inf: no pruning
    cand_parents: torch.Tensor      # the grafted candidates' layout (Engine._candidate_layout)
    cand_source: torch.Tensor
    spans: tuple                    # [start, end) of the pld and retrieval candidates, None if unused
    stats: _Stats
    prompt_tokens: int
    t0: float = field(default_factory=time.perf_counter)
    context: torch.Tensor | None = None   # committed tokens on the device (prompt first): context[:length]
    length: int = 0
    target_len: int = 0             # committed tokens whose KV is in the target cache (all but the root)
    root: torch.Tensor | None = None      # the last committed token, on the device
    out: list[int] = field(default_factory=list)   # new tokens so far (what was streamed)
    done: bool = False
    draft_rates: list[float] | None = None
    step_launches: Counter = field(default_factory=Counter)   # this step's launches before settle


def _forward(net, hidden_layers, tokens, positions, start, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A target forward of one sequence: (logits [T, V], features [T, F] at ``hidden_layers`` or None)."""
    if hidden_layers is None:
        return net(tokens, positions, start, **kw)[0], None
    logits, hidden = net(tokens, positions, start, hidden_layers=hidden_layers, **kw)
    return logits[0], hidden[0]


class _Stats:
    """Per-step counters folded into DecodeResult.stats."""

    def __init__(self, method: str, backend: str, device: torch.device):
        self.method, self.backend = method, backend
        # On CUDA the host runs ahead of the device: phases are timed with CUDA events, read once
        # when the request ends (no sync per phase); on a CPU the host clock is the device's.
        self.cuda_events = device.type == "cuda"
        self.pending_events: list = []
        self.launches: Counter = Counter()   # Triton launches outside model forwards, by kernel
        self.launch_excess = -math.inf       # max over steps of (launches - drafter depths used)
        self.steps = self.drafter_forwards = self.host_reads = 0
        self.prefill_seconds = 0.0
        self.seconds = Counter()
        self.nodes, self.accepted, self.accepted_by_depth = Counter(), Counter(), Counter()
        # Per step: nodes verified, drafter forwards, tokens committed (what an adaptive policy chose).
        self.per_step: dict[str, list[int]] = {"nodes": [], "drafter_forwards": [], "committed": []}
        # Expected accepted nodes per source code, summed on the device over the steps (read at the end).
        self.expected = torch.zeros(len(SOURCE_NAMES), device=device)

    def clock(self):
        """A phase's start: a recorded CUDA event, or the host clock."""
        if self.cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add_time(self, phase: str, since) -> None:
        if self.cuda_events:
            self.pending_events.append((phase, since, self.clock()))
        else:
            self.seconds[phase] += time.perf_counter() - since

    def _read_events(self) -> None:
        if self.pending_events:
            torch.cuda.synchronize()
            for phase, start, end in self.pending_events:
                self.seconds[phase] += start.elapsed_time(end) / 1000
            self.pending_events = []

    def expect(self, built, node_probs: torch.Tensor) -> None:
        """Add the step's expected accepted nodes per source (``AcceptanceEstimates.node_probs``,
        estimates taken before the step's outcome is counted)."""
        self.expected += torch.bincount(built.source.long() + 1, weights=node_probs,
                                        minlength=len(SOURCE_NAMES) + 1)[1:]

    def record_step(self, path_source: list[int], path_depth: list[int], nodes_by_source: list[int],
                    committed: int, drafter_forwards: int, verified: int) -> None:
        """One step: the accepted path's sources and depths (root first), the tree's node count per
        source code, the tokens committed (the bonus included), the drafter forwards run and the
        nodes verified."""
        self.steps += 1
        self.drafter_forwards += drafter_forwards
        for key, value in (("nodes", verified), ("drafter_forwards", drafter_forwards), ("committed", committed)):
            self.per_step[key].append(value)
        for code, count in enumerate(nodes_by_source):
            if code != ROOT and count:
                self.nodes[SOURCE_NAMES[code]] += count
        n_nodes = min(len(path_source) - 1, committed)   # accepted tree nodes kept; the bonus is not a node
        for src, depth in zip(path_source[1:1 + n_nodes], path_depth[1:1 + n_nodes]):
            self.accepted[SOURCE_NAMES[src]] += 1
            self.accepted_by_depth[depth] += 1

    def record_launches(self, launched: Counter, depths: int) -> None:
        for name in FORWARD_KERNELS:
            launched.pop(name, None)
        self.launches += launched
        # a drafter depth is one expansion: one launch, or two where its vocabulary is split
        self.launch_excess = max(self.launch_excess, sum(launched.values()) - depths - launched[DEPTH_STAGE_KERNEL])

    def finish(self, prompt_tokens: int, tokens: int, seconds: float) -> dict:
        self._read_events()
        expected = self.expected.tolist()
        steps = max(self.steps, 1)
        return {
            "method": self.method, "prompt_tokens": prompt_tokens, "tokens": tokens, "steps": self.steps,
            # tokens per target forward, the prefill's first token excluded
            "mat": (tokens - 1) / steps if self.steps else 1.0,
            "target_forwards": self.steps + 1, "drafter_forwards_per_step": self.drafter_forwards / steps,
            # device -> host reads per step, counted (graft_tk.backend.HOST_READS): each one waits
            # for the device; the drafters read once per depth whose stop flag decides the next forward
            "host_syncs_per_step": self.host_reads / steps,
            "nodes_by_source": dict(self.nodes), "accepted_by_source": dict(self.accepted),
            # the acceptance estimates' prediction of accepted_by_source (how well they are calibrated)
            "expected_accepted_by_source": {SOURCE_NAMES[code]: round(x, 3) for code, x in enumerate(expected)
                                            if code != ROOT and self.nodes[SOURCE_NAMES[code]]},
            "per_step": self.per_step,
            "accepted_by_depth": {int(k): v for k, v in sorted(self.accepted_by_depth.items())},
            "time_split": {k: self.seconds[k] for k in ("draft", "retrieve", "verify", "commit")},
            "backend": self.backend,
            # Triton kernel launches per step outside the model forwards (goal: <= D + 6), and
            # the worst step's launches minus its drafter depths; None on the torch backend.
            "kernel_launches_per_step": (sum(self.launches.values()) / steps if self.backend == "triton" else None),
            "kernel_launches_max_minus_depth": (self.launch_excess if self.backend == "triton" and self.steps
                                                else None),
            "kernel_launches_by_kernel": dict(self.launches) if self.backend == "triton" else None,
            "seconds": seconds, "prefill_seconds": self.prefill_seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        }
