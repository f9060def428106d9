"""The decode side of graft-serve: a bounded queue of jobs and one thread that decodes them.

The HTTP handlers (asyncio) submit a ``Job`` and wait on it; the decode thread decodes with one
long-lived ``Engine``, so the adjacency matrix that retrieval reads stays warm across requests.
Up to ``max_batch`` jobs decode together in a ``graft_tk.batch.Batch`` (one target forward per
step for all of them; ``max_batch`` = 1: one at a time), a queued job joining as soon as a row
is free. Tokens reach the job as they commit
(``on_tokens``); the job turns them into text, cuts it at a stop string, holds back what may be the
start of one (or half a UTF-8 character), and wakes its handler. A job whose client went away is
cancelled: its ``on_tokens`` answers True and its decoding stops after the current step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid

from ..compiled import Compile
from ..config import GraftConfig
from ..engine import Engine
from ..methods import METHODS
from ..models import Model
from ..sampling import Sampling
from .metrics import Metrics
from .protocol import APIError, Request

log = logging.getLogger("graft_tk.server")
DEFAULT_MAX_MODEL_LEN = 4096   # tokens per request (prompt + answer) when --max-model-len is not given
DEFAULT_PREFILL_CHUNK = 256    # prompt tokens read per step while others decode (--prefill-chunk)
DEFAULT_PREFILL_SECONDS = 1.0  # ... fewer where they take longer on this device (--prefill-seconds)
DEFAULT_MAX_BATCH = 4          # requests decoded together (--max-batch)
WARM_UP_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
WARM_UP_TOKENS = 12


def batching_config(target: Model, drafter, method: str, config: GraftConfig, max_batch: int) -> GraftConfig:
    """The config a server batching up to ``max_batch`` requests of ``method`` runs: with the
    device's cost model, so that each batch size's cost policy (``graft_tk.policy``) speculates
    only as far as it pays and falls back to plain decoding where it does not. Measured here
    (a minute or so on a CPU, logged) when the config has none (no ``graft-calibrate --cost-only``
    profile for the pair)."""
    if max_batch < 2 or not METHODS[method].prune or config.cost is not None:
        return config
    from ..calibration.cost import measure_step_cost
    log.warning("measuring this device's step costs for batches of up to %d requests (at every start without a "
                "profile; graft-calibrate --model %s --cost-only keeps them in one) ...", max_batch, target.name)
    t0 = time.perf_counter()
    config = dataclasses.replace(config, cost=measure_step_cost(target, drafter, config))
    log.warning("measured in %.0f s", time.perf_counter() - t0)
    return config


class Job:
    """One request in flight. Written by the decode thread, read by its handler's event loop."""

    def __init__(self, request: Request, prompt_ids: list[int], target: Model, loop: asyncio.AbstractEventLoop):
        self.id = ("chatcmpl-" if request.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.request, self.prompt_ids, self._tokenizer = request, prompt_ids, target.tokenizer
        self._eos = set(target.eos_token_ids)
        self.tokens: list[int] = []
        self.text = ""                     # the answer so far, safe to send
        self.finish_reason: str | None = None   # "stop" | "length" | "cancelled" | "error"
        self.error: BaseException | None = None
        self.stats: dict = {}
        self.created, self.started, self.finished = time.time(), None, None
        self.first_token_at: float | None = None      # when its first token was committed
        self.chunk_waits: list[tuple[float, int]] = []   # (seconds since the previous chunk, its tokens)
        self.cancelled = threading.Event()
        self.shut_down = False             # cancelled because the server stopped (its client gets an error)
        self._loop, self._changed = loop, asyncio.Event()

    # --- decode thread
    def on_tokens(self, new: list[int]) -> bool:
        """Take committed tokens; True stops decoding (a stop string, the client went away, or this
        job's own code raised: it fails alone, the step and the batch go on)."""
        if self.cancelled.is_set() or self.error is not None:
            return True
        now = time.time()
        if self.first_token_at is None:
            self.first_token_at = now
        elif new:
            self.chunk_waits.append((now - self._last_chunk_at, len(new)))
        self._last_chunk_at = now
        try:
            self.tokens += new
            text, stopped = self._cut(self._tokenizer.decode(self.tokens))
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode these ids
            log.exception("request %s: its tokens could not be turned into text", self.id)
            self.error = e
            return True
        if stopped:
            self.text, self.finish_reason = text, "stop"
        else:
            self.text = text[:len(text) - self._held(text)]
        self._notify()
        return stopped

    def _cut(self, text: str) -> tuple[str, bool]:
        hits = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        return (text[:min(hits)], True) if hits else (text, False)

    def _held(self, text: str) -> int:
        """Characters at the end that must wait: half a UTF-8 character (decoded as U+FFFD) or a
        proper prefix of a stop string that the next tokens may complete."""
        n = len(text) - len(text.rstrip("\ufffd"))
        for s in self.request.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    n = max(n, k)
                    break
        return n

    @property
    def completion_tokens(self) -> int:
        """Tokens of the answer returned: with a stop string, those up to the one that completed the
        text before it (the step may have committed more)."""
        if self.finish_reason != "stop" or not self.request.stop:
            return len(self.tokens)
        return next((k for k in range(1, len(self.tokens) + 1)
                     if len(self._tokenizer.decode(self.tokens[:k])) >= len(self.text)), len(self.tokens))

    def finish(self, stats: dict) -> None:
        self.stats = stats
        if self.error is not None:
            self.finish_reason = "error"
        elif self.finish_reason is None:
            if self.cancelled.is_set():
                self.finish_reason = "cancelled"
            else:
                self.text, stopped = self._cut(self._tokenizer.decode(self.tokens))
                hit_eos = bool(self.tokens) and self.tokens[-1] in self._eos
                self.finish_reason = "stop" if stopped or hit_eos else "length"
        self._done()

    def fail(self, error: BaseException) -> None:
        self.error, self.finish_reason = error, "error"
        self._done()

    def _done(self) -> None:
        self.finished = time.time()
        self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._changed.set)
        except RuntimeError:        # the event loop is closed: no handler is left to tell
            pass

    # --- event loop
    @property
    def done(self) -> bool:
        return self.finished is not None

    async def wait(self) -> None:
        """Until the job changes (new text, or done)."""
        await self._changed.wait()
        self._changed.clear()

    def cancel(self, shutting_down: bool = False) -> None:
        self.shut_down = self.shut_down or shutting_down
        self.cancelled.set()


