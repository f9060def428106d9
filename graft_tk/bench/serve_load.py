"""graft-serve under load: B concurrent clients against a server that batches up to B requests
(or ``--max-batch``, as graft-serve's default of 4 serves any number of clients).

    python bench/serve_load.py --model qwen2.5-coder-1.5b --methods ar,graft --batches 1,2,4,8 \\
        --prompts "humaneval#8" --requests-per-cell 16 --max-tokens 32 [--json OUT]

Every method first decodes one prompt untimed (the process's first forwards of each shape are
slow). Then for each B > 1, each method in turn: an in-process server (the real app on uvicorn, a free loopback port) with ``max_batch`` = B,
and B client processes sending ``--requests-per-cell`` requests between them, each client one after
the other, through the ``openai`` client (greedy chat completions; ``--prompts`` may mix short
prompts with long ones, e.g. ``humaneval#6,long@2k#1``, a conversation's earlier turns sent as its
messages); graft runs the budget policy by batch size that ``graft-calibrate --batch B`` profiles
give (the pair's own profile below them) and, as graft-serve does, the cost policy of each batch
size with a cost model measured at start when no profile has one.
Which method goes first alternates from one B to the next. For B = 1 every method's server runs at
once and the one client sends each request to each in turn (request-level interleaving: this
machine's speed drifts by 10-15% over minutes, more than two sequential cells can tell apart). Reported per (B, method): requests/s,
output tokens/s, p50 / p95 latency, time to first token and per-token latency (p50 / p99, from
the server: a step's wait over the tokens it committed, as a streaming client would get them), the
longest wait between two chunks of a stream, the most requests decoded together, where the decode
thread's time went (prefills, and steps by the number of requests in them and the nodes each
verified; 1 is a step without speculation), and every answer checked equal
to the same prompt's answer under ``ar`` (greedy decoding is lossless, batched or not). With B = 1
it also times the same requests through ``graft_tk.decode`` directly (prefill included, as the
server's figures include it), so the server's advantage at B = 1 can be set against
single-request decoding. A method named ``<method>:compile-drafter`` runs as ``graft-serve
--compile drafter`` does: its drafter's step forwards compiled, at the server's start (untimed).

``--arrival-rate R`` is the open-loop load of a service: the requests arrive at the times of a
Poisson process of R a second (seeded: every server gets the same schedule and prompts), each
streamed on its own whatever the others are doing, and B is the server's max batch. Below the
server's capacity its throughput is the offered load's; what tells configurations apart is the
latency (first token, per token, the longest wait between chunks); past it, queues grow and
throughput is the server's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import dataclass

import graft_tk
from graft_tk._fs import atomic_write_text
from graft_tk.cli._models import default_drafter, load_drafter
from graft_tk.compiled import Compile
from graft_tk.profiles import batch_policy
from graft_tk.methods import METHODS
from graft_tk.models.quant import cpu_drafter_quant
from graft_tk.decode import encode_prompt, resolve_config
from graft_tk.bench.prompts import load_prompts
from graft_tk.server.app import serving_in_thread
from graft_tk.server.metrics import Metrics
from graft_tk.server.scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SECONDS, Scheduler, batching_config

COMPILE_DRAFTER = "compile-drafter"     # "<method>:compile-drafter": served with --compile drafter


@dataclass(frozen=True)
class Served:
    """One server configuration of the run: its label, the method it serves, what it compiles."""
    name: str
    method: str
    compile: Compile = Compile.OFF

    @classmethod
    def parse(cls, name: str) -> "Served":
        """``<method>`` or ``<method>:compile-drafter`` (ValueError naming what is wrong)."""
        method, _, option = name.partition(":")
        if method not in METHODS or option not in ("", COMPILE_DRAFTER) or option and not METHODS[method].drafts:
            raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)} "
                             f"(':{COMPILE_DRAFTER}' on one that drafts)")
        return cls(name, method, Compile.DRAFTER if option else Compile.OFF)


def run_client(urls: list[str], prompts: list[list[dict]], c: int, per_client: int, max_tokens: int
               ) -> list[tuple[int, int, str, int, float]]:
    """Client c: ``per_client`` requests in turn, prompts c * per_client, c * per_client + 1, ...,
    each sent to every server of ``urls`` one after the other (which first alternates);
    (server, prompt index, answer, completion tokens, seconds) for each."""
    import openai
    clients = [openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) for url in urls]
    out = []
    for r in range(per_client):
        i = (c * per_client + r) % len(prompts)
        for k in (range(len(urls)) if i % 2 == 0 else reversed(range(len(urls)))):
            t = time.perf_counter()
            try:
                resp = clients[k].chat.completions.create(model="bench", temperature=0, max_tokens=max_tokens,
                                                          messages=prompts[i])
            except openai.OpenAIError as e:
                raise client_error(e, k, i) from None
            out.append((k, i, resp.choices[0].message.content, resp.usage.completion_tokens, time.perf_counter() - t))
    return out


def client_error(e: Exception, server: int, prompt: int) -> RuntimeError:
    """A client's failed request as an error that crosses back from its process: openai's errors
    do not unpickle (the pool's result thread died on one and the run hung)."""
    return RuntimeError(f"server {server}, prompt {prompt}: {type(e).__name__}: {e}")


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from the start) of a Poisson process of ``rate`` requests per
    second: exponential gaps from a seeded generator, so every server gets the same schedule."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def run_arrivals(url: str, prompts: list[list[dict]], times: list[float], max_tokens: int
                 ) -> tuple[list[tuple[int, int, str, int, float]], float]:
    """Open loop: request i (prompt i mod len) sent at ``times[i]`` seconds after the start, each on
    its own thread whatever the others are doing, streamed as a chat client reads it;
    (server 0, prompt index, answer, completion tokens, seconds) for each, and the seconds from
    the start to the last answer."""
    import openai
    from concurrent.futures import ThreadPoolExecutor
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
    t0 = time.perf_counter()

    def send(r: int) -> tuple[int, int, str, int, float]:
        time.sleep(max(0.0, t0 + times[r] - time.perf_counter()))
        i, start, text, tokens = r % len(prompts), time.perf_counter(), [], 0
        try:
            for chunk in client.chat.completions.create(model="bench", temperature=0, max_tokens=max_tokens,
                                                        messages=prompts[i], stream=True):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                if getattr(chunk, "usage", None):
                    tokens = chunk.usage.completion_tokens
        except openai.OpenAIError as e:
            raise client_error(e, 0, i) from None
        return 0, i, "".join(text), tokens, time.perf_counter() - start
    with ThreadPoolExecutor(len(times)) as pool:
        out = list(pool.map(send, range(len(times))))
    return out, time.perf_counter() - t0


