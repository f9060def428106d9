"""The lab: experiments, checks and micro-benchmarks, run from a checkout (not installed).

Run a script from the repository root as ``python -m bench.<name>``: ``gpu_check`` (every GPU
check in one run), ``compile_check`` (every kernel compiled for sm_80 / sm_90 without a GPU),
``quant_decode`` / ``quant_quality``, ``forward_cost``, ``cpu_paths_ab``, ``prefill_memory``,
``adaptive_trace``, ``ar_vs_hf``, ``vllm_methods``. ``cases`` holds the op shapes they and the
micro-benchmarks share; ``test_bench_*.py`` are pytest-benchmark micro-benchmarks
(``python -m pytest bench/ --benchmark-only``). What users run (graft-bench, its prompts,
anchors, plots, the load benchmarks) is ``graft_tk.bench``.
"""
