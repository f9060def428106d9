"""Benchmarks (installed as ``graft_tk.bench``; a tool: the runtime never imports it).

* ``compare``: graft-bench's logic — every method on every prompt, exactness checked, summarised.
* ``anchors``: what a user would run instead (HF transformers, llama.cpp), in the same run.
* ``prompts``: benchmark prompts (HumanEval, Spec-Bench from ``../shared/data``, built-in sets).
* ``plots``: graft-bench's pictures.
* scripts run as ``python -m graft_tk.bench.<name>``: ``serve_load`` (graft-serve under load),
  ``gpu_check`` (every GPU check in one run), ``compile_check`` (every kernel compiled for
  sm_80 / sm_90), ``quant_decode`` / ``quant_quality``, ``forward_cost``, ``prefill_memory``,
  ``adaptive_trace``, ``ar_vs_hf``.
* ``test_bench_*.py``: pytest-benchmark micro-benchmarks (``python -m pytest bench/ --benchmark-only``).
"""
