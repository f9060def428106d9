"""HF transformers anchors for graft-bench: what a user would run instead of graft_tk.

Three anchors on the same weights and dtype as our models, timed in the same interleaved loop:

    hf_greedy          generate(do_sample=False)                   plain decoding
    hf_assisted        generate(..., assistant_model=hf_drafter)   HF's draft-model speculation
    hf_prompt_lookup   generate(..., prompt_lookup_num_tokens=10)  HF's n-gram prompt lookup

An anchor that fails (a transformers version without a feature, a model it cannot load) is
recorded and skipped with a warning; it never stops the benchmark.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from .errors import InputError
from .models import Model

log = logging.getLogger(__name__)

ANCHOR_NAMES = ("hf_greedy", "hf_assisted", "hf_prompt_lookup")
# HF's own example value; it matches the depth of trees our methods verify at N = 16.
PROMPT_LOOKUP_NUM_TOKENS = 10


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def parse_anchors(text: str | None) -> tuple[str, ...]:
    """``"all"`` / ``"none"`` / a comma list of ANCHOR_NAMES -> the anchors to run, in ANCHOR_NAMES order."""
    if text is None or text == "none":
        return ()
    if text == "all":
        return ANCHOR_NAMES
    names = {a.strip() for a in text.split(",") if a.strip()}
    unknown = sorted(names - set(ANCHOR_NAMES))
    if unknown or not names:
        raise InputError(f"unknown anchor(s) {', '.join(unknown) or repr(text)}; available: "
                         f"{', '.join(ANCHOR_NAMES)} (or all / none)")
    return tuple(a for a in ANCHOR_NAMES if a in names)


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


class HFAnchors:
    """HF models loaded from our checkpoints, and a ``run`` per anchor.

    ``status`` maps every requested anchor to {"status": "ok" | "error" | "skipped", "error": str};
    ``names`` is the anchors still runnable. Call ``fail`` when a run raises.
    """

    def __init__(self, target: Model, drafter, names: tuple[str, ...]):
        self.status: dict[str, dict] = {n: {"status": "ok"} for n in names}
        self.target, self.hf_target, self.hf_drafter = target, None, None
        if not names:
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.status.items() if s["status"] == "ok")

    @staticmethod
    def _load(transformers, model: Model):
        # A self-drafter (load_model(..., num_layers=L)) reads the target's folder with fewer
        # layers; HF gets the same truncation through the num_hidden_layers config override.
        with _quiet_transformers():
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                model.path, dtype=model.dtype, num_hidden_layers=model.config.n_layers)
        return hf.to(model.device).eval()

    def _record(self, name: str, status: str, message: str) -> None:
        self.status[name] = {"status": status, "error": message}
        log.warning("anchor %s %s: %s", name, "skipped" if status == "skipped" else "disabled", message)

    def fail(self, name: str, error: BaseException) -> None:
        self._record(name, "error", f"{type(error).__name__}: {error}")

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
        tokens = out[0, len(ids):].tolist()
        return tokens, {"method": name, "tokens": len(tokens), "seconds": seconds,
                        "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0}
