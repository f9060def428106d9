"""``GraftProposer``: what vLLM's ``custom_class`` speculative method builds and calls.

Options come from ``additional_config={"graft": {...}}`` (``OPTIONS``); the work is
``graft_tk.integrations.chain.ChainProposer``'s, this class only adapts vLLM's calls to it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...errors import InputError
from ...models import load_model, registry
from ...models.quant import cpu_drafter_quant
from ..chain import ChainConfig, ChainProposer
from . import hooks

log = logging.getLogger(__name__)

OPTIONS = {
    "drafter": "graft_tk model spec of the drafter: a built-in name, a checkpoint folder or a .gguf file; "
               "'none': prompt lookup and M only. Default: the built-in pair of a built-in target, else 'none'",
    "drafter_quant": "none | int8 | int4 | int4-all. Default: int4-all on a CPU in bf16 / fp16, else none",
    "drafter_layers": "keep only the drafter's first L layers (a self-drafter from the target's own folder)",
    "tau": "the drafter stops where its chain's probability falls below tau (default 0.1)",
    "fill_min": "a retrieved token joins while the chain's estimated probability stays >= fill_min (default 0.05)",
    "pld_max_ngram": "longest suffix n-gram prompt lookup matches (default 3)",
}


class GraftProposer:
    """vLLM's proposer object: built with the engine's config, ``load_model`` once, ``propose`` per step."""

    def __init__(self, vllm_config):
        hooks.install()
        self.vllm_config = vllm_config
        spec, model = vllm_config.speculative_config, vllm_config.model_config
        extra = vllm_config.additional_config or {}
        self.options = dict(extra.get("graft", {})) if isinstance(extra, dict) else {}
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise InputError(f"unknown graft option(s) {unknown} in additional_config['graft']; valid: "
                             + "; ".join(f"{k}: {v}" for k, v in OPTIONS.items()))
        self.config = ChainConfig(
            k=spec.num_speculative_tokens, max_len=model.max_model_len,
            **{k: self.options[k] for k in ("tau", "fill_min", "pld_max_ngram") if k in self.options})
        self.chain: ChainProposer | None = None
        self.runner = None

    # ------------------------------------------------------------------ vLLM's calls
    def load_model(self, target_model=None, *args, **kwargs) -> None:
        """Load the drafter (vLLM calls this once the target is loaded)."""
        if self.chain is not None:
            return
        model = self.vllm_config.model_config
        dtype = model.dtype if isinstance(model.dtype, torch.dtype) else torch.bfloat16
        spec = self.options.get("drafter", default_drafter(model.model))
        drafter = None
        if spec not in (None, "none"):
            quant = self.options.get("drafter_quant") or cpu_drafter_quant("cpu", dtype) or "none"
            drafter = load_model(spec, dtype=dtype, device="cpu", quant=quant,
                                 num_layers=self.options.get("drafter_layers"), progress=False)
            if drafter.config.vocab_size > model.get_vocab_size():
                raise InputError(f"the drafter {spec!r} has {drafter.config.vocab_size} tokens, the target "
                                 f"{model.get_vocab_size()}: a drafter must share the target's tokenizer")
            log.info("graft_tk proposer: drafter %r", drafter)
        else:
            log.info("graft_tk proposer: no drafter (prompt lookup and M only)")
        self.chain = ChainProposer(self.config, model.get_vocab_size(), drafter)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        if self.chain is None:
            self.load_model()
        if self.runner is None:
            raise RuntimeError("graft_tk's proposer was not given the model runner: its runner hooks are not "
                               "installed (graft_tk.integrations.vllm.hooks.install)")
        with torch.inference_mode():
            return self.chain.propose(self.runner.input_batch.req_ids, sampled_token_ids, num_tokens_no_spec,
                                      token_ids_cpu)

    # ------------------------------------------------------------------ the hooks' calls
    def bind(self, runner) -> None:
        self.runner = runner

    def forget(self, req_ids) -> None:
        if self.chain is not None and req_ids:
            self.chain.forget(req_ids)

    def observe_logits(self, tokens, logits) -> None:
        if self.chain is not None:
            with torch.inference_mode():
                self.chain.observe_logits(tokens, logits)

    @property
    def stats(self) -> dict:
        return self.chain.stats.as_dict() if self.chain is not None else {}


def default_drafter(target: str) -> str | None:
    """The built-in drafter of a built-in target served from its converted folder (``model_path``)."""
    path = Path(target).expanduser().resolve()
    for entry in registry.REGISTRY.values():
        if entry.drafter and path in (registry.converted_dir(entry.name).resolve(),
                                      registry.converted_dir(entry.name + "-bf16").resolve()):
            return entry.drafter
    return None
