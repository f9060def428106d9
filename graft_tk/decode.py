"""``decode``: the public entry point. Prompt in, tokens and statistics out."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .backend import HOST_READS, resolve_backend
from .compiled import StepForward
from .config import METHODS, USES_DRAFTER, GraftConfig
from .engine import Engine
from .errors import InputError
from .models import Model
from .models.eagle3 import Eagle3Head
from .ops import ops_for
from .sampling import check_sampling_args, next_token, sampling_generator


@dataclass
class DecodeResult:
    tokens: list[int]   # the new token ids (prompt excluded), EOS included when it was produced
    text: str           # the new tokens decoded, special tokens skipped
    stats: dict = field(default_factory=dict)


def encode_prompt(model: Model, prompt: str | Sequence[int] | torch.Tensor, chat: bool) -> list[int]:
    """A string (chat template applied when ``chat`` and the model has one) or token ids -> ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("the prompt is empty; pass some text or token ids")
        tok = model.tokenizer
        if chat and tok.chat_template is not None:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt, add_special_tokens=True)
    ids = prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if not ids:
        raise InputError("the prompt is empty; pass some text or token ids")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < model.config.vocab_size)]
    if bad:
        raise InputError(f"prompt token ids must be ints in [0, {model.config.vocab_size}); got e.g. {bad[:3]}")
    return ids


def decode(target: Model, prompt: str | Sequence[int] | torch.Tensor, *, drafter: Model | Eagle3Head | None = None,
           method: str = "ar", max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
           seed: int | None = None, chat: bool = True, config: GraftConfig | None = None,
           engine: Engine | None = None, on_tokens: Callable[[list[int]], None] | None = None,
           backend: str = "auto", compile: bool = False) -> DecodeResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with ``target``.

    method: "ar" (plain decoding), or a speculative method at budget ``config.budget``:
        "tree" (drafter only, fixed depth), "pruned" (drafter, dynamic depth), "retrieval"
        (adjacency matrix only), "graft" (pruned drafter tree + adjacency-matrix candidates in the
        freed budget), "pld" (prompt lookup only), and "graft+pld", "tree+pld", "retrieval+pld"
        (prompt lookup as one more source). Several sources share the budget by estimated
        acceptance (``graft_tk.acceptance``).
    drafter: a Model with the target's tokenizer (e.g. load_model(name, num_layers=L)), or an
        EAGLE-3 head for this target (``load_eagle3(path, target)``), drafting from the target's features.
    config: GraftConfig (N, tau, K, D, retrieval k and template; with ``cost``, the device's cost
        model, the methods that prune choose drafting, depth and budget per step). Default: the
        profile that graft-calibrate wrote for this (target, drafter, device, dtype) when there is
        a usable one, else GraftConfig(). ``stats["config_source"]`` says which.
    engine: an Engine to reuse across calls, so the adjacency matrix stays warm.
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature) cut to ``top_p``.
    seed: makes sampling reproducible.
    chat: apply the model's chat template to a string prompt.
    on_tokens: called with each batch of newly committed token ids (streaming); when it returns
        True, decoding stops after that batch (a stop string, a client that went away).
    backend: "auto" (Triton kernels on CUDA, torch elsewhere), "triton" or "torch"; without CUDA
        "triton" runs the kernels in Triton's interpreter (exact, slow: for tests).
    compile: run the step forwards (not the prefill) of the target and a drafter model compiled
        (``graft_tk.compiled``: torch.compile, fullgraph, fixed shapes; CUDA graphs on a GPU). The
        first call per model and shape compiles, which takes minutes on a small CPU.
    """
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    if engine is not None:
        if engine.target is not target:
            raise InputError(f"engine was built for {engine.target.name}, not {target.name}; pass the same target")
        if backend != "auto" and resolve_backend(backend, target.device) != engine.ops.backend:
            raise InputError(f"engine runs the {engine.ops.backend} backend, not {backend!r}; build "
                             f"Engine(..., backend={backend!r}) or leave backend='auto'")
        if compile and not engine.compile:
            raise InputError("the engine was built with compile=False; build Engine(..., compile=True)")
        drafter, config, compile = engine.drafter, engine.config, engine.compile
    backend = resolve_backend(backend, target.device)
    check_drafter(target, drafter)
    config, config_source = resolve_config(target, drafter, method, config, engine)
    if method in USES_DRAFTER and drafter is None:
        raise InputError(f"method {method!r} needs a drafter: pass drafter=load_model(...) (a small model with the "
                         "same tokenizer, or the target's first layers via num_layers=L) or an EAGLE-3 head "
                         "(load_eagle3(path, target))")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling_args(temperature, top_p)
    ids = encode_prompt(target, prompt, chat)
    context = target.config.max_position_embeddings
    if len(ids) + max_new_tokens > context:
        raise InputError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {context} tokens; shorten the prompt or lower max_new_tokens")
    generator = sampling_generator(target.device, temperature, seed)
    with torch.inference_mode():
        if method == "ar" or max_new_tokens == 0:
            tokens, stats = _decode_ar(target, ids, max_new_tokens, temperature, top_p, generator, on_tokens,
                                       compile, ops_for(backend, target.device).tree_attention)
        else:
            engine = engine or Engine(target, drafter, config, backend, compile=compile)
            tokens, stats = engine.generate(ids, method, max_new_tokens, temperature, top_p, generator, on_tokens)
    if method != "ar":
        stats["config"] = dataclasses.asdict(config)
    stats["config_source"] = config_source
    stats["compile"] = compile
    return DecodeResult(tokens=tokens, text=target.tokenizer.decode(tokens), stats=stats)


def check_drafter(target: Model, drafter) -> None:
    """A drafter must be a Model sharing the target's tokenizer, or an EAGLE-3 head built for this target."""
    if drafter is None:
        return
    if isinstance(drafter, Eagle3Head):
        c = drafter.config
        problems = []
        if c.vocab_size != target.config.vocab_size:
            problems.append(f"vocab {c.vocab_size} vs the target's {target.config.vocab_size}")
        if c.target_hidden_size != target.config.dim:
            problems.append(f"target hidden size {c.target_hidden_size} vs the target's {target.config.dim}")
        if not all(0 <= i < target.config.n_layers for i in c.target_layers):
            problems.append(f"target layers {c.target_layers} vs the target's {target.config.n_layers} layers")
        if drafter.lm_head.weight.device != target.device:
            problems.append(f"device {drafter.lm_head.weight.device} vs the target's {target.device}")
        if problems:
            raise InputError(f"the EAGLE-3 head was not built for {target.name}: {'; '.join(problems)}; "
                             "load a head trained for this target (load_eagle3(path, target))")
        return
    if not isinstance(drafter, Model):
        raise InputError(f"drafter must be a Model (load_model) or an EAGLE-3 head (load_eagle3), "
                         f"got {type(drafter).__name__}")
    if drafter.config.vocab_size != target.config.vocab_size:
        raise InputError(f"drafter {drafter.name} has vocab {drafter.config.vocab_size}, target {target.name} has "
                         f"{target.config.vocab_size}; the drafter must share the target's tokenizer")


