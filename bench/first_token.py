"""Time to first token and peak memory of each method on one long prompt, one process per method.

    python -m bench.first_token --context 8k --methods ar,graft --max-new-tokens 16

Each method runs in a fresh process (so its peak RSS is its own: the models, the KV cache of a
prompt of that size, the prefill's activations) on the long set's code edit at that size
(``graft_tk.bench.long_prompts``), bf16, the built-in Qwen pair with the default drafter; it
prints one line per method: prompt tokens, time to first token, decode tokens/s, peak RSS.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def one(method: str, context: str, max_new_tokens: int) -> dict:
    import graft_tk
    from graft_tk.bench.long_prompts import long_prompts
    from graft_tk.decode import encode_prompt
    from graft_tk.models.quant import cpu_drafter_quant

    target = graft_tk.load_model("qwen2.5-coder-1.5b", dtype="bf16")
    drafter = None
    if method != "ar":
        drafter = graft_tk.load_model("qwen2.5-coder-0.5b", dtype="bf16",
                                      quant=cpu_drafter_quant(target.device, target.dtype) or "none")
    prompt = next(p for p in long_prompts(context) if p.category.startswith("code-edit"))
    ids = encode_prompt(target, prompt.text, chat=True)
    r = graft_tk.decode(target, ids, drafter=drafter, method=method, max_new_tokens=max_new_tokens)
    s = r.stats
    decode_s = s["seconds"] - s["prefill_seconds"]
    return {"method": method, "prompt_tokens": len(ids), "first_token_s": round(s["prefill_seconds"], 2),
            "decode_tok_s": round((len(r.tokens) - 1) / decode_s, 2) if decode_s > 0 else None,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", default="8k", help="long-set size: 1k, 2k, 4k or 8k (default 8k)")
    p.add_argument("--methods", default="ar,graft")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--one", help=argparse.SUPPRESS)       # the child process: this method only
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.context, args.max_new_tokens)))
        return 0
    for method in args.methods.split(","):
        out = subprocess.run([sys.executable, "-m", "bench.first_token", "--one", method, "--context", args.context,
                              "--max-new-tokens", str(args.max_new_tokens)], capture_output=True, text=True)
        if out.returncode:
            print(f"{method}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        print(out.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
