"""Anchors for graft-bench: what a user would run instead of graft_tk, timed in the same
interleaved loop as our methods.

HF transformers, on the same weights and dtype as our models:

    hf_greedy          generate(do_sample=False)                   plain decoding
    hf_assisted        generate(..., assistant_model=hf_drafter)   HF's draft-model speculation
    hf_prompt_lookup   generate(..., prompt_lookup_num_tokens=10)  HF's n-gram prompt lookup

llama.cpp (llama-cpp-python), on the GGUF file the target was converted from (its own 4-bit
kernels, so the CPU user's usual choice; outputs can differ from ours in the last bits):

    llama_cpp          Llama.generate                                       plain decoding
    llama_cpp_pld      Llama(draft_model=LlamaPromptLookupDecoding(10))     its prompt lookup

An anchor that fails (a package version without a feature, a model it cannot load) is recorded
and skipped with a warning; it never stops the benchmark.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from graft_tk.errors import InputError
from graft_tk.models import Model

log = logging.getLogger(__name__)

HF_ANCHORS = ("hf_greedy", "hf_assisted", "hf_prompt_lookup")
LLAMA_CPP_ANCHORS = ("llama_cpp", "llama_cpp_pld")
ANCHOR_NAMES = HF_ANCHORS + LLAMA_CPP_ANCHORS
# HF's own example value; it matches the depth of trees our methods verify at N = 16.
PROMPT_LOOKUP_NUM_TOKENS = 10
# llama.cpp's context: at least this (Spec-Bench's longest prompt is ~700 tokens), so the KV
# allocation is the same for every run of the short sets; a longer run's longest prompt + its new
# tokens, in multiples of 512.
LLAMA_CPP_CONTEXT = 4096
_PACKAGES = {"hf": "transformers", "llama_cpp": "llama_cpp"}
_INSTALL = {"hf": "pip install transformers", "llama_cpp": "pip install 'graft-tk[anchors]' (llama-cpp-python; "
            "it builds llama.cpp from source, ~25 min on 2 cores)"}


def _family(name: str) -> str:
    return "hf" if name in HF_ANCHORS else "llama_cpp"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def available_anchors() -> tuple[str, ...]:
    """The anchors whose package is installed: graft-bench's default."""
    return tuple(n for n in ANCHOR_NAMES if _importable(_PACKAGES[_family(n)]))


def parse_anchors(text: str | None) -> tuple[str, ...]:
    """``"all"`` / ``"none"`` / a comma list of ANCHOR_NAMES -> the anchors to run, in ANCHOR_NAMES
    order; None -> the available ones. A named anchor whose package is missing is an error."""
    if text is None:
        return available_anchors()
    if text == "none":
        return ()
    names = set(ANCHOR_NAMES) if text == "all" else {a.strip() for a in text.split(",") if a.strip()}
    unknown = sorted(names - set(ANCHOR_NAMES))
    if unknown or not names:
        raise InputError(f"unknown anchor(s) {', '.join(unknown) or repr(text)}; available: "
                         f"{', '.join(ANCHOR_NAMES)} (or all / none)")
    for family in dict.fromkeys(_family(n) for n in names):
        if not _importable(_PACKAGES[family]):
            asked = ", ".join(n for n in ANCHOR_NAMES if n in names and _family(n) == family)
            raise InputError(f"anchor(s) {asked} need {_PACKAGES[family]}: {_INSTALL[family]} "
                             "(or pass --no-anchors)")
    return tuple(a for a in ANCHOR_NAMES if a in names)


def make_anchors(target: Model, drafter, names: tuple[str, ...], gguf: Path | None, context: int = 0) -> Anchors | None:
    """The requested anchors, HF and llama.cpp, behind one ``status`` / ``names`` / ``run`` / ``fail``.
    ``gguf``: the target's GGUF file (None when it was not given as one: the llama.cpp anchors skip);
    ``context``: the longest prompt + new tokens of the run."""
    if not names:
        return None
    return Anchors([HFAnchors(target, drafter, tuple(n for n in names if n in HF_ANCHORS)),
                    LlamaCppAnchors(target, tuple(n for n in names if n in LLAMA_CPP_ANCHORS), gguf, context)])


class _AnchorSet:
    """``status`` maps every requested anchor to {"status": "ok" | "error" | "skipped", "error": str};
    ``names`` is the anchors still runnable. Call ``fail`` when a run raises."""

    def __init__(self, names: tuple[str, ...]):
        self.status: dict[str, dict] = {n: {"status": "ok"} for n in names}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.status.items() if s["status"] == "ok")

    def _record(self, name: str, status: str, message: str) -> None:
        self.status[name] = {"status": status, "error": message}
        log.warning("anchor %s %s: %s", name, "skipped" if status == "skipped" else "disabled", message)

    def fail(self, name: str, error: BaseException) -> None:
        self._record(name, "error", f"{type(error).__name__}: {error}")


class Anchors(_AnchorSet):
    """Several anchor sets as one: a name's run and failure go to the set that holds it."""

    def __init__(self, sets: list[_AnchorSet]):
        self._owner = {n: s for s in sets for n in s.status}

    @property
    def status(self) -> dict[str, dict]:
        return {n: s.status[n] for n, s in self._owner.items()}

    def fail(self, name: str, error: BaseException) -> None:
        self._owner[name].fail(name, error)

    def run(self, name: str, *args, **kwargs) -> tuple[list[int], dict]:
        return self._owner[name].run(name, *args, **kwargs)


