"""``decode``: the public entry point. Prompt in, tokens and statistics out."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .backend import resolve_backend
from .compiled import Compile
from .config import GraftConfig
from .engine import Engine
from .errors import InputError
from .methods import Method, method as as_method
from .models import Model
from .models.eagle3 import Eagle3Head
from .profiles import find_profile
from .runtime import check_drafter
from .request import RequestSpec
from .sampling import Sampling


@dataclass
class DecodeResult:
    tokens: list[int]   # the new token ids (prompt excluded), EOS included when it was produced
    text: str           # the new tokens decoded, special tokens skipped
    stats: dict = field(default_factory=dict)


def encode_prompt(model: Model, prompt: str | Sequence[int] | Sequence[dict] | torch.Tensor, chat: bool) -> list[int]:
    """A string (chat template applied when ``chat`` and the model has one), a conversation (a list
    of ``{"role", "content"}`` messages, the last the user's: always through the chat template) or
    token ids -> ids."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("the prompt is empty; pass some text or token ids")
        if chat and tok.chat_template is not None:
            prompt = [{"role": "user", "content": prompt}]
        else:
            return tok.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        bad = [m for m in prompt if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str))]
        if bad or prompt[-1]["role"] != "user":
            raise InputError("a conversation is a list of {'role': str, 'content': str} messages ending with the "
                             f"user's; got e.g. {(bad or prompt)[-1]!r}")
        text = tok.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else list(prompt)   # checked by RequestSpec


def decode(target: Model, prompt: str | Sequence[int] | Sequence[dict] | torch.Tensor, *,
           drafter: Model | Eagle3Head | None = None,
           method: str = "ar", max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
           seed: int | None = None, chat: bool = True, config: GraftConfig | None = None,
           engine: Engine | None = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
           on_prefill: Callable[[int, int], None] | None = None,
           backend: str = "auto", compile: bool | str = False, exact: bool = False) -> DecodeResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with ``target``.

    prompt: text, a conversation (``[{"role": "user", "content": ...}, ...]``, the chat template
        applied) or token ids.
    method: "ar" (plain decoding), or a speculative method at budget ``config.budget``:
        "graft" (the default: pruned drafter tree + every retrieval source, the drafter run
        where it pays), "graft-paper" (the paper's pruned drafter tree + adjacency-matrix
        candidates in the freed budget), "tree" (drafter only, fixed depth), "pruned" (drafter,
        dynamic depth), "retrieval" (adjacency matrix only), "pld" (prompt lookup only),
        "suffix" (suffix decoding only), "tree+pld", "retrieval+pld"; ``graft_tk.methods``.
        Several sources share the budget by estimated acceptance (``graft_tk.acceptance``).
    drafter: a Model with the target's tokenizer (e.g. load_model(name, num_layers=L)), or an
        EAGLE-3 head for this target (``load_eagle3(path, target)``), drafting from the target's features.
    config: GraftConfig (N, tau, K, D, retrieval k and template; with ``cost``, the device's cost
        model, the methods that prune choose drafting and depth per step). Default: the profile
        that graft-calibrate wrote for this (target, drafter, device, dtype) when there is a usable
        one, else GraftConfig(). ``stats["config_source"]`` says which.
    engine: an Engine to reuse across calls, so the adjacency matrix stays warm.
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature) cut to ``top_p``.
    seed: fixes the sampled tokens: with the same seed every method gives the text plain
        sampling gives (``graft_tk.sampling``); None draws one (``stats["seed"]``).
    chat: apply the model's chat template to a string prompt.
    on_tokens: called with each batch of newly committed token ids (streaming); when it returns
        True, decoding stops after that batch (a stop string, a client that went away).
    on_prefill: called as ``on_prefill(read, total)`` after each chunk of the prompt the target
        reads (512 tokens a forward): a progress bar for a long prompt.
    backend: "auto" (Triton kernels on CUDA, torch elsewhere), "triton" or "torch"; without CUDA
        "triton" runs the kernels in Triton's interpreter (exact, slow: for tests).
    compile: True / "on": run the step forwards of the target and a drafter model compiled
        (``graft_tk.compiled``: torch.compile, fullgraph; CUDA graphs on a GPU); "drafter": only a
        drafter model's. The first call per model and shape compiles, which takes minutes on a
        small CPU.
    exact: every row of the target's forwards computes what it computes alone (a verify row what
        plain decoding's 1-row forward does), so greedy output and seeded sampling equal ``ar``'s
        with ``exact=True`` in bf16 too, whatever the tree or batch (``graft_tk.models.exact``;
        CPU, eager; docs/exactness.md says what it costs).
    """
    m = as_method(method)
    ids = encode_prompt(target, prompt, chat)
    spec = RequestSpec.of(ids, m, max_new_tokens, Sampling(temperature, top_p, seed), target.config)
    if engine is None:
        config, config_source = resolve_config(target, drafter, m, config)
        engine = Engine(target, drafter if m.drafts else None, config, backend, compile=compile, exact=exact)
    else:
        check_engine(engine, target, backend, compile, exact)
        config_source = "engine"
    tokens, stats = engine.generate(spec, on_tokens, on_prefill)
    if m.speculates:
        stats["config"] = dataclasses.asdict(engine.config)
    stats.update(config_source=config_source, compile=engine.runtime.compile.value, seed=spec.sampling.seed,
                 exact=engine.runtime.exact)
    return DecodeResult(tokens=tokens, text=target.tokenizer.decode(tokens), stats=stats)


def check_engine(engine: Engine, target: Model, backend: str, compile: bool | str, exact: bool = False) -> None:
    """An engine passed to ``decode`` must be this target's, on the backend and compile scope asked
    for, and exact when exactness is asked for."""
    if engine.target is not target:
        raise InputError(f"engine was built for {engine.target.name}, not {target.name}; pass the same target")
    if backend != "auto" and resolve_backend(backend, target.device) != engine.runtime.ops.backend:
        raise InputError(f"engine runs the {engine.runtime.ops.backend} backend, not {backend!r}; build "
                         f"Engine(..., backend={backend!r}) or leave backend='auto'")
    if Compile.of(compile) not in (Compile.OFF, engine.runtime.compile):
        raise InputError(f"the engine was built with compile={engine.runtime.compile.value!r}; build "
                         f"Engine(..., compile={compile!r})")
    if exact and not engine.runtime.exact:
        raise InputError("exact=True with an engine built without it; build Engine(..., exact=True)")


def resolve_config(target: Model, drafter: Model | Eagle3Head | None, method: Method, config: GraftConfig | None
                   ) -> tuple[GraftConfig, str]:
    """(config, where it came from): the caller's, a calibration profile, or the default; the
    drafter checked first (a bad one is an InputError, before any profile is read)."""
    check_drafter(target, drafter)
    if not method.speculates:
        return config or GraftConfig(), "none (ar)"
    if config is not None:
        return config, "explicit"
    if method.drafts and isinstance(drafter, Eagle3Head) and drafter.path is None:
        return GraftConfig(), "default (an EAGLE-3 head not loaded from a checkpoint has no profile)"
    profile = find_profile(target, drafter if method.drafts else None)   # warns on a stale or corrupt profile
    if profile is not None:
        return profile.config, f"profile {profile.path}"
    return GraftConfig(), "default"
