"""Peak memory of a long prefill with retrieval on (the adjacency matrix warmed from the prompt).

    python bench/prefill_memory.py --model smollm2-135m --dtype fp32 --tokens 4096
    PYTHONPATH=OTHER_CHECKOUT python bench/prefill_memory.py ...     # the same on another version

Decodes one token with ``method="retrieval"`` from a prompt of ``--tokens`` real tokens (HumanEval
and math prompts joined until long enough), so the run is the prefill and the warm-up of M from
every prompt position. Reports the peak memory the prefill added over what the loaded model and
a short warm-up decode already held: on CUDA ``torch.cuda.max_memory_allocated``; on a CPU the
process's resident set, sampled every 2 ms by a thread while the prefill runs (torch releases the
GIL in its ops), against the resident set just before; it also counts the allocator's caching.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time

import torch

import graft_tk
from graft_tk.bench.prompts import load_prompts


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class RssPeak:
    """The largest resident set seen while the ``with`` block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.peak, self.done = rss_mb(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mb())


def long_prompt(model, n_tokens: int) -> list[int]:
    ids: list[int] = []
    for p in load_prompts("humaneval,math"):
        ids += model.tokenizer.encode(p.text + "\n\n", add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise SystemExit(f"the built-in prompts hold only {len(ids)} tokens; ask for fewer --tokens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default=None)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    model = graft_tk.load_model(args.model, dtype=args.dtype, device=args.device, progress=False)
    ids = long_prompt(model, args.tokens)
    cuda = model.device.type == "cuda"
    engine = graft_tk.Engine(model)
    graft_tk.decode(model, ids[:64], method="retrieval", engine=engine, max_new_tokens=2)   # allocator warm
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mb()
    t0 = time.perf_counter()
    with RssPeak() as rss:
        graft_tk.decode(model, ids, method="retrieval", engine=engine, max_new_tokens=1)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss.peak
    V = model.config.vocab_size
    row = {"model": model.name, "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
           "tokens": len(ids), "vocab": V, "peak_added_mb": peak - base, "prefill_s": seconds,
           "all_logits_fp32_mb": len(ids) * V * 4 / 2**20}
    print(f"{model.name} {row['dtype']} on {row['device']}: a {len(ids)}-token prefill with retrieval added "
          f"{row['peak_added_mb']:,.0f} MB at its peak ({seconds:.1f} s); [n, V] fp32 logits would be "
          f"{row['all_logits_fp32_mb']:,.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
