"""graft-bench and the load benchmarks: a tool of the package (the decode path never imports it).

* ``compare``: graft-bench's logic — every method on every prompt, exactness checked, summarised.
* ``anchors``: what a user would run instead (HF transformers, llama.cpp), in the same run.
* ``prompts``: benchmark prompts (HumanEval, Spec-Bench from ``$GRAFT_TK_SPEC_BENCH``, built-in sets).
* ``plots``: graft-bench's pictures; ``roofline``: forwards against the measured memory bandwidth.
* ``serve_load`` / ``hostile_load``: graft-serve under load (``python -m graft_tk.bench.serve_load``).

One-off experiments and checks (GPU and compile checks, A/B probes, traces) and the
pytest-benchmark micro-benchmarks live in the repository's top-level ``bench/``, run from a checkout.
"""
