"""A request's statistics, summed over the steps it took part in (``DecodeResult.stats``)."""
from __future__ import annotations

import time
from collections import Counter

from .counters import StepCounters
from .tree import ROOT, SOURCE_NAMES

PHASES = ("draft", "retrieve", "verify", "commit")
# Launched inside model forwards (the attention, its split-KV combine, quantized matmuls): not step ops.
FORWARD_KERNELS = ("_tree_attention_kernel", "_combine_splits_kernel", "_quant_matmul_kernel")
DEPTH_BINS = 32   # expected acceptance is kept per tree depth 0 .. 31 (deeper nodes count in the last)


class RequestStats:
    """Per-step counters of one request, folded into a dict by ``finish``."""

    def __init__(self, method: str, backend: str):
        self.method, self.backend = method, backend
        self.t0 = time.perf_counter()
        self.launches: Counter = Counter()   # Triton launches of its steps outside model forwards, by kernel
        self.steps = self.drafter_forwards = self.host_reads = self.torch_ops = 0
        self.prefill_seconds = 0.0
        self.seconds: Counter = Counter()     # by phase
        self.nodes, self.accepted, self.accepted_by_depth = Counter(), Counter(), Counter()
        self.accepted_by_source_depth: Counter = Counter()    # (source name, depth) -> accepted nodes
        # Per step: nodes verified, drafter forwards, tokens committed.
        self.per_step: dict[str, list[int]] = {"nodes": [], "drafter_forwards": [], "committed": []}
        # (source name, depth) -> expected accepted nodes (the estimates' prediction, before each outcome)
        self.expected_by_source_depth: Counter = Counter()

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
            self.accepted_by_source_depth[SOURCE_NAMES[src], depth] += 1

    def record_expected(self, by_bin: list[float], bins: int) -> None:
        """One step's expected accepted nodes, flat [source code, depth bin] with ``bins`` depth bins."""
        for i, x in enumerate(by_bin):
            if x:
                self.expected_by_source_depth[SOURCE_NAMES[i // bins], i % bins] += x

    def record_counters(self, counters: StepCounters) -> None:
        launched = Counter(counters.launches)
        for name in FORWARD_KERNELS:
            launched.pop(name, None)
        self.launches += launched
        self.host_reads += counters.host_reads
        self.torch_ops += counters.torch_ops

    def finish(self, prompt_tokens: int, tokens: int) -> dict:
        seconds = time.perf_counter() - self.t0
        expected = Counter()
        for (src, _), x in self.expected_by_source_depth.items():
            expected[src] += x
        steps = max(self.steps, 1)
        return {
            "method": self.method, "prompt_tokens": prompt_tokens, "tokens": tokens, "steps": self.steps,
            # tokens per target forward, the prefill's first token excluded
            "mat": (tokens - 1) / steps if self.steps else 1.0,
            "target_forwards": self.steps + 1, "drafter_forwards_per_step": self.drafter_forwards / steps,
            # device -> host reads per step (each waits for the device): the step's one read of its
            # outcome, and one per drafter depth whose stop flags decide the next forward
            "host_syncs_per_step": self.host_reads / steps,
            "torch_ops_per_step": self.torch_ops / steps if self.torch_ops else None,
            "nodes_by_source": dict(self.nodes), "accepted_by_source": dict(self.accepted),
            # the acceptance estimates' prediction of accepted_by_source (how well they are calibrated)
            "expected_accepted_by_source": {src: round(x, 3) for src, x in expected.items() if self.nodes[src]},
            "expected_accepted_by_source_depth": {
                src: {int(d): round(x, 3) for (s, d), x in sorted(self.expected_by_source_depth.items()) if s == src}
                for src in sorted(expected) if self.nodes[src]},
            "per_step": self.per_step,
            "accepted_by_depth": {int(k): v for k, v in sorted(self.accepted_by_depth.items())},
            "accepted_by_source_depth": {src: {int(d): n for (s, d), n in sorted(self.accepted_by_source_depth.items())
                                               if s == src} for src in sorted(self.accepted)},
            "time_split": {k: self.seconds[k] for k in PHASES},
            "backend": self.backend,
            # Triton kernel launches per step outside the model forwards; None on the torch backend.
            "kernel_launches_per_step": (sum(self.launches.values()) / steps if self.backend == "triton" else None),
            "kernel_launches_by_kernel": dict(self.launches) if self.backend == "triton" else None,
            "seconds": seconds, "prefill_seconds": self.prefill_seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        }
