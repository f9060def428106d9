"""Everything a few minutes on a lent GPU should tell, in one run and one table.

    python bench/gpu_check.py [--quick] [--json OUT.json]       # on a CUDA machine
    python bench/gpu_check.py --dry-run                         # CPU: checks this script (interpreter)

1. The kernel tests, compiled: ``pytest tests/test_kernel_*.py tests/test_backends.py
   tests/test_autotune.py bench/test_gpu_autotune.py`` with TRITON_INTERPRET unset, so every
   kernel is compiled for the GPU and compared with its reference (the tests put their inputs on
   CUDA when it is present), and the tree-attention tiles are really tuned once.
2. Kernel benchmarks: each op of bench/cases.py, Triton vs torch reference on the same inputs,
   median time (``triton.testing.do_bench``), and whether the outputs agree.
3. Step forwards, eager vs compiled (``graft_tk.compiled``: torch.compile, CUDA graphs): a model
   with Qwen2.5-1.5B's shapes (random bf16 weights: a GPU machine may have no checkpoints, and
   the time does not depend on the values), q = 1 and 16 new tokens after 100 and 3,000 cached.

Prints one markdown table; ``--json`` also writes the numbers with the machine's description.
Exit code: 0 when tests pass and every op agrees, 1 otherwise, 2 when there is no CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_tests(dry_run: bool) -> dict:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernel_*.py"))
    files += ["tests/test_backends.py", "tests/test_autotune.py", "bench/test_gpu_autotune.py"]
    env = dict(os.environ)
    if not dry_run:
        env.pop("TRITON_INTERPRET", None)     # compile for the GPU
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-500:]
    failures = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED") or ln.startswith("ERROR")]
    return {"ok": proc.returncode == 0, "summary": tail, "failures": failures[:20],
            "seconds": time.perf_counter() - t0}


def median_ms(fn, cuda: bool) -> float:
    if cuda:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def agree(a, b) -> str:
    """'equal' / 'max|d|=x' / 'DIFFER' between two op results: tensors compared (integers exactly,
    floats within tests/tolerances.KERNEL_TOL), tuples element by element, other inputs skipped."""
    import torch

    from tolerances import KERNEL_TOL
    if not isinstance(a, (torch.Tensor, tuple, list)):
        return "equal"
    if isinstance(a, torch.Tensor):
        a, b = a.cpu(), b.cpu()
        if a.dtype.is_floating_point:
            if torch.equal(a, b):
                return "equal"
            atol, rtol = KERNEL_TOL[a.dtype]
            d = float((a.float() - b.float()).abs().max())
            return f"max|d|={d:.1e}" if torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol) else f"DIFFER {d:.1e}"
        return "equal" if torch.equal(a, b) else "DIFFER"
    results = [agree(x, y) for x, y in zip(a, b)]
    bad = [r for r in results if r.startswith("DIFFER")]
    return bad[0] if bad else next((r for r in results if r != "equal"), "equal")


def run_benchmarks(quick: bool, cuda: bool) -> list[dict]:
    import torch

    import graft_tk.kernels  # noqa: F401  (interpreter switch on CPU)
    from cases import CASES, implementation
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    for case in CASES:
        if quick and not case.quick:
            continue
        row = {"op": case.fn, "shape": case.label}
        outputs = {}
        for backend in ("torch", "triton"):
            fn = implementation(case, backend)
            check = case.build(device)                              # fresh inputs: some ops write in place,
            outputs[backend] = (fn(*check), check)                  # so the inputs are compared too
            args = case.build(device)
            row[f"{backend}_ms"] = median_ms(lambda: fn(*args), cuda)
        row["agree"] = agree(outputs["torch"], outputs["triton"])
        row["speedup"] = row["torch_ms"] / row["triton_ms"] if row["triton_ms"] > 0 else float("nan")
        rows.append(row)
        print(f"  {case.fn:<15} {case.label:<36} torch {row['torch_ms']:9.3f} ms  triton {row['triton_ms']:9.3f} ms"
              f"  {row['agree']}", file=sys.stderr)
    return rows


def run_forwards(cuda: bool) -> list[dict]:
    """Median ms of a step forward of q tokens after ``prefix`` cached, eager and compiled."""
    import torch

    from graft_tk.compiled import StepForward
    from graft_tk.models.transformer import ModelConfig, Transformer
    if cuda:   # Qwen2.5-1.5B's shapes
        cfg = ModelConfig("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 1e-6, 1e6, 32768, True)
        shapes, dtype, device = [(1, 100), (1, 3000), (16, 100), (16, 3000)], torch.bfloat16, torch.device("cuda")
    else:      # dry run: the same code at toy size
        cfg = ModelConfig("qwen2", 512, 64, 2, 4, 2, 16, 128, 1e-6, 1e6, 4096, True)
        shapes, dtype, device = [(1, 100), (16, 100)], torch.float32, torch.device("cpu")
    net = Transformer(cfg)
    for p in net.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    net = net.to(device=device, dtype=dtype).eval()
    rows = []
    with torch.inference_mode():
        for q, prefix in shapes:
            net.setup_cache(prefix + q)
            net.kv.normal_(0, 0.5)
            row = {"q": q, "prefix": prefix}
            for kind in ("eager", "compiled"):
                step = StepForward(net, compile=kind == "compiled")
                tokens = torch.randint(1000 % cfg.vocab_size, (1, q), device=device)
                positions = torch.arange(prefix, prefix + q, device=device)
                t0 = time.perf_counter()
                step(tokens, positions, prefix)                 # compiles when compiled
                row[f"{kind}_first_s"] = time.perf_counter() - t0
                row[f"{kind}_ms"] = median_ms(lambda: step(tokens, positions, prefix), cuda)
            rows.append(row)
            print(f"  forward q={q:<3} prefix={prefix:<5} eager {row['eager_ms']:8.3f} ms  compiled "
                  f"{row['compiled_ms']:8.3f} ms (first call {row['compiled_first_s']:.0f} s)", file=sys.stderr)
    return rows


def forward_table(rows: list[dict]) -> str:
    lines = ["| q | cached | eager ms | compiled ms | compiled speedup | compile s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['q']} | {r['prefix']} | {r['eager_ms']:.3f} | {r['compiled_ms']:.3f} | "
              f"{r['eager_ms'] / r['compiled_ms']:.2f}x | {r['compiled_first_s']:.0f} |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| op | shape | torch ms (median) | triton ms (median) | triton speedup | outputs |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['shape']} | {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {r['speedup']:.2f}x | {r['agree']} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small set of shapes only")
    p.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: run in the interpreter on CPU to check the script")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    sys.path[:0] = [str(HERE), str(ROOT / "tests")]
    import torch

    import graft_tk  # noqa: F401  (before anything imports triton: the interpreter switch on CPU)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --dry-run to check the script on CPU)",
              file=sys.stderr)
        return 2
    from graft_tk.bench import machine_info
    info = machine_info()
    print(f"gpu_check on {info['gpu'] or 'CPU (dry run, interpreter)'}; torch {info['torch']}, triton {info['triton']}",
          file=sys.stderr)
    tests = None
    if not args.skip_tests:
        print("kernel tests (compiled)..." if cuda else "kernel tests (interpreter)...", file=sys.stderr)
        tests = run_tests(dry_run=not cuda)
        print(f"  {tests['summary']} ({tests['seconds']:.0f} s)", file=sys.stderr)
    print("kernel benchmarks...", file=sys.stderr)
    rows = run_benchmarks(quick=args.quick or not cuda, cuda=cuda)
    print("step forwards, eager vs compiled...", file=sys.stderr)
    forwards = run_forwards(cuda)
    print(f"\n## gpu_check: {info['gpu'] or 'CPU dry run'}, {info['date']}")
    if tests is not None:
        print(f"\nkernel tests: {tests['summary']}" + "".join(f"\n  {f}" for f in tests["failures"]))
    print("\n" + table(rows))
    print("\n" + forward_table(forwards))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "tests": tests, "benchmarks": rows,
                                               "forwards": forwards}, indent=1))
    ok = (tests is None or tests["ok"]) and all(not r["agree"].startswith("DIFFER") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