def _timed(name: str, tokens: list[int], seconds: float, first_token_s: float | None = None) -> tuple[list[int], dict]:
    stats = {"method": name, "tokens": len(tokens), "seconds": seconds,
             "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0}
    if first_token_s is not None:       # as our runs report it: the prefill and the first token
        stats["prefill_seconds"] = first_token_s
    return tokens, stats


@contextlib.contextmanager
def _quiet_transformers():
    """Hide transformers' info, warnings and progress bars for the block (a self-drafter's
    skipped layers are reported as a table of UNEXPECTED weights; assisted generation warns about
    its own config); errors still show."""
    from transformers.utils import logging as hf_logging

    old, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()   # graft-bench draws its own progress bar
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        if bars:
            hf_logging.enable_progress_bar()


class HFAnchors(_AnchorSet):
    """HF models loaded from our checkpoints, and a ``run`` per anchor."""

    def __init__(self, target: Model, drafter, names: tuple[str, ...]):
        super().__init__(names)
        self.target, self.hf_target, self.hf_drafter = target, None, None
        if not names:
            return
        if target.quant != "none":
            for n in names:
                self._record(n, "skipped", f"HF runs float weights, the target is {target.quant}; "
                                           "llama_cpp is the quantized anchor")
            return
        try:
            import transformers
            self.hf_target = self._load(transformers, target)
        except Exception as e:  # noqa: BLE001 - any load failure disables the anchors, never the run
            for n in names:
                self._record(n, "error", f"loading the HF target failed: {type(e).__name__}: {e}")
            return
        if "hf_assisted" in names:
            if drafter is None:
                self._record("hf_assisted", "skipped", "needs a drafter (--drafter)")
            elif not isinstance(drafter, Model):
                self._record("hf_assisted", "skipped", "needs a drafter model; an EAGLE-3 head has no HF equivalent")
            else:
                try:
                    self.hf_drafter = self._load(transformers, drafter)
                except Exception as e:  # noqa: BLE001
                    self._record("hf_assisted", "error", f"loading the HF drafter failed: {type(e).__name__}: {e}")

    @staticmethod
    def _load(transformers, model: Model):
        # A self-drafter (load_model(..., num_layers=L)) reads the target's folder with fewer
        # layers; HF gets the same truncation through the num_hidden_layers config override.
        with _quiet_transformers():
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                model.path, dtype=model.dtype, num_hidden_layers=model.config.n_layers)
        return hf.to(model.device).eval()

    def run(self, name: str, ids: list[int], max_new_tokens: int, temperature: float,
            seed: int, top_p: float = 1.0) -> tuple[list[int], dict]:
        """One generate call -> (new tokens, stats with tokens / seconds / tokens_per_s)."""
        eos = self.target.eos_token_ids
        x = torch.tensor([ids], device=self.target.device)
        # Same stopping rule as our decode (any EOS id ends it; batch 1 needs no padding) and
        # explicit sampling knobs, so a checkpoint's generation_config cannot add top-k / top-p.
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                      eos_token_id=list(eos), pad_token_id=eos[0])
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=top_p)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False, top_p=None, top_k=None, temperature=None)
        if name == "hf_assisted":
            kwargs["assistant_model"] = self.hf_drafter
        elif name == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_NUM_TOKENS
        with torch.inference_mode(), _quiet_transformers():
            t0 = time.perf_counter()
            out = self.hf_target.generate(x, **kwargs)
            seconds = time.perf_counter() - t0
        return _timed(name, out[0, len(ids):].tolist(), seconds)


class LlamaCppAnchors(_AnchorSet):
    """llama.cpp on the target's GGUF file, one ``Llama`` per anchor (mmap shares the weights),
    on as many threads as torch uses. Prompt token ids are passed as they are: the GGUF's
    vocabulary is the one our tokenizer was built from."""

    def __init__(self, target: Model, names: tuple[str, ...], gguf: Path | None, context: int = 0):
        super().__init__(names)
        n_ctx = max(LLAMA_CPP_CONTEXT, -(-context // 512) * 512)
        self.target, self.llms = target, {}
        if not names:
            return
        if gguf is None:
            for n in names:
                self._record(n, "skipped", "needs the target as a GGUF file (a built-in model name or a .gguf path)")
            return
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            for n in names:
                pld = n == "llama_cpp_pld"
                # With a draft model the binding keeps every position's logits but sizes that buffer by
                # logits_all (else n_batch rows, and a prompt past 512 tokens fails): n_ctx x vocab fp32
                # (2.5 GB for Qwen2.5's vocabulary).
                self.llms[n] = llama_cpp.Llama(
                    model_path=str(gguf), n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_NUM_TOKENS) if pld else None,
                    logits_all=pld, verbose=False)
        except Exception as e:  # noqa: BLE001 - a load failure disables these anchors, never the run
            for n in names:
                self._record(n, "error", f"loading {gguf.name} in llama.cpp failed: {type(e).__name__}: {e}")

    def run(self, name: str, ids: list[int], max_new_tokens: int, temperature: float,
            seed: int, top_p: float = 1.0) -> tuple[list[int], dict]:
        """Stops like our decode: at any EOS id (kept) or after max_new_tokens."""
        llm, eos = self.llms[name], set(self.target.eos_token_ids)
        llm.reset()             # no KV prefix reused from the previous run: every run prefills
        llm.set_seed(seed)
        # greedy at temperature 0; else plain temperature / top-p sampling like ours (no top-k / min-p)
        knobs = dict(temp=temperature, top_k=0, top_p=top_p, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        tokens, first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(ids, **knobs):
            tokens.append(tok)
            first = first or time.perf_counter() - t0
            if tok in eos or len(tokens) == max_new_tokens:
                break
        return _timed(name, tokens, time.perf_counter() - t0, first)
