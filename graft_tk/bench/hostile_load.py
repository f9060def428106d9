"""graft-serve under a mixed, hostile load, with a SIGTERM in the middle of it.

    python -m graft_tk.bench.hostile_load --model qwen2.5-coder-1.5b --max-batch 4 --clients 16 \\
        --requests 64 --max-tokens 32 --sigterm-after 48 [--json OUT]

Starts the real ``graft-serve`` (a child process, so the SIGTERM is a real one), then ``--clients``
client threads send ``--requests`` requests between them. Request i is, by i mod 5: a greedy chat
completion, a seeded sampled completion, a streamed chat completion, a completion cut at a stop
string, and a stream whose client goes away after its first chunk. After ``--sigterm-after``
requests have ended, the server gets SIGTERM; the requests still coming find it gone.

Every request ends one way (``Outcome.status``): "ok" (200, a finish reason, the whole answer,
valid JSON or SSE), "cancelled" (its own client went away), "refused" (after the SIGTERM, no
answer at all: the connection refused or closed before a status line, or a 503), or "failed"
(anything else: a 5xx, a 4xx, bad JSON, a timeout, a stream cut short). Checked from both sides:
the server's log has one line per request it took, each answered id exactly once (nothing lost
or duplicated); no request sent a second or more before the SIGTERM is refused or failed (the
drain lets them finish; one sent at the SIGTERM's moment may find the door closing); the server
exits 0; its memory (RSS) stays within
25% of its figure after warm-up (the KV caches are a fixed pool). Reported: latency p50 / p99 of the "ok" requests and
throughput (output tokens per second of wall time until the SIGTERM).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import httpx

KINDS = ("greedy", "sampled", "stream", "stop", "disconnect")
PROMPTS = ("Name three colours.", "Write a haiku about the sea.", "What is 2 + 2?", "Say hello in French.",
           "def fibonacci(n):", "List the planets of the solar system.")


@dataclass
class Outcome:
    index: int
    kind: str
    status: str              # "ok" | "cancelled" | "refused" | "failed"
    id: str | None           # the server's id for the request (None: it never got one)
    tokens: int
    seconds: float
    started: float           # time.perf_counter() when it was sent
    detail: str = ""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str, list[str], threading.Thread]:
    """``graft-serve`` with ``argv`` on a free port: the process, its base URL, its stderr lines as
    they come, and the thread that keeps reading them (it ends when the process does)."""
    proc = subprocess.Popen([sys.executable, "-m", "graft_tk.cli.serve", "--port", "0", "-v", *argv],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line):
            reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
            reader.start()
            return proc, f"http://127.0.0.1:{m.group(1)}", lines, reader
    raise RuntimeError("graft-serve exited before it listened:\n" + "".join(lines[-20:]))


def send(http: httpx.Client, url: str, model: str, i: int, max_tokens: int, sigterm: threading.Event) -> Outcome:
    kind = KINDS[i % len(KINDS)]
    prompt = PROMPTS[i % len(PROMPTS)]
    chat = kind in ("greedy", "stream", "disconnect")
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=i)
    if kind == "stop":
        body["stop"] = ["\n"]
    stream = kind in ("stream", "disconnect")
    body["stream"] = stream
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0, answered = time.perf_counter(), False

    def outcome(status: str, id: str | None = None, tokens: int = 0, detail: str = "") -> Outcome:
        return Outcome(i, kind, status, id, tokens, time.perf_counter() - t0, t0, detail)
    try:
        if not stream:
            r = http.post(url + path, json=body)
            answered = True
            if r.status_code == 503 and sigterm.is_set():
                return outcome("refused", detail="503")
            data = r.json()
            if r.status_code != 200 or data["choices"][0]["finish_reason"] not in ("stop", "length"):
                return outcome("failed", detail=f"{r.status_code} {r.text[:200]}")
            return outcome("ok", data["id"], data["usage"]["completion_tokens"])
        with http.stream("POST", url + path, json=body) as r:
            answered = True
            if r.status_code == 503 and sigterm.is_set():
                return outcome("refused", detail="503")
            if r.status_code != 200:
                return outcome("failed", detail=f"{r.status_code} {r.read()[:200]!r}")
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))          # every event is JSON, or this fails
                if "error" in events[-1]:
                    return outcome("failed", detail=line[:200])
                if kind == "disconnect":
                    return outcome("cancelled", events[0]["id"])   # leaving the block closes the connection
            last = events[-1]
            if last["choices"][0]["finish_reason"] not in ("stop", "length"):
                return outcome("failed", detail=f"finish reason {last['choices'][0]['finish_reason']}")
            return outcome("ok", last["id"], last["usage"]["completion_tokens"])
    except (httpx.ConnectError, httpx.RemoteProtocolError) as e:   # no status line: the server was going
        refused = sigterm.is_set() and not answered
        return outcome("refused" if refused else "failed", detail=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a timeout, a dropped connection, bad JSON: all failures
        return outcome("failed", detail=f"{type(e).__name__}: {e}")


def run(server_argv: list[str], model: str, clients: int = 16, requests: int = 64, max_tokens: int = 16,
        sigterm_after: int | None = None, warmup: int = 4, timeout: float = 600) -> dict:
    """The whole load against a fresh server (see the module docstring): outcomes, checks, figures."""
    proc, url, log, reader = start_server(server_argv)
    sigterm = threading.Event()
    try:
        with httpx.Client(timeout=timeout) as http:
            for i in range(warmup):          # first forwards of each shape are slow; not counted
                send(http, url, model, i * len(KINDS), max_tokens, sigterm)
        rss_warm = rss_mb(proc.pid)
        ended, lock, rss_peak = [0], threading.Lock(), [rss_warm]

        def client(indices: list[int]) -> list[Outcome]:
            out = []
            with httpx.Client(timeout=timeout) as http:
                for i in indices:
                    out.append(send(http, url, model, i, max_tokens, sigterm))
                    with lock:
                        ended[0] += 1
                        if not sigterm.is_set():
                            rss_peak[0] = max(rss_peak[0], rss_mb(proc.pid))
                        if sigterm_after is not None and ended[0] == sigterm_after:
                            t_sigterm[0] = time.perf_counter()
                            sigterm.set()
                            proc.send_signal(signal.SIGTERM)
            return out
        t_sigterm = [None]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            parts = pool.map(client, [list(range(c, requests, clients)) for c in range(clients)])
            outcomes = sorted((o for part in parts for o in part), key=lambda o: o.index)
        wall = (t_sigterm[0] or time.perf_counter()) - t0
        exit_code = proc.wait(timeout=timeout) if sigterm.is_set() else None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    reader.join(timeout=60)                  # the server's last log lines (its stderr has ended)
    t_end = t0 + wall

    def early(o: Outcome) -> bool:
        return t_sigterm[0] is None or o.started < t_sigterm[0] - 1.0
    logged = re.findall(r" ((?:chat)?cmpl-[0-9a-f]+) \S+ \S+ prompt=\d+ completion=\d+ finish=(\w+)", "".join(log))
    answered = [o.id for o in outcomes if o.id is not None]
    ok = [o for o in outcomes if o.status == "ok"]
    latencies = sorted(o.seconds for o in ok)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "cancelled", "refused", "failed")}
    checks = {
        "every request ended once": len(outcomes) == requests and [o.index for o in outcomes] == list(range(requests)),
        "no request failed": counts["failed"] == 0,
        "nothing sent 1 s before SIGTERM refused": not any(o.status == "refused" and early(o) for o in outcomes),
        "ids unique": len(set(answered)) == len(answered),
        "every answered id logged once": all(sum(i == x for x, _ in logged) == 1 for i in answered),
        "the server logged every request it took": len(logged) == warmup + counts["ok"] + counts["cancelled"],
        "server exited 0": exit_code in (None, 0),
        "memory bounded (peak RSS within 25% of after warm-up)": rss_peak[0] <= 1.25 * rss_warm,
    }
    return {"requests": requests, "clients": clients, "max_tokens": max_tokens, "sigterm_after": sigterm_after,
            "counts": counts, "checks": checks, "server_exit_code": exit_code,
            "server_requests_logged": len(logged) - warmup,
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] if latencies else None,
            "output_tokens_per_s_until_sigterm": sum(o.tokens for o in ok if o.started < t_end) / wall,
            "rss_mb_after_warmup": rss_warm, "rss_mb_peak": rss_peak[0],
            "outcomes": [asdict(o) for o in outcomes]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sigterm-after", type=int, default=None, metavar="K",
                   help="SIGTERM the server once K requests have ended (default: never)")
    p.add_argument("--json", default=None, metavar="OUT")
    args, server_args = p.parse_known_args(argv)
    result = run(["--model", args.model, "--max-batch", str(args.max_batch), "--grace", "600", *server_args],
                 args.model, args.clients, args.requests, args.max_tokens, args.sigterm_after)
    print(f"{args.requests} requests from {args.clients} clients, max batch {args.max_batch}: {result['counts']}; "
          f"p50 {result['latency_p50_s']:.2f} s, p99 {result['latency_p99_s']:.2f} s, "
          f"{result['output_tokens_per_s_until_sigterm']:.2f} output tok/s; RSS {result['rss_mb_after_warmup']:.0f} MB "
          f"after warm-up, {result['rss_mb_peak']:.0f} MB peak")
    for name, passed in result["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    if args.json:
        from graft_tk._fs import atomic_write_text
        atomic_write_text(args.json, json.dumps({"args": vars(args), "server_args": server_args, **result}, indent=1))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
