"""graft-serve's counters, rendered in the Prometheus text exposition format (``GET /metrics``).

Counters only grow (a scraper takes ``rate()``); gauges are read when scraped. Everything a
finished job reports is added under one lock by the decode thread.
"""
from __future__ import annotations

import threading
from collections import Counter

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)   # seconds, request end to end
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)     # seconds per streamed token
PREFIX = "graft"


class Histogram:
    """A Prometheus histogram: cumulative counts at fixed upper bounds, their sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.bounds):
            self.counts[i] += times * (value <= bound)
        self.sum += value * times
        self.count += times

    def render(self, name: str, help_text: str) -> list[str]:
        name = f"{PREFIX}_{name}"
        return ([f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
                + [f'{name}_bucket{{le="{b:g}"}} {n}' for b, n in zip(self.bounds, self.counts)]
                + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:g}", f"{name}_count {self.count}"])


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()          # (kind, finish_reason)
        self.prompt_tokens = self.completion_tokens = 0
        self.decode_seconds = 0.0                   # time inside decode, prefill included
        self.steps = self.target_forwards = 0
        self.accepted_by_source: Counter = Counter()
        self.accepted_by_depth: Counter = Counter()
        self.phase_seconds: Counter = Counter()     # prefill, draft, retrieve, verify, commit
        self.latency = Histogram(LATENCY_BUCKETS)           # arrival to the last token
        self.first_token = Histogram(LATENCY_BUCKETS)       # arrival to the first token
        self.per_token = Histogram(TOKEN_BUCKETS)           # a chunk's wait over the tokens it carries
        self.rejected: Counter = Counter()          # HTTP status of requests refused before decoding
        # batched steps by (requests in the step, nodes verified per request; 1 = no speculation)
        self.batch_steps: Counter = Counter()
        self.batch_step_seconds: Counter = Counter()
        self.batch_step_tokens: Counter = Counter()

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] += 1

    def observe_step(self, record) -> None:
        """One batched step (``graft_tk.batch.StepRecord``)."""
        key = (record.size, record.budget, record.prompt_tokens > 0)
        with self._lock:
            self.batch_steps[key] += 1
            self.batch_step_seconds[key] += record.seconds
            self.batch_step_tokens[key] += record.tokens

    def observe(self, job) -> None:
        """A finished job (any finish reason)."""
        s = job.stats
        latency = (job.finished or job.created) - job.created
        with self._lock:
            self.requests[(job.request.kind, job.finish_reason)] += 1
            self.prompt_tokens += len(job.prompt_ids)
            self.completion_tokens += len(job.tokens)
            self.decode_seconds += s.get("seconds", 0.0)
            self.steps += s.get("steps", 0)
            self.target_forwards += s.get("target_forwards", s.get("steps", 0))
            self.accepted_by_source.update(s.get("accepted_by_source", {}))
            self.accepted_by_depth.update({int(k): v for k, v in s.get("accepted_by_depth", {}).items()})
            self.phase_seconds["prefill"] += s.get("prefill_seconds", 0.0)
            self.phase_seconds.update(s.get("time_split", {}))
            self.latency.observe(latency)
            if job.first_token_at is not None:
                self.first_token.observe(job.first_token_at - job.created)
            for wait, tokens in job.chunk_waits:
                self.per_token.observe(wait / tokens, tokens)

    def render(self, queued: int, running: int) -> str:
        with self._lock:
            out = []

            def metric(name, kind, help_text, samples):
                out.append(f"# HELP {PREFIX}_{name} {help_text}")
                out.append(f"# TYPE {PREFIX}_{name} {kind}")
                for labels, value in samples:
                    label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                    out.append(f"{PREFIX}_{name}{label} {value:g}" if isinstance(value, float) else
                               f"{PREFIX}_{name}{label} {value}")

            metric("requests_total", "counter", "Requests decoded, by endpoint kind and finish reason.",
                   [({"kind": k, "finish_reason": r}, n) for (k, r), n in sorted(self.requests.items())])
            metric("requests_rejected_total", "counter", "Requests refused before decoding, by HTTP status.",
                   [({"status": str(st)}, n) for st, n in sorted(self.rejected.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of decoded requests.", [({}, self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "Tokens generated.", [({}, self.completion_tokens)])
            metric("decode_seconds_total", "counter", "Seconds spent decoding (prefill included).",
                   [({}, self.decode_seconds)])
            metric("tokens_per_second", "gauge", "Tokens generated per decoding second, since start.",
                   [({}, self.completion_tokens / self.decode_seconds if self.decode_seconds else 0.0)])
            metric("steps_total", "counter", "Decode steps (one target forward each after the prefill).",
                   [({}, self.steps)])
            metric("mean_accepted_tokens", "gauge", "Tokens committed per target forward (MAT), since start.",
                   [({}, self.completion_tokens / self.target_forwards if self.target_forwards else 0.0)])
            metric("accepted_tokens_total", "counter", "Tree nodes accepted, by the source that proposed them.",
                   [({"source": src}, n) for src, n in sorted(self.accepted_by_source.items())])
            metric("accepted_tokens_by_depth_total", "counter", "Tree nodes accepted, by depth in the tree.",
                   [({"depth": str(d)}, n) for d, n in sorted(self.accepted_by_depth.items())])
            metric("phase_seconds_total", "counter", "Decoding time by phase of the step.",
                   [({"phase": ph}, float(t)) for ph, t in sorted(self.phase_seconds.items())])
            by_size = sorted(self.batch_steps)

            def labels(b, n, chunk):
                return {"size": b, "budget": n, "prompt_chunk": "yes" if chunk else "no"}
            metric("batch_steps_total", "counter", "Batched decode steps, by requests in the step, the nodes each "
                   "verified (budget 1 = no speculation) and whether its forward read a prompt's chunk too.",
                   [(labels(*k), self.batch_steps[k]) for k in by_size])
            metric("batch_step_seconds_total", "counter", "Seconds in batched decode steps, by size, budget and "
                   "prompt chunk.", [(labels(*k), float(self.batch_step_seconds[k])) for k in by_size])
            metric("batch_step_tokens_total", "counter", "Tokens committed by batched decode steps, by size, "
                   "budget and prompt chunk.", [(labels(*k), self.batch_step_tokens[k]) for k in by_size])
            metric("queue_depth", "gauge", "Requests waiting to decode.", [({}, queued)])
            metric("requests_running", "gauge", "Requests decoding now.", [({}, running)])
            out += self.latency.render("request_latency_seconds", "Request time from arrival to its last token.")
            out += self.first_token.render("time_to_first_token_seconds",
                                           "Request time from arrival to its first token (queue and prefill).")
            out += self.per_token.render("inter_token_latency_seconds",
                                         "Each token's share of the wait for the chunk that carried it (the "
                                         "wait between two chunks over the tokens of the later; one sample "
                                         "per token).")
        return "\n".join(out) + "\n"