def _import_openai() -> None:
    import openai  # noqa: F401 - imported once per client process, before the clock


def load(urls: list[str], prompts: list[list[dict]], clients: int, per_client: int, max_tokens: int,
         arrivals: list[float] | None = None) -> list[dict]:
    """``clients`` client processes (started, and openai imported, before the clock starts), as
    real clients are: threads of this process would hold the interpreter lock that the server's
    decode thread needs between its ops. What came back from each server and when. With several
    servers (one client), each one's time is the sum of its requests' latencies: the client
    waits on one server at a time, so the servers take turns request by request and drift in
    the machine's speed hits them alike. ``arrivals``: open loop instead, one client process
    sending a request at each of these times (``run_arrivals``), one server."""
    assert len(urls) == 1 or clients == 1, "several servers take one client"
    ctx, workers = multiprocessing.get_context("spawn"), 1 if arrivals else clients
    with ctx.Pool(workers, initializer=_import_openai) as pool:
        pool.map(time.sleep, [0.2] * workers, chunksize=1)      # every worker up
        t0 = time.perf_counter()
        if arrivals:
            done, wall = pool.apply(run_arrivals, (urls[0], prompts, arrivals, max_tokens))
            per = [done]
        else:
            per = pool.starmap(run_client, [(urls, prompts, c, per_client, max_tokens) for c in range(clients)],
                               chunksize=1)
            wall = time.perf_counter() - t0
    results = []
    for k in range(len(urls)):
        done = [x for client in per for x in client if x[0] == k]
        latencies = sorted(x[4] for x in done)
        tokens, seconds = sum(x[3] for x in done), wall if len(urls) == 1 else sum(latencies)
        results.append({"requests": len(done), "seconds": seconds, "requests_per_s": len(done) / seconds,
                        "output_tokens_per_s": tokens / seconds, "output_tokens": tokens,
                        "latency_p50_s": statistics.median(latencies),
                        "latency_p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
                        "answers": {i: text for _, i, text, _, _ in done}})
    return results


