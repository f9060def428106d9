"""docs/retrieval.md section 1: M's rank of the target's actual next token, per position in the step.

    .venv/bin/python docs/retrieval/m_rank.py
M is copied before every step, so each rank is M's prediction before that step's update.
"""
import collections, torch, graft_tk
from graft_tk.batch import Batch
from graft_tk.decode import encode_prompt, resolve_config
from graft_tk.engine import Engine
from graft_tk.methods import METHODS
t = graft_tk.load_model("qwen2.5-coder-1.5b", dtype="bf16", progress=False)
d = graft_tk.load_model("qwen2.5-coder-0.5b", dtype="bf16", progress=False)
cfg, _ = resolve_config(t, d, METHODS["graft"], None)
prompts = ["Write a Python function that checks whether a string is a palindrome, with tests.",
           "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Think step by step.",
           "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again. Then the dog wakes up and the fox runs away."]
e = Engine(t, d, cfg)
ranks = collections.Counter(); by_pos = collections.defaultdict(collections.Counter); total = 0
for p in prompts:
    ids = encode_prompt(t, p, chat=True)
    batch = Batch(e, 1)
    with torch.inference_mode():
        req = batch.add(ids, "graft", 64)
        while len(batch):
            M = e.state.source("adjacency").matrix.clone()
            before = list(ids) + req.out
            n0 = len(req.out)
            batch.step()
            new = req.out[n0:]
            prev = before[-1]
            for i, tok in enumerate(new):
                row = M[prev].tolist()
                r = row.index(tok) if tok in row else -1
                ranks[r] += 1; by_pos[i + 1][r] += 1; total += 1
                prev = tok
print("tokens", total)
print("rank of the actual next token in M[previous token] (-1: absent):",
      {k: round(v / total, 3) for k, v in sorted(ranks.items())})
for pos, c in sorted(by_pos.items()):
    n = sum(c.values())
    print(f"position {pos} in the step: n={n} rank0={c[0]/n:.2f} in-top8={(n - c[-1])/n:.2f}")
