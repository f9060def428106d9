"""One vLLM engine in this process: generate batch A, then batch B, print what the tests check as JSON.

    python tests_vllm/run_llm.py SPEC.json   (SPEC: model, llm kwargs, prompts_a, prompts_b, max_tokens, ids)
"""
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # one process: the proposer is inspectable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def prompt(p):
    return {"prompt_token_ids": p} if isinstance(p, list) else p


def main():
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], max_model_len=256, enforce_eager=True, max_num_seqs=4, **spec["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    proposer = getattr(runner, "drafter", None)
    result = {}
    for batch in ("a", "b"):
        outs = llm.generate([prompt(p) for p in spec["prompts_" + batch]], params, use_tqdm=False)
        result["outputs_" + batch] = [list(o.outputs[0].token_ids) for o in outs]
        result["ids_" + batch] = [o.request_id for o in outs]
        if proposer is not None and hasattr(proposer, "chain"):
            result["live_after_" + batch] = proposer.chain.live_requests
    if proposer is not None and hasattr(proposer, "chain"):
        result["stats"] = proposer.stats
        result["adjacency_filled"] = int((proposer.chain.matrix[:, 0] >= 0).sum())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