class Samples(Metrics):
    """The server's metrics, plus every request's time to first token and every token's latency
    (a step's wait over the tokens it committed, as a streaming client gets them), for percentiles."""

    def __init__(self):
        super().__init__()
        self.first_token_s: list[float] = []
        self.per_token_s: list[float] = []
        self.chunk_wait_s: list[float] = []       # every wait between two chunks of a stream

    def observe(self, job) -> None:
        super().observe(job)
        if job.first_token_at is not None:
            self.first_token_s.append(job.first_token_at - job.created)
        for wait, tokens in job.chunk_waits:
            self.per_token_s += [wait / tokens] * tokens
            self.chunk_wait_s.append(wait)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values`` (nan when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latencies(samples: Samples) -> dict:
    return {"ttft_p50_s": percentile(samples.first_token_s, 0.5), "ttft_p99_s": percentile(samples.first_token_s, 0.99),
            "token_p50_ms": 1000 * percentile(samples.per_token_s, 0.5),
            "token_p99_ms": 1000 * percentile(samples.per_token_s, 0.99),
            "chunk_wait_max_s": max(samples.chunk_wait_s, default=math.nan)}


def time_split(metrics: Metrics) -> dict:
    """Where the decode thread's time went: prefills (a request's arrival to its first token), and
    steps by (requests in the step, budget N, "+chunk" where its forward read a prompt's chunk too)."""
    out = {"prefill": {"seconds": metrics.phase_seconds["prefill"]}}
    for key, n in sorted(metrics.batch_steps.items()):
        size, budget, chunk = key
        out[f"B{size} N{budget}" + (" +chunk" if chunk else "")] = {
            "steps": n, "seconds": metrics.batch_step_seconds[key], "tokens": metrics.batch_step_tokens[key]}
    return out


def report(r: dict) -> None:
    split = ", ".join(f"{k} {v['seconds']:.1f} s" + (f" {v['tokens'] / v['seconds']:.1f} tok/s" if "tokens" in v
                                                     and v["seconds"] else "") for k, v in r["time_split"].items())
    print(f"B={r['batch']} (max batch {r['max_batch']}) {r['method']:8s} {r['requests_per_s']:.3f} req/s "
          f"{r['output_tokens_per_s']:.2f} tok/s "
          f"p50 {r['latency_p50_s']:.1f} s p95 {r['latency_p95_s']:.1f} s first token p99 {r['ttft_p99_s']:.2f} s "
          f"per token p99 {r['token_p99_ms']:.0f} ms longest wait between chunks {r['chunk_wait_max_s']:.1f} s "
          f"peak batch {r['peak_batch']} {split}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default=None, help="default: the model's registered drafter")
    p.add_argument("--methods", default="ar,graft",
                   help=f"comma list; '<method>:{COMPILE_DRAFTER}' serves it with its drafter compiled")
    p.add_argument("--batches", default="1,2,4,8", help="concurrent clients = max batch, each B in turn")
    p.add_argument("--max-batch", type=int, default=None, metavar="M",
                   help="every server's max batch, whatever the clients (graft-serve's default is 4; "
                        "default: B, as many as the clients)")
    p.add_argument("--prompts", default="humaneval#8")
    p.add_argument("--requests-per-cell", type=int, default=16,
                   help="requests per (B, method), split evenly between the B clients (rounded up)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="graft-serve's --prefill-chunk; 0 reads every prompt whole (default: %(default)s)")
    p.add_argument("--prefill-seconds", type=float, default=DEFAULT_PREFILL_SECONDS,
                   help="graft-serve's --prefill-seconds; 0: no bound but --prefill-chunk (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="graft-serve's --max-model-len")
    p.add_argument("--arrival-rate", type=float, default=None, metavar="R",
                   help="open loop: --requests-per-cell requests arrive at Poisson times, R a second on "
                        "average (the same schedule for every server), each streamed on its own; B is "
                        "then the server's max batch (default: B closed-loop clients)")
    p.add_argument("--seed", type=int, default=0, help="the arrival schedule's seed")
    p.add_argument("--exact", action="store_true",
                   help="every server with graft-serve --exact (row-invariant target forwards: the answers equal "
                        "ar's at every batch size in bf16 too)")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.max_batch is not None and args.max_batch < 1:
        p.error(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.arrival_rate is not None and not args.arrival_rate > 0:
        p.error(f"--arrival-rate must be > 0 (requests a second), got {args.arrival_rate}")
    arrivals = poisson_arrivals(args.arrival_rate, args.requests_per_cell, args.seed) if args.arrival_rate else None
    try:
        served = {name: Served.parse(name) for name in args.methods.split(",")}
    except ValueError as e:
        p.error(str(e))
    methods = list(served)
    target = graft_tk.load_model(args.model, dtype=args.dtype)
    spec = args.drafter or default_drafter(args.model)
    needs = any(METHODS[s.method].drafts for s in served.values())
    quant = cpu_drafter_quant(target.device, target.dtype) or "none"     # graft-serve's default drafter
    drafter = load_drafter(spec, target, args.model, dtype=args.dtype, quant=quant) if needs else None
    texts = []      # each prompt as the messages a client sends (a long conversation's earlier turns included)
    for part in args.prompts.split(","):
        name, _, n = part.partition("#")
        texts += [[{"role": "user", "content": q.chat}] if isinstance(q.chat, str) else q.chat
                  for q in load_prompts(name)[:int(n) if n else None]]
    for s in served.values():   # untimed: the first forwards of each shape in a process are slow
        d = drafter if METHODS[s.method].drafts else None
        graft_tk.decode(target, encode_prompt(target, texts[0], chat=True), drafter=d, method=s.method,
                        max_new_tokens=8, exact=args.exact)

    cost_models: dict[str, object] = {}     # method -> its config with the cost model measured once

    def server(name: str, B: int) -> tuple[Scheduler, str]:
        method = served[name].method
        d = drafter if METHODS[method].drafts else None
        config, source = resolve_config(target, d, METHODS[method], None)
        policy = batch_policy(target, d, B) if method != "ar" else {}
        if config.cost is None and B > 1:     # as graft-serve --max-batch B measures them (once per method here)
            if method not in cost_models:
                cost_models[method] = batching_config(target, d, method, config, B)
            config = cost_models[method]
            source += "; step costs measured at start" if config.cost is not None else ""
        if policy:
            source += "; by batch size " + ", ".join(f"{b}: N={c.budget} tau={c.tau:.3g} D={c.max_depth}"
                                                     for b, c in policy.items())
        scheduler = Scheduler(target, d, method, config, max_queue=256, metrics=Samples(), max_batch=B,
                              policy=policy, compile=served[name].compile, max_model_len=args.max_model_len,
                              prefill_chunk=args.prefill_chunk or None, exact=args.exact,
                              prefill_seconds=args.prefill_seconds or None)
        scheduler.warm_up()     # untimed, as graft-serve compiles before it opens its port
        return scheduler, source

    rows = []
    for n, B in enumerate(batches):
        per_client = math.ceil(args.requests_per_cell / B)
        # B = 1: every method's server at once, the one client sending each request to each in
        # turn; B > 1: one method after the other (which first alternates with B)
        groups = [methods] if B == 1 and not arrivals else [[m] for m in (methods if n % 2 == 0 else methods[::-1])]
        for group in groups:
            servers = [server(method, args.max_batch or B) for method in group]
            with contextlib.ExitStack() as stack:
                urls = [stack.enter_context(serving_in_thread(s, "bench")) + "/v1" for s, _ in servers]
                results = load(urls, texts, B, per_client, args.max_tokens, arrivals)
            for method, (scheduler, source), r in zip(group, servers, results):
                r.update(batch=B, max_batch=args.max_batch or B, method=method, config=source,
                         peak_batch=scheduler.peak_batch,
                         time_split=time_split(scheduler.metrics), **latencies(scheduler.metrics))
                rows.append(r)
                report(r)
    # every answer against the first method's answer to the same prompt (at any B)
    reference = {}
    for r in rows:
        if r["method"] == methods[0]:
            reference.update({i: a for i, a in r["answers"].items() if i not in reference})
    for r in rows:
        answers = r.pop("answers")
        r["same_count"] = sum(i in reference and reference[i] == a for i, a in answers.items())
        r["same_as_reference"] = r["same_count"] == len(answers)
    single = {}
    if 1 in batches:   # the B = 1 cell's requests through graft_tk.decode, one at a time, methods interleaved
        tokens, seconds = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0)
        for i in range(args.requests_per_cell):
            ids = encode_prompt(target, texts[i % len(texts)], chat=True)
            for name in (methods if i % 2 == 0 else methods[::-1]):
                s = served[name]
                d = drafter if METHODS[s.method].drafts else None
                t = time.perf_counter()
                tokens[name] += len(graft_tk.decode(target, ids, drafter=d, method=s.method,
                                                    max_new_tokens=args.max_tokens, compile=s.compile,
                                                    exact=args.exact).tokens)
                seconds[name] += time.perf_counter() - t
        single = {m: tokens[m] / seconds[m] for m in methods}
    lines = ["| B | max batch | method | requests/s | output tok/s | vs ar | p50 latency s | p95 latency s | "
             "first token p50 / p99 s | per-token p50 / p99 ms | longest chunk wait s | peak batch | "
             "same tokens as ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], methods.index(r["method"]))):
        ar = next(x for x in rows if x["batch"] == r["batch"] and x["method"] == methods[0])
        lines.append(f"| {r['batch']} | {r['max_batch']} | {r['method']} | {r['requests_per_s']:.3f} | "
                     f"{r['output_tokens_per_s']:.2f} | "
                     f"{r['output_tokens_per_s'] / ar['output_tokens_per_s']:.2f}x | {r['latency_p50_s']:.1f} | "
                     f"{r['latency_p95_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{r['token_p50_ms']:.0f} / {r['token_p99_ms']:.0f} | {r['chunk_wait_max_s']:.1f} | "
                     f"{r['peak_batch']} | {r['same_count']}/{r['requests']} |")
    if single:
        lines.append("")
        lines.append("single-request decode (graft_tk.decode), same prompts: " + ", ".join(
            f"{m} {v:.2f} tok/s ({v / single[methods[0]]:.2f}x)" for m, v in single.items()))
    print("\n".join(lines))
    if args.json:
        atomic_write_text(args.json, json.dumps({"args": vars(args), "rows": rows, "single": single}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
