"""Requests in flight: rows of the caches and context, joining and leaving between steps.

A ``Batch`` holds up to ``max_batch`` requests, request i in batch row i of the target's KV
cache, of the drafter's and of the batch's context buffer. ``add`` prefills a request into the
next free row; ``step`` runs ``graft_tk.step.decode_step`` for all of them (ONE target forward);
a request that finishes leaves, and the last row moves into its place, so the active requests
always fill rows [0, B) (continuous batching). One request is a batch of one: ``graft_tk.decode``
and ``Engine.generate`` run exactly this. A batch is made by ``Engine.batch`` from the engine's
runtime (the models, the KV pool) and its learnt state.

Requests of any methods and lengths share a batch: each row's tree draws on its method's sources
only, every tree is verified at the step's budget N. What the sources learn (M, the acceptance
rates) is the state's, shared by every request and kept when they leave. The budget N, threshold
tau and depth D follow the batch size (``policy``, from ``graft-calibrate --batch B``; N = 1 is
no speculation, D = 0 no drafting), held at the largest size of the last ``hold`` steps where
requests come and go.

A long prompt need not stall the requests decoding: with ``prefill_chunk`` a prompt that
arrives while others decode is read by the next steps, at most that many tokens each
(``graft_tk.step.Prefill``), in the row after theirs and in the same target forward as their
verify (``Transformer.forward_packed``: each weight is read once for both); it joins them once
read. With ``prefill_seconds`` too, a chunk is also at most what the batch's last steps carrying
one say it reads in that time (a slow device reads fewer tokens a step; the streams decoding
wait that much longer for their next tokens, not more). One prompt is read at a time (the batch
is ``full`` meanwhile), so a step carries at most one chunk, and a step that carries one (or
follows a new row's drafter window, ``_read_drafter``) does not draft: the streams would wait
for both. Without ``prefill_chunk`` (a library call) a prompt is read whole.

Memory: without ``max_len`` the caches grow to the longest request so far and stay there (a
library call, one process, one user). With ``max_len`` (graft-serve's ``--max-model-len``) they
are one fixed pool of ``max_batch`` rows of ``max_len`` tokens, allocated when the batch is made
and never grown: a longer request is refused, and a long request leaves nothing behind.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Mapping, Sequence

import torch

from .config import GraftConfig
from .drafting import waiting_rows
from .errors import InputError
from .methods import Method
from .models import exact
from .request import Request, RequestSpec
from .runtime import Runtime
from .sampling import Sampling
from .state import SpecState
from .stats import RequestStats
from .step import Prefill, StepRecord, decode_step

CONTEXT_MULTIPLE = 512   # the context buffer grows in steps of this many tokens (it is a shape of the step)
CHUNK_MULTIPLE = 32      # a chunk cut by ``prefill_seconds`` is a multiple of this many tokens (few shapes)


class Batch:
    """Up to ``max_batch`` requests decoding together on ``runtime``'s models, learning into
    ``state``, at ``config`` (the step config below every size of ``policy``)."""

    def __init__(self, runtime: Runtime, state: SpecState, config: GraftConfig, max_batch: int = 1,
                 policy: Mapping[int, GraftConfig] | None = None, hold: int = 0, max_len: int | None = None,
                 prefill_chunk: int | None = None, prefill_seconds: float | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be an int >= 1, got {max_batch!r}")
        context = runtime.target.config.max_position_embeddings
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)
                                    or not 2 <= max_len <= context):
            raise InputError(f"max_len must be an int in [2, {context}] (the model's context), got {max_len!r}")
        # The budget policy by batch size (graft-calibrate --batch B): batch size -> the config whose
        # N, tau and D a step of that many requests uses (the nearest calibrated size at or below it;
        # ``config`` below them all). A verify costs about B x N rows, so N falls as B grows; N = 1
        # turns speculation off at that size, D = 0 drafting.
        self.policy = dict(sorted((policy or {}).items()))
        if any(not isinstance(b, int) or b < 1 for b in self.policy):
            raise InputError(f"policy keys must be batch sizes >= 1, got {sorted(self.policy)}")
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise InputError(f"hold must be an int >= 0 (steps), got {hold!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise InputError(f"prefill_chunk must be None or an int >= 1 (tokens), got {prefill_chunk!r}")
        seconds_ok = isinstance(prefill_seconds, (int, float)) and not isinstance(prefill_seconds, bool)
        if prefill_seconds is not None and not (seconds_ok and prefill_seconds > 0):
            raise InputError(f"prefill_seconds must be None or a number > 0 (seconds), got {prefill_seconds!r}")
        if runtime.exact and prefill_chunk is not None:     # every reading of a prompt runs the same forwards
            prefill_chunk = -(-prefill_chunk // exact.PREFILL_GRID) * exact.PREFILL_GRID
            prefill_seconds = None
        self.prefill_chunk, self.prefill_seconds = prefill_chunk, prefill_seconds
        self.read_rate: float | None = None       # prompt tokens a second, as the last read or step carrying 64+ took
        self.prefilling: Prefill | None = None    # the prompt being read, in row len(self.rows)
        self.runtime, self.state, self.config = runtime, state, config
        self.max_batch, self.hold = max_batch, hold
        # The size a step plans for: the most requests of the last ``hold`` steps, at least the
        # requests in it (a server under steady load dips below B between one request's end and
        # the client's next; holding the plan keeps those steps from the small sizes' budgets).
        self._recent: deque[int] = deque(maxlen=max(hold, 1))
        configs = [config, *self.policy.values()]
        self.max_budget = max(c.budget for c in configs)
        self.max_depth = max(c.max_depth for c in configs)
        self.rows: list[Request] = []    # request i decodes in row i
        self.context = torch.zeros(max_batch, 0, dtype=torch.long, device=runtime.device)
        self.last_step: StepRecord | None = None
        self.max_len = max_len
        if max_len is not None:
            self._reserve(max_len)      # the fixed pool

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def requests(self) -> list[Request]:
        """Every request in the batch: those decoding, then the one whose prompt is being read."""
        return self.rows + ([self.prefilling.request] if self.prefilling is not None else [])

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_batch or self.prefilling is not None

    def add(self, ids: Sequence[int], method: str | Method, max_new_tokens: int, sampling: Sampling = Sampling(),
            on_tokens: Callable[[list[int]], bool | None] | None = None) -> Request:
        """``admit`` a request given by its prompt ids, method, length limit and sampling."""
        spec = RequestSpec.of(ids, method, max_new_tokens, sampling, self.runtime.target.config)
        return self.admit(spec, on_tokens)

    @torch.inference_mode()
    def admit(self, spec: RequestSpec, on_tokens: Callable[[list[int]], bool | None] | None = None,
              on_prefill: Callable[[int, int], None] | None = None) -> Request:
        """Prefill a request into the next free row and return it; it decodes from the next ``step``
        on (or is done already: its first token ended it, and it takes no row). ``on_tokens`` is
        called with each batch of committed tokens; True stops the request. ``on_prefill(read,
        total)`` after each chunk of the prompt the target reads."""
        method = spec.method
        if method.drafts and self.runtime.drafter is None:
            raise InputError(f"method {method.name!r} needs a drafter: pass drafter=load_model(...) (a small model "
                             "with the same tokenizer, or the target's first layers via num_layers=L) or an EAGLE-3 "
                             "head (load_eagle3(path, target))")
        if self.full:
            raise InputError(f"the batch is full ({self.max_batch} requests); step until one finishes")
        if self.max_len is not None and spec.tokens > self.max_len:
            raise InputError(f"prompt of {len(spec.ids)} tokens + max_new_tokens={spec.max_new_tokens} exceeds this "
                             f"batch's max_len of {self.max_len} tokens (graft-serve --max-model-len); shorten the "
                             "prompt or lower max_new_tokens")
        self.state.admit(method)
        self._reserve(spec.tokens if self.max_len is None else self.max_len)   # the pool: a no-op unless it was taken
        request = Request(spec, on_tokens, RequestStats(method.name, self.runtime.ops.backend), on_prefill=on_prefill)
        reading = Prefill(self.runtime, self.state, len(self.rows), request, speculates=self.max_budget > 1,
                          drafts=self.max_depth > 0)
        if self.prefill_chunk is not None and self.rows:
            self.prefilling = reading       # read by the next steps, a chunk each
        else:
            self._started(reading)
        return request

    def _started(self, reading: Prefill) -> None:
        """Read the rest of ``reading``'s prompt and start its request: it decodes from the next step on
        (or is done already: its first token ended it, and it takes no row)."""
        if not reading.read_all:
            self._read(reading)
        reading.finish(self.context[reading.row])
        if not reading.request.done:
            self.rows.append(reading.request)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One decode step for every request (its forward carrying the next chunk of a prompt being
        read); returns those that finished (their rows freed) or were done at their first token."""
        self.last_step, read, reading, chunk = None, False, None, 0
        if self.prefilling is None:
            read = self._read_drafter()     # no prompt chunk this step: a new row's drafter reads instead
        elif not self.rows:                 # nothing decodes: read the rest of the prompt and start it
            reading, self.prefilling = self.prefilling, None
            self._started(reading)
            return [reading.request] if reading.request.done else []
        else:                               # its next chunk rides in the rows' verify forward
            reading, chunk, read = self.prefilling, self.chunk(), True
        if not self.rows:
            return []
        size = len(self.rows)
        config = self.plan(max([size, *self._recent]) if self.hold else size)
        self._recent.append(size)
        controller = self.state.controller([r.method for r in self.rows])
        # a step after a read (a drafter's window, a prompt's chunk) does not draft: the rows'
        # streams would wait for both (3 rows of 2k-token prompts on a 2-core Zen 4: a 1.7 s
        # window read, then a 1.2 s drafting step; a 256-token chunk of a 4k prompt ~2.5 s)
        self.last_step = decode_step(self.runtime, self.state, controller, self.rows, self.context, config,
                                     may_draft=not read, chunk=reading, chunk_tokens=chunk)
        if self.last_step.prompt_tokens >= 2 * CHUNK_MULTIPLE:     # the rate of a step carrying a chunk
            self.read_rate = self.last_step.prompt_tokens / self.last_step.seconds
        finished = [r for r in self.rows if r.done]
        for r in finished:
            self._remove(r)
        if reading is not None and reading.read_all:    # its last chunk: it decodes from the next step on
            self.prefilling = None
            self._started(reading)
            finished += [reading.request] if reading.request.done else []
        return finished

    def chunk(self) -> int:
        """The prompt tokens the next step reads: ``prefill_chunk``, fewer where they would take
        more than about ``prefill_seconds`` at the measured ``read_rate`` (the nearest multiple of
        CHUNK_MULTIPLE: rounding down would shrink the chunks read after read, as a narrower read
        is a slower one per token)."""
        if self.prefill_seconds is None or self.read_rate is None:
            return self.prefill_chunk
        fit = round(self.read_rate * self.prefill_seconds / CHUNK_MULTIPLE) * CHUNK_MULTIPLE
        return min(self.prefill_chunk, max(CHUNK_MULTIPLE, fit))

    def _read(self, reading: Prefill, tokens: int | None = None) -> None:
        """``reading.read(tokens)``, timed: a read long enough to time well sets ``read_rate``."""
        before, t = reading.tokens_read, time.perf_counter()
        reading.read(tokens)
        if (n := reading.tokens_read - before) >= 2 * CHUNK_MULTIPLE:
            self.read_rate = n / (time.perf_counter() - t)

    def _read_drafter(self) -> bool:
        """Between steps, the first row waiting for its drafter's read (``drafting.waiting_rows``:
        it joined rows that draft; or, where none has read, one that decoded without drafting)
        reads its prompt, if drafting is due (the batch's controllers' ``may_draft``; never
        where steps of this size do not draft). Inside a step every row would wait for it, on
        top of a prompt chunk (after plain steps, a drafting step read every row's prompt: ~1.3 s
        each on a 2-core Zen 4); and a read the batch then does not draft from is lost. Returns
        whether a row read (the step after it then does not draft)."""
        drafter = self.runtime.drafter
        if drafter is None or self.plan(len(self.rows)).max_depth == 0:
            return False
        if not self.state.controller([r.method for r in self.rows]).may_draft():
            return False
        drafts = [r.method.drafts for r in self.rows]
        waiting = waiting_rows(drafter, drafts)
        if not any(waiting):    # none has read: rows that decoded without their drafter read here too
            waiting = [d and drafter.fresh(b) and r.stats.steps > 0
                       for b, (d, r) in enumerate(zip(drafts, self.rows))]
        if not any(waiting):
            return False
        b = waiting.index(True)
        t = time.perf_counter()
        read = drafter.read(b, self.context[b], self.rows[b].length, self.runtime.ops)
        self.rows[b].stats.seconds["draft"] += time.perf_counter() - t
        return read

    def plan(self, size: int) -> GraftConfig:
        """The config whose N, tau and D a step of ``size`` requests uses, from the policy."""
        config = self.config
        for b, c in self.policy.items():
            if b <= size:
                config = c
        return config

    def cancel(self, request: Request) -> None:
        """Take a request out of the batch before it finishes (a client that went away)."""
        if self.prefilling is not None and request is self.prefilling.request:
            request.done = True
            self.prefilling = None
        elif request in self.rows:
            request.done = True
            self._remove(request)

    def _reserve(self, tokens: int) -> None:
        """Every cache and the context with ``max_batch`` rows of room for a request of ``tokens``
        (prompt + new) and a step's tree after it; what rows hold is kept."""
        widest = max(self.max_budget, self.config.copy_budget)    # a copy's verify may be wider than N
        self.runtime.kv.reserve(self.max_batch, tokens, widest, self.config.top_k, self.max_depth)
        room = tokens + widest + 1
        if self.context.shape[1] < room:
            width = -(-room // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE
            grown = torch.full((self.max_batch, width), -1, dtype=torch.long, device=self.context.device)
            grown[:, :self.context.shape[1]] = self.context
            self.context = grown

    def _remove(self, request: Request) -> None:
        """Free ``request``'s row: the last row's request moves into it (its KV and context with it),
        and a prompt being read into the row after the last into the last."""
        row, last = self.rows.index(request), len(self.rows) - 1
        if row != last:
            self.runtime.kv.move(last, row)
            self.context[row] = self.context[last]
            self.rows[row] = self.rows[last]
        self.rows.pop()
        if self.prefilling is not None:
            self.runtime.kv.move(last + 1, last)
            self.prefilling.row = last


def decode_batch(batch: Batch, prompts: Sequence[Sequence[int]], method: str | Method, max_new_tokens: int,
                 sampling: Sampling = Sampling()) -> list[tuple[list[int], dict]]:
    """Decode token-id ``prompts`` in ``batch`` with continuous batching (a prompt joins as soon as
    a row is free): [(new tokens, stats)] in the prompts' order. A seed in ``sampling`` is the
    first prompt's; prompt i gets seed + i."""
    results: dict[int, tuple[list[int], dict]] = {}
    index: dict[int, int] = {}                   # id(request) -> prompt index
    pending = list(enumerate(prompts))
    while pending or len(batch):
        while pending and not batch.full:
            i, ids = pending.pop(0)
            seed = None if sampling.seed is None else sampling.seed + i
            request = batch.add(ids, method, max_new_tokens, Sampling(sampling.temperature, sampling.top_p, seed))
            if request.done:
                results[i] = (request.out, request.finish())
            else:
                index[id(request)] = i
        for request in batch.step():
            results[index.pop(id(request))] = (request.out, request.finish())
    return [results[i] for i in range(len(prompts))]