class Scheduler:
    """Jobs in a bounded FIFO queue, decoded by a single thread with one Engine: up to
    ``max_batch`` together (continuous batching)."""

    def __init__(self, target: Model, drafter, method: str, config, max_queue: int, metrics: Metrics,
                 max_batch: int = 1, policy: dict | None = None, hold: int = 8, max_model_len: int | None = None,
                 compile: bool | str = False, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 exact: bool = False, prefill_seconds: float | None = DEFAULT_PREFILL_SECONDS):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.target, self.drafter, self.method, self.metrics = target, drafter, method, metrics
        self.engine = Engine(target, drafter, config, compile=compile, exact=exact)
        # The KV caches are one pool of max_batch rows of max_model_len tokens (prompt + answer),
        # allocated here and never grown: a longer request is a 400, memory never creeps up.
        self.max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, target.config.max_position_embeddings)
        # policy: batch size -> config (N, tau and D by batch size, graft-calibrate --batch B), planned
        # for the most requests of the last ``hold`` steps (graft_tk.batch.Batch)
        # a prompt arriving while others decode is read prefill_chunk tokens a step, fewer where they
        # take longer than prefill_seconds (graft_tk.batch)
        self.batch = self.engine.batch(max_batch, policy, hold, self.max_model_len, prefill_chunk, prefill_seconds)
        self._queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._serve, name="graft-decode", daemon=True)
        self._accepting = True
        self.running: dict[str, Job] = {}     # jobs being decoded (their prefill included), by job id
        self._job_of: dict[int, Job] = {}     # id(a batch's request) -> its job
        self.peak_batch = 0                    # most jobs decoded together so far

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread.start()

    def warm_up(self) -> float:
        """Compile the step forwards before the first request (with ``compile``; else nothing):
        a short decode alone, then two requests together, then ``max_batch`` together (dynamo
        specialises a batch of one; the second graph takes larger batches but the full pool, where
        the KV cache's strides equal the batch's sizes, which that graph's guards exclude). It runs on
        a throwaway engine and batch of the serving ones' shapes: the graphs belong to the models
        and outlive them, and the serving engine's adjacency matrix and acceptance rates start
        clean. Returns the seconds it took."""
        if self.engine.runtime.compile is Compile.OFF:
            return 0.0
        start = time.perf_counter()
        engine = Engine(self.target, self.drafter, self.engine.config, compile=self.engine.runtime.compile)
        batch = engine.batch(self.batch.max_batch, self.batch.policy, self.batch.hold, self.max_model_len)
        ids = self.target.tokenizer.encode(WARM_UP_PROMPT)
        for size in sorted({1, min(2, batch.max_batch), batch.max_batch}):
            for _ in range(size):
                batch.add(ids, self.method, WARM_UP_TOKENS)
            while len(batch):
                batch.step()
        return time.perf_counter() - start

    def submit(self, job: Job) -> None:
        if not self._accepting:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the queue is full ({self._queue.maxsize} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full") from None

    def _serve(self) -> None:
        """Continuous batching: queued jobs join the batch between steps while it has a free row;
        each step decodes every job in it; finished jobs leave."""
        batch, stopping = self.batch, False
        while not stopping or len(batch):
            while not stopping and not batch.full:
                try:    # wait for work only when there is nothing to decode
                    job = self._queue.get(block=not len(batch))
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif job.cancelled.is_set():
                    self._finish(job, {})
                else:
                    self._join(job)
            if not len(batch):
                continue
            try:
                finished = batch.step()
            except Exception:  # noqa: BLE001 - a failed step fails the request that made it fail, never the server
                log.exception("a step of %d requests failed; they rejoin one at a time", len(batch))
                self._recover()
                continue
            self._stepped(finished)

    def _stepped(self, finished) -> None:
        if self.batch.last_step is not None:      # None: the step read a prompt and decoded nothing
            self.metrics.observe_step(self.batch.last_step)
        for request in finished:
            job = self._job_of.pop(id(request))
            del self.running[job.id]
            self._finish(job, request.finish())

    def _recover(self) -> None:
        """After a failed step: which request made it fail is not known, so every request of the step
        leaves the batch and rejoins it one at a time, each from the tokens it has (a prefill of
        prompt + answer so far; a seeded draw depends on its position only, so the answer goes on as
        it would have), followed by one step. The request whose rejoining makes that step fail again
        is failed with the error (a 500 to its client); the others go on decoding."""
        jobs = [self._job_of.pop(id(r)) for r in self.batch.requests]
        for r in self.batch.requests:
            self.batch.cancel(r)
        chunk, self.batch.prefill_chunk = self.batch.prefill_chunk, None    # each rejoins whole
        try:
            self._rejoin(jobs)
        finally:
            self.batch.prefill_chunk = chunk

    def _rejoin(self, jobs: list[Job]) -> None:
        for job in jobs:
            del self.running[job.id]
            request = self._join(job)
            if request is None:
                continue
            try:
                finished = self.batch.step()
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed a step of its own", job.id)
                self.batch.cancel(request)
                del self._job_of[id(request)]
                self._fail(job, e)
                continue
            self._stepped(finished)

    def _join(self, job: Job):
        """Prefill ``job`` into the batch, from the tokens it has (none: a new request): its batch
        request while it decodes, None when it finished or failed at once."""
        r = job.request
        job.started = job.started or time.time()
        self.running[job.id] = job
        self.peak_batch = max(self.peak_batch, len(self.running))
        try:   # nothing a request brings may escape into the decode thread
            request = self.batch.add(job.prompt_ids + job.tokens, self.method, r.max_tokens - len(job.tokens),
                                     Sampling(r.temperature, r.top_p, r.seed), job.on_tokens)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed", job.id)
            self._fail(job, e)
            return None
        if request.done:
            del self.running[job.id]
            self._finish(job, request.finish())
            return None
        self._job_of[id(request)] = job
        return request

    def _finish(self, job: Job, stats: dict) -> None:
        job.finish(stats)
        self._ended(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        """A running job that raised: out of the running set, failed (a 500 to its client), ended."""
        del self.running[job.id]
        job.fail(error)
        self._ended(job)

    def _ended(self, job: Job) -> None:
        """Every job ends here, once, whatever its end: counted, and one log line with its id."""
        self.metrics.observe(job)
        s = job.stats
        log.info("%s %s %s prompt=%d completion=%d finish=%s %.2fs queue=%.2fs %.1f tok/s mat=%.2f",
                 job.id, job.request.kind, "stream" if job.request.stream else "block", len(job.prompt_ids),
                 len(job.tokens), job.finish_reason, job.finished - job.created,
                 (job.started or job.finished) - job.created, s.get("tokens_per_s", 0.0), s.get("mat", 0.0))

    def shutdown(self, grace: float) -> None:
        """Stop accepting; let queued and running jobs finish for ``grace`` seconds, then cancel the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace
        while (self._queue.qsize() or self.running) and time.monotonic() < deadline:
            time.sleep(0.05)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel(shutting_down=True)
                self._finish(job, {})
        for job in list(self.running.values()):
            job.cancel(shutting_down=True)
        self._queue.put(None)
        self._thread.join(timeout=60)