def resolve_config(target: Model, drafter: Model | Eagle3Head | None, method: str, config: GraftConfig | None,
                    engine: Engine | None) -> tuple[GraftConfig | None, str]:
    """(config, where it came from): the engine's, the caller's, a calibration profile, or the default."""
    if method == "ar":
        return config, "none (ar)"
    if engine is not None:
        return config, "engine"
    if config is not None:
        return config, "explicit"
    if method in USES_DRAFTER and isinstance(drafter, Eagle3Head) and drafter.path is None:
        return GraftConfig(), "default (an EAGLE-3 head not loaded from a checkpoint has no profile)"
    from .calibration.profiles import find_profile  # json only; warns on a stale or corrupt profile
    profile = find_profile(target, drafter if method in USES_DRAFTER else None)
    if profile is not None:
        return profile.config, f"profile {profile.path}"
    return GraftConfig(), "default"


def _decode_ar(model: Model, ids: list[int], max_new_tokens: int, temperature: float, top_p: float,
               generator, on_tokens, compile: bool = False, attention=None) -> tuple[list[int], dict]:
    """Plain autoregressive decoding: one target forward per token."""
    net, device = model.net, model.device
    step = StepForward(net, compile)
    eos = set(model.eos_token_ids)
    t0, reads_before = time.perf_counter(), HOST_READS.count
    n = len(ids)
    net.setup_cache(n + max_new_tokens)
    out: list[int] = []
    if max_new_tokens > 0:
        logits = net(torch.tensor([ids], device=device), torch.arange(n, device=device), 0, last_only=True,
                     attention=attention)
        t_prefill = time.perf_counter() - t0
        pos = n
        while True:
            tok = next_token(logits[:, -1], temperature, top_p, generator)  # [1]
            t = HOST_READS.read(tok[0])  # one host read per token: the stop test and streaming need it
            out.append(t)
            stop = on_tokens is not None and on_tokens([t])
            if stop or t in eos or len(out) == max_new_tokens:
                break
            logits = step(tok[:, None], torch.tensor([pos], device=device), pos, attention=attention)
            pos += 1
    else:
        t_prefill = 0.0
    seconds = time.perf_counter() - t0
    stats = {
        "method": "ar", "prompt_tokens": n, "tokens": len(out), "steps": len(out),
        "target_forwards": len(out), "mat": 1.0,
        "host_syncs_per_step": (HOST_READS.count - reads_before) / max(len(out), 1),
        "seconds": seconds, "prefill_seconds": t_prefill,
        "tokens_per_s": len(out) / seconds if seconds > 0 else 0.0,
    }
    return out, stats
