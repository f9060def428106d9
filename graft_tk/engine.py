"""The speculative decode loop: draft -> retrieve -> graft -> verify -> accept -> commit.

An ``Engine`` holds what should outlive one request: the target, the drafter, the config and the
token-successor adjacency matrix M, so a second request starts with M already warm.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from .config import USES_DRAFTER, USES_RETRIEVAL, GraftConfig
from .drafting import Draft, draft_tree
from .models import Model
from .reference.accept import greedy_accept, sample_accept
from .reference.graft_merge import graft_merge
from .reference.prompt_lookup import prompt_lookup
from .reference.retrieval import (RetrievalTemplate, new_adjacency, retrieve, template_from_level_sizes,
                                  update_adjacency, warm_adjacency)
from .sampling import next_token
from .tree import PROMPT_LOOKUP, SOURCE_NAMES, Tree


class Engine:
    def __init__(self, target: Model, drafter: Model | None = None, config: GraftConfig | None = None):
        self.target, self.drafter = target, drafter
        self.config = config or GraftConfig()
        self.template = template_from_level_sizes(self.config.template, self.config.retrieval_k).to(target.device)
        # M[V, k]: row t = the k tokens the target last ranked most likely after t (-1 = unknown).
        self.adjacency = new_adjacency(target.config.vocab_size, self.config.retrieval_k, target.device)
        # A prompt-lookup chain is a template whose node i takes rank 0 under node i - 1.
        L = self.config.pld_tokens
        self.chain = RetrievalTemplate(torch.arange(-1, L - 1), torch.zeros(L, dtype=torch.int32), 1).to(target.device)
        # Set to a list to record, per verified node, (source, depth, drafter score, accepted?):
        # graft-calibrate fits its score -> acceptance map from it. Off by default (host syncs).
        self.acceptance_log: list[tuple[int, int, float, bool]] | None = None

    def generate(self, ids: list[int], method: str, max_new_tokens: int, temperature: float, top_p: float,
                 generator, on_tokens) -> tuple[list[int], dict]:
        """Speculative decoding of ``ids``: returns (new tokens, stats)."""
        cfg, target, tnet = self.config, self.target, self.target.net
        device, eos = target.device, set(target.eos_token_ids)
        use_drafter, use_retrieval = method in USES_DRAFTER, method in USES_RETRIEVAL
        use_pld = cfg.uses_prompt_lookup(method)
        stats = _Stats(method)
        t0 = time.perf_counter()
        n = len(ids)
        tnet.setup_cache(n + max_new_tokens + cfg.budget + 1)
        if use_drafter:
            self.drafter.net.setup_cache(n + max_new_tokens + cfg.top_k * cfg.max_depth + 1)

        # Prefill: the prompt's logits give the first token (and warm M when asked to).
        warm = use_retrieval and cfg.warm_from_prefill
        prompt = torch.tensor([ids], device=device)
        logits = tnet(prompt, torch.arange(n, device=device), 0, last_only=not warm)[0]
        if warm:
            warm_adjacency(self.adjacency, prompt[0], logits)
        first = int(next_token(logits[-1:], temperature, top_p, generator)[0])
        committed, out = list(ids) + [first], [first]
        target_len, drafter_len = n, 0   # tokens whose KV is in each cache; the root is the last committed
        stats.prefill_seconds = time.perf_counter() - t0
        if on_tokens:
            on_tokens([first])
        done = first in eos or max_new_tokens <= 1

        while not done:
            root = committed[-1]
            # 1-2. Draft with calibrated pruning (or just the root when there is no drafter).
            t = time.perf_counter()
            if use_drafter:
                draft = draft_tree(self.drafter, drafter_len, committed[drafter_len:], cfg, prune=method != "tree")
                drafter_len = len(committed)
            else:
                draft = Draft(Tree.root(root, device), torch.full((1,), -1, device=device), 0)
            stats.add_time("draft", t)
            # 3-5. Retrieval grafted into the freed budget: the prompt-lookup chain (when the context
            # repeats, it is the likelier bet), then root-parallel adjacency retrieval.
            t = time.perf_counter()
            tree = draft.tree
            if use_pld:
                chain = prompt_lookup(committed, cfg.pld_max_ngram, 1, cfg.pld_tokens)
                chain += [-1] * (cfg.pld_tokens - len(chain))
                tree = graft_merge(tree, torch.tensor(chain, device=device), self.chain, cfg.budget, PROMPT_LOOKUP)
            if use_retrieval:
                candidates = retrieve(self.adjacency, torch.tensor(root, device=device), self.template)
                tree = graft_merge(tree, candidates, self.template, cfg.budget)
            stats.add_time("retrieve", t)
            # 6-7. Verify the whole tree in one target forward with tree attention.
            t = time.perf_counter()
            mask = torch.cat([torch.ones(tree.n, target_len, dtype=torch.bool, device=device), tree.attn_mask()], 1)
            logits = tnet(tree.tokens[None], tree.positions(target_len), target_len, attn_mask=mask)[0]
            stats.add_time("verify", t)
            # 8. Accept the longest path the target agrees with, plus a bonus token.
            t = time.perf_counter()
            if temperature == 0.0:
                path, bonus = greedy_accept(tree, logits)
            else:
                path, bonus = sample_accept(tree, logits, temperature, top_p, generator)
            path_list = path.tolist()   # the step's one unavoidable sync: how many tokens advance
            new = tree.tokens[path[1:]].tolist() + [int(bonus)]
            # EOS inside the path and the max_new_tokens limit truncate what is committed.
            for i, tok in enumerate(new):
                if tok in eos or len(out) + i + 1 >= max_new_tokens:
                    new, done = new[:i + 1], True
                    break
            stats.record_step(tree, path_list, len(new), draft.forwards)
            if self.acceptance_log is not None:
                on_path = set(path_list)
                self.acceptance_log += [(s, d, sc, i in on_path) for i, (s, d, sc) in enumerate(zip(
                    tree.source.tolist(), tree.depth.tolist(), tree.scores.tolist())) if i > 0]
            committed += new
            out += new
            if on_tokens:
                on_tokens(new)
            # 9. Commit: compact the target KV of the accepted path, bring the drafter up to date, update M.
            if not done:
                tnet.commit_kv(target_len + path, target_len)
                target_len += len(path_list)
                if use_drafter:
                    drafter_len = self._commit_drafter(draft, path_list, drafter_len)
            order = _path_last(tree.n, path, device)
            update_adjacency(self.adjacency, tree.tokens, logits, order)
            stats.add_time("commit", t)

        return out, stats.finish(n, len(out), time.perf_counter() - t0)

    def _commit_drafter(self, draft: Draft, path: list[int], drafter_len: int) -> int:
        """Keep the drafter KV of the accepted path's longest drafted-and-run prefix; return the new length.

        Accepted nodes the drafter never ran (retrieved ones, leaves) stay pending and are run in
        the next step's first drafter forward together with the new root.
        """
        slots = draft.slots.tolist()
        keep = []
        for node in path[1:]:
            if node >= len(slots) or slots[node] < 0:
                break
            keep.append(slots[node])
        if keep:
            self.drafter.net.commit_kv(torch.tensor(keep, device=self.drafter.device), drafter_len)
        return drafter_len + len(keep)


def _path_last(n: int, path: torch.Tensor, device) -> torch.Tensor:
    """Node write order for M: every node, the accepted path last (its rows are the freshest)."""
    on_path = torch.zeros(n, dtype=torch.bool, device=device)
    on_path[path] = True
    idx = torch.arange(n, device=device)
    return torch.cat([idx[~on_path], path])


class _Stats:
    """Per-step counters folded into DecodeResult.stats."""

    def __init__(self, method: str):
        self.method = method
        self.steps = self.drafter_forwards = 0
        self.prefill_seconds = 0.0
        self.seconds = Counter()
        self.nodes, self.accepted, self.accepted_by_depth = Counter(), Counter(), Counter()

    def add_time(self, phase: str, since: float) -> None:
        self.seconds[phase] += time.perf_counter() - since

    def record_step(self, tree: Tree, path: list[int], committed: int, drafter_forwards: int) -> None:
        self.steps += 1
        self.drafter_forwards += drafter_forwards
        source = tree.source.tolist()
        for s in source[1:]:
            self.nodes[SOURCE_NAMES[s]] += 1
        depth = tree.depth.tolist()
        n_nodes = min(len(path) - 1, committed)   # accepted tree nodes kept; the bonus is not a node
        for node in path[1:1 + n_nodes]:
            self.accepted[SOURCE_NAMES[source[node]]] += 1
            self.accepted_by_depth[depth[node]] += 1

    def finish(self, prompt_tokens: int, tokens: int, seconds: float) -> dict:
        steps = max(self.steps, 1)
        return {
            "method": self.method, "prompt_tokens": prompt_tokens, "tokens": tokens, "steps": self.steps,
            # tokens per target forward, the prefill's first token excluded
            "mat": (tokens - 1) / steps if self.steps else 1.0,
            "target_forwards": self.steps + 1, "drafter_forwards_per_step": self.drafter_forwards / steps,
            "nodes_by_source": dict(self.nodes), "accepted_by_source": dict(self.accepted),
            "accepted_by_depth": {int(k): v for k, v in sorted(self.accepted_by_depth.items())},
            "time_split": {k: self.seconds[k] for k in ("draft", "retrieve", "verify", "commit")},
            "seconds": seconds, "prefill_seconds": self.prefill_seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        }
