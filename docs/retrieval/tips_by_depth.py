"""docs/retrieval.md section 3: tree vs graft (retrieval grafted at the drafter's tips) at several
depths D, with the retrieval nodes tried and accepted by tree depth.

    .venv/bin/python docs/retrieval/tips_by_depth.py
"""
import dataclasses, time, collections, graft_tk
from graft_tk.decode import encode_prompt, resolve_config
from graft_tk.methods import METHODS
from graft_tk.engine import Engine
t = graft_tk.load_model("qwen2.5-coder-1.5b", dtype="bf16", progress=False)
d = graft_tk.load_model("qwen2.5-coder-0.5b", dtype="bf16", progress=False)
base, src = resolve_config(t, d, METHODS["graft"], None)
prompts = ["Write a Python function that checks whether a string is a palindrome, with tests.",
           "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Think step by step.",
           "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again. Then the dog wakes up and the fox runs away."]
variants = [("tree D6", "tree", base), ("graft-tip D6", "graft", base),
            ("graft-tip D4", "graft", dataclasses.replace(base, max_depth=4)),
            ("tree D4", "tree", dataclasses.replace(base, max_depth=4)),
            ("tree D8 N24", "tree", dataclasses.replace(base, max_depth=8, budget=24)),
            ("graft-tip D8 N24", "graft", dataclasses.replace(base, max_depth=8, budget=24))]
for name, m, cfg in variants:
    e = Engine(t, d, cfg); e.state.acceptance_log = []
    n = steps = fw = 0; dt = 0.0
    for p in prompts:
        ids = encode_prompt(t, p, chat=True)
        t0 = time.perf_counter()
        r = graft_tk.decode(t, ids, drafter=d, method=m, max_new_tokens=64, engine=e)
        dt += time.perf_counter() - t0; n += len(r.tokens); steps += r.stats["steps"]; fw += sum(r.stats["per_step"]["drafter_forwards"])
    by = collections.defaultdict(lambda: [0, 0])
    for s, dep, sc, a in e.state.acceptance_log:
        if s == 2: by[dep][0] += 1; by[dep][1] += a
    print(f"{name:18s} {n/dt:.2f} tok/s mat={n/steps:.2f} drafter fw/step={fw/steps:.2f} retrieval tried/acc by depth: " + " ".join(f"{k}:{v[1]}/{v[0]}" for k, v in sorted(by.items())), flush=True)
