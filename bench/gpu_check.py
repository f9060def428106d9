"""Everything a few minutes on a lent GPU should tell, in one run and one table.

    python -m bench.gpu_check [--quick] [--json OUT.json]   # on a CUDA machine
    python -m bench.gpu_check --dry-run                     # CPU: checks this script (interpreter)

1. The kernel tests, compiled: ``pytest tests/test_kernel_*.py tests/test_backends.py
   tests/test_autotune.py bench/test_gpu_autotune.py`` with TRITON_INTERPRET unset, so every
   kernel is compiled for the GPU and compared with its reference (the tests put their inputs on
   CUDA when it is present), and the tree-attention tiles are really tuned once.
2. Kernel benchmarks: each op of bench/cases.py, Triton vs torch reference on the same inputs,
   median time (``triton.testing.do_bench``), and whether the outputs agree.
3. Tree attention at real decode shapes: Qwen2.5-1.5B (12 query heads on 2 kv heads) and
   Llama-3-8B (32 on 8) head layouts, head dim 128, bf16, a tree of T = 16 / 64 nodes after 512,
   4k and 32k cached tokens: the launcher (heuristic tiles and KV splits), the same tiles in one
   split, tuned tiles (graft-autotune's search, into a temporary cache) on two of the shapes, and
   SDPA with the dense [T, kv_len] mask; outputs compared with SDPA.
4. Step forwards, eager vs compiled (``graft_tk.compiled``: torch.compile, CUDA graphs): a model
   with Qwen2.5-1.5B's shapes (random bf16 weights: a GPU machine may have no checkpoints, and
   the time does not depend on the values), q = 1 and 16 new tokens after 100 and 3,000 cached.
5. Decode steps, eager vs compiled: ``ar``, ``retrieval+pld`` and ``graft`` (a 4-layer drafter
   sharing the target's first layers) on the same Qwen-shaped random model in fp32 (a random
   model falls into loops that retrieval and prompt lookup predict), one request and a batch of
   four: tokens identical to ``ar``, ms per step, ms per step outside the forwards, host syncs
   and kernel launches per step.

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

    from tests.tolerances import KERNEL_TOL   # run from a checkout: the tests are what it runs
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
    from bench.cases import CASES, implementation
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


def random_qwen(cuda: bool, dtype, std: float, toy_layers: int):
    """A transformer with Qwen2.5-1.5B's shapes and random weights (normal, ``std``) on CUDA; on the
    CPU of a dry run the same code at toy size (``toy_layers`` layers)."""
    import torch

    from graft_tk.models.transformer import ModelConfig, Transformer
    if cuda:
        cfg = ModelConfig("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 1e-6, 1e6, 32768, True)
    else:
        cfg = ModelConfig("qwen2", 512, 64, toy_layers, 4, 2, 16, 128, 1e-6, 1e6, 4096, True)
    torch.manual_seed(0)
    net = Transformer(cfg)
    for p in net.parameters():
        torch.nn.init.normal_(p, 0.0, std)
    return net.to(device="cuda" if cuda else "cpu", dtype=dtype).eval().requires_grad_(False)


def run_forwards(cuda: bool) -> list[dict]:
    """Median ms of a step forward of q tokens after ``prefix`` cached, eager and compiled."""
    import torch

    from graft_tk.compiled import StepForward
    if cuda:
        shapes, dtype, device = [(1, 100), (1, 3000), (16, 100), (16, 3000)], torch.bfloat16, torch.device("cuda")
    else:
        shapes, dtype, device = [(1, 100), (16, 100)], torch.float32, torch.device("cpu")
    net = random_qwen(cuda, dtype, 0.02, toy_layers=2)
    cfg = net.config
    rows = []
    with torch.inference_mode():
        for q, prefix in shapes:
            net.setup_cache(prefix + q)
            net.kv.normal_(0, 0.5)
            row = {"q": q, "prefix": prefix}
            for kind in ("eager", "compiled"):
                step = StepForward(net, compile=kind == "compiled")
                tokens = torch.randint(cfg.vocab_size, (1, q), device=device)
                positions = torch.arange(prefix, prefix + q, device=device)
                t0 = time.perf_counter()
                step(tokens, positions, prefix)                 # compiles when compiled
                row[f"{kind}_first_s"] = time.perf_counter() - t0
                row[f"{kind}_ms"] = median_ms(lambda: step(tokens, positions, prefix), cuda)
            rows.append(row)
            print(f"  forward q={q:<3} prefix={prefix:<5} eager {row['eager_ms']:8.3f} ms  compiled "
                  f"{row['compiled_ms']:8.3f} ms (first call {row['compiled_first_s']:.0f} s)", file=sys.stderr)
    return rows


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids):
        return ""


def run_decodes(cuda: bool) -> list[dict]:
    """ar / retrieval+pld / graft on a random Qwen-shaped model, eager and compiled (see the module docstring)."""
    import dataclasses

    import torch

    from graft_tk.batch import decode_batch
    from graft_tk.config import GraftConfig
    from graft_tk.engine import Engine
    from graft_tk.models import Model
    from graft_tk.models.transformer import Transformer
    draft_layers, new_tokens, device = (4, 64, torch.device("cuda")) if cuda else (2, 12, torch.device("cpu"))
    net = random_qwen(cuda, torch.float32, 0.05, toy_layers=4)
    cfg = net.config
    dcfg = dataclasses.replace(cfg, n_layers=draft_layers)
    dnet = Transformer(dcfg)
    dnet.load_state_dict(net.state_dict(), strict=False)   # the target's embedding, first layers and head
    dnet = dnet.to(device).eval().requires_grad_(False)
    target = Model("random-qwen", None, cfg, _NoTokenizer(), net)
    drafter = Model("random-qwen-first-layers", None, dcfg, _NoTokenizer(), dnet)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(cfg.vocab_size, (n,), generator=g).tolist() for n in (96, 40, 150, 70)]
    rows, reference = [], {}
    with torch.inference_mode():
        for compile in (False, True):
            for method in ("ar", "retrieval+pld", "graft"):
                for batch in (1, 4):
                    def run():
                        engine = Engine(target, drafter if method == "graft" else None, GraftConfig(), compile=compile)
                        return decode_batch(engine.batch(batch), prompts[:batch], method, new_tokens)
                    t0 = time.perf_counter()
                    run()                            # compiles
                    first_s = time.perf_counter() - t0
                    results = run()
                    tokens = [t for t, _ in results]
                    if method == "ar":
                        reference[compile, batch] = tokens
                    stats = results[0][1]
                    split, steps = stats.get("time_split"), max(stats["steps"], 1)
                    row = {"method": method, "batch": batch, "compile": compile, "first_s": first_s,
                           "identical_to_ar": tokens == reference[compile, batch],
                           "tokens_per_s": sum(s["tokens"] for _, s in results) / max(s["seconds"] for _, s in results),
                           "mat": stats["mat"],
                           "ms_per_step": 1000 * (stats["seconds"] - stats["prefill_seconds"]) / steps,
                           "ms_outside_forwards": (1000 * (split["retrieve"] + split["commit"]) / steps
                                                   if split else None),
                           "host_syncs_per_step": stats["host_syncs_per_step"],
                           "launches_per_step": stats["kernel_launches_per_step"]}
                    rows.append(row)
                    print(f"  {method:<14} B={batch} compile={compile!s:<5} {row['tokens_per_s']:8.1f} tok/s  "
                          f"mat {row['mat']:.2f}  {row['ms_per_step']:.2f} ms/step  "
                          f"identical {row['identical_to_ar']}", file=sys.stderr)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def decode_table(rows: list[dict]) -> str:
    lines = ["| method | B | compile | tok/s (all rows) | tokens/step | ms/step | ms outside forwards | host syncs/step | "
             "launches/step | same as ar | first call s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['batch']} | {'on' if r['compile'] else 'off'} | {r['tokens_per_s']:.1f} | "
              f"{r['mat']:.2f} | {r['ms_per_step']:.2f} | {_ms(r['ms_outside_forwards'])} | "
              f"{r['host_syncs_per_step']:.2f} | {_ms(r['launches_per_step'])} | "
              f"{'yes' if r['identical_to_ar'] else 'NO'} | {r['first_s']:.0f} |" for r in rows]
    return "\n".join(lines)


ATTENTION_LAYOUTS = {"qwen2.5-1.5b": (12, 2), "llama-3-8b": (32, 8)}   # (query heads, kv heads), head dim 128
TUNED_SHAPES = {("qwen2.5-1.5b", 16, 4096), ("llama-3-8b", 64, 32768)}     # tuned too (~1 min each)


def run_attention(cuda: bool) -> list[dict]:
    """Tree attention vs SDPA (dense mask) at decode shapes; heuristic, one split and tuned tiles."""
    import tempfile

    import torch
    import torch.nn.functional as F

    from graft_tk.autotune import select, tuner
    from graft_tk.autotune import tree_attention as tunable
    from graft_tk.kernels import tree_attention as kernel
    from graft_tk.kernels._common import interpreted, multiprocessors
    from graft_tk.reference.tree_attention import tree_attention as reference
    if cuda:
        layouts, prefixes, nodes, d, dtype = ATTENTION_LAYOUTS, (512, 4096, 32768), (16, 64), 128, torch.bfloat16
    else:      # dry run: the same code at toy size
        layouts, prefixes, nodes, d, dtype = {"toy": (4, 2)}, (100,), (4,), 16, torch.float32
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:   # tuning writes a cache: a temporary one, never the user's (this process ends after)
            os.environ["GRAFT_TK_AUTOTUNE_CACHE"] = str(Path(tmp) / "autotune.json")
        for name, (hq, hkv) in layouts.items():
            for prefix in prefixes:
                for T in nodes:
                    g = torch.Generator().manual_seed(0)
                    q = torch.randn(1, hq, T, d, generator=g).to(device, dtype)
                    k = torch.randn(1, hkv, prefix + T, d, generator=g).to(device, dtype)
                    v = torch.randn(1, hkv, prefix + T, d, generator=g).to(device, dtype)
                    tree = torch.ones(T, T, dtype=torch.bool, device=device).tril()
                    tree[1::2, 0] = False                            # not a chain: a branchy mask
                    dense = torch.cat([torch.ones(T, prefix, dtype=torch.bool, device=device), tree], dim=1)
                    keys, tree, start = prefix + T, tree[None], torch.tensor([prefix], device=device)
                    row = {"layout": name, "prefix": prefix, "T": T}
                    heuristic = kernel.block_sizes(hq // hkv * T, d, dtype)
                    programs = -(-hq // hkv * T // heuristic["BLOCK_M"]) * hkv
                    heuristic["KV_SPLITS"] = (kernel.kv_splits(programs, prefix + T, multiprocessors(device))
                                              if cuda else 2)      # dry run: the split path and its combine
                    row["splits"] = heuristic["KV_SPLITS"]
                    out = torch.empty_like(q)
                    scale = 1.0 / d ** 0.5
                    row["triton_ms"] = median_ms(lambda: kernel._launch(q, k, v, start, tree, keys, scale, out, heuristic),
                                                 cuda)
                    one = {**heuristic, "KV_SPLITS": 1}
                    row["one_split_ms"] = median_ms(lambda: kernel._launch(q, k, v, start, tree, keys, scale, out, one),
                                                    cuda)
                    row["sdpa_ms"] = median_ms(lambda: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=dense, enable_gqa=True), cuda)
                    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense,
                                                          enable_gqa=True) if cuda else reference(q, k, v, start, tree, keys)
                    kernel._launch(q, k, v, start, tree, keys, scale, out, heuristic)
                    row["agree"] = agree(out, want.to(dtype))
                    if cuda and not interpreted() and (name, T, prefix) in TUNED_SHAPES:
                        bucket = kernel.shape_bucket(hq // hkv * T, d, prefix + T, dtype)
                        tuner.tune(tunable.TUNABLE, bucket)
                        tuned = select("tree_attention", bucket, heuristic, device)
                        row["tuned"] = tuned
                        row["tuned_ms"] = median_ms(lambda: kernel._launch(q, k, v, start, tree, keys, scale, out, tuned),
                                                    cuda)
                    rows.append(row)
                    print(f"  attention {name:<13} prefix={prefix:<6} T={T:<3} triton {row['triton_ms']:8.3f} ms "
                          f"({row['splits']} splits; one split {row['one_split_ms']:8.3f})  sdpa {row['sdpa_ms']:8.3f} ms"
                          + (f"  tuned {row['tuned_ms']:8.3f} ms" if "tuned_ms" in row else "") + f"  {row['agree']}",
                          file=sys.stderr)
    return rows


def attention_table(rows: list[dict]) -> str:
    lines = ["| layout | cached | T | triton ms (splits) | one split ms | tuned ms | SDPA dense-mask ms | vs SDPA | outputs |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['prefix']} | {r['T']} | {r['triton_ms']:.3f} ({r['splits']}) | "
              f"{r['one_split_ms']:.3f} | {r.get('tuned_ms', float('nan')):.3f} | {r['sdpa_ms']:.3f} | "
              f"{r['sdpa_ms'] / r['triton_ms']:.2f}x | {r['agree']} |" for r in rows]
    return "\n".join(lines)


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
    sys.path[:0] = [str(ROOT)]     # the tests' helpers (tests/) for the kernel tests
    import torch

    import graft_tk  # noqa: F401  (before anything imports triton: the interpreter switch on CPU)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --dry-run to check the script on CPU)",
              file=sys.stderr)
        return 2
    from graft_tk.bench.compare import machine_info
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
    print("tree attention at decode shapes...", file=sys.stderr)
    attention = run_attention(cuda)
    print("step forwards, eager vs compiled...", file=sys.stderr)
    forwards = run_forwards(cuda)
    print("decode steps, eager vs compiled...", file=sys.stderr)
    decodes = run_decodes(cuda)
    print(f"\n## gpu_check: {info['gpu'] or 'CPU dry run'}, {info['date']}")
    if tests is not None:
        print(f"\nkernel tests: {tests['summary']}" + "".join(f"\n  {f}" for f in tests["failures"]))
    print("\n" + table(rows))
    print("\n" + attention_table(attention))
    print("\n" + forward_table(forwards))
    print("\n" + decode_table(decodes))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "tests": tests, "benchmarks": rows,
                                               "attention": attention, "forwards": forwards, "decodes": decodes}, indent=1))
    ok = ((tests is None or tests["ok"]) and all(not r["agree"].startswith("DIFFER") for r in rows + attention)
          and all(r["identical_to_ar"] for r in decodes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
