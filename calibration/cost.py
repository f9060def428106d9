"""Measuring a ``StepCost`` on this device: the forward-cost curves and a step's overhead.

Forwards are timed at a few widths (1, 2, 3, 4, 6, 8, 12, 16, ...) after ``context`` cached
tokens and interpolated in between; a curve is made non-decreasing (a wider forward never costs
less; what looks cheaper is timing noise). How a verify grows with the context: the target's
curve is timed again after ``context + LONG_CONTEXT`` cached tokens, and the difference per 1,000
tokens is ``StepCost.verify_ms_per_1k`` (attention reads every cached key, linearly; on a 2-core
CPU a one-token forward at 3,000 cached tokens costs ~1.1x its cost at 100, on a GPU at tens of
thousands it is most of the forward). A drafter reads a window of the prompt: one curve.
"""
from __future__ import annotations

from typing import Callable

import torch

from graft_tk.compiled import Compile, StepForward
from graft_tk.cost import StepCost, forward_ms, median_ms
from graft_tk.engine import Engine
from graft_tk.models.eagle3 import Eagle3Head
from graft_tk.tree import Tree

SAMPLE_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LONG_CONTEXT = 2048     # the verify curve is timed again this many cached tokens further


def interpolate(points: dict[int, float], n_max: int) -> tuple[float, ...]:
    """Values at 1 .. n_max from values at some widths: linear in between, flat past the last,
    then a running max (non-decreasing)."""
    xs = sorted(points)
    out, best = [], 0.0
    for n in range(1, n_max + 1):
        hi = next((x for x in xs if x >= n), xs[-1])
        lo = max((x for x in xs if x <= n), default=xs[0])
        v = points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        best = max(best, v)
        out.append(best)
    return tuple(out)


def forward_curve(net, run, device: torch.device, n_max: int, context: int, repeats: int,
                  progress: Callable[[str], None] | None = None) -> tuple[float, ...]:
    """A model's forward cost at 1 .. n_max tokens after ``context`` cached ones (random KV: what is
    read costs the same as a prefill's)."""
    with torch.inference_mode():
        net.setup_cache(context + n_max)
        net.kv.normal_(0, 0.5)
    points = {}
    for q in [w for w in SAMPLE_WIDTHS if w < n_max] + [n_max]:
        points[q] = forward_ms(run, device, q, context, repeats)
        if progress:
            progress(f"{q} tokens: {points[q]:.1f} ms")
    return interpolate(points, n_max)


def measure_step_cost(target, drafter, config, compile: bool | Compile = False, context: int = 256, repeats: int = 3,
                      progress: Callable[[str], None] | None = None, n_max: int | None = None) -> StepCost:
    """Measure ``StepCost`` for this target (and drafter: a ``Model`` or an EAGLE-3 head) on their
    device, up to ``n_max`` tokens (default ``config.budget``); ``compile``: the compiled step
    forwards (graft_tk.compiled).

    The forwards are timed alone; ``step_ms`` is what a short real decode (``graft``, or
    ``retrieval`` without a drafter) spends per step outside them. Clobbers the models' KV caches
    (no decode may be running on them).
    """
    device, n_max = target.device, max(n_max or 0, config.budget)
    say = progress or (lambda msg: None)
    scope = Compile.of(compile)
    step = StepForward(target.net, scope.target)
    say(f"target {target.name}: forwards of 1 .. {n_max} tokens after {context} cached")
    verify = forward_curve(target.net, step, device, n_max, context, repeats, say)
    further = min(LONG_CONTEXT, target.config.max_position_embeddings - n_max - context)
    per_1k: tuple[float, ...] = ()
    if further > 0:
        say(f"target {target.name}: forwards of 1 .. {n_max} tokens after {context + further} cached")
        long = forward_curve(target.net, step, device, n_max, context + further, repeats, say)
        per_1k = tuple(max(0.0, (b - a) * 1000 / further) for a, b in zip(verify, long))
    draft: tuple[float, ...] = ()
    if isinstance(drafter, Eagle3Head):
        width = drafter.config.fused_size

        def head(t, p, s):
            return drafter(t, p, s, features=torch.randn(1, t.shape[1], width, device=device,
                                                           dtype=drafter.fc.weight.dtype))
        say(f"EAGLE-3 head: forwards of 1 .. {n_max} entries")
        draft = forward_curve(drafter, head, device, n_max, context, repeats, say)
    elif drafter is not None:
        dstep = StepForward(drafter.net, scope.drafter, dynamic=True)
        say(f"drafter {drafter.name}: forwards of 1 .. {n_max} tokens")
        draft = forward_curve(drafter.net, dstep, device, n_max, context, repeats, say)
    say("the rest of a step: a short decode")
    engine = Engine(target, drafter, config, compile=scope)
    prompt = target.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    _, stats = engine.generate(engine.request(prompt, "graft" if drafter is not None else "retrieval", 24))
    split = stats["time_split"]
    # Acceptance runs in the decode's "verify" phase, with the forward: timed alone.
    step_ms = 1000 * (split["retrieve"] + split["commit"]) / max(stats["steps"], 1) + accept_ms(engine, repeats)
    return StepCost(verify_ms=verify, draft_ms=draft, step_ms=step_ms, context=context, verify_ms_per_1k=per_1k)


def accept_ms(engine, repeats: int) -> float:
    """Median milliseconds of the engine's choice + acceptance (with its M update) of a tree at its
    budget N (a chain of N nodes, random logits); what a step spends on it does not depend on the tokens."""
    device, n, vocab = engine.target.device, engine.config.budget, engine.target.config.vocab_size
    table = engine.state.successors
    g = torch.Generator().manual_seed(0)
    tree = Tree.from_lists(torch.randint(vocab, (n,), generator=g).tolist(), list(range(-1, n - 1)), device=device)
    logits = torch.randn(1, n, vocab, generator=g).to(device)
    adjacency = table.successors.clone()
    mask, writes = tree.packed_mask()[None], torch.ones(1, dtype=torch.bool, device=device)

    def run():
        choice = logits.argmax(-1)
        return engine.runtime.ops.accept(tree.tokens[None], tree.parents[None], tree.depth[None], mask, choice, logits,
                                 adjacency, writes)
    return median_ms(run, device, repeats)
