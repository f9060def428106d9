"""Compile every Triton kernel for real GPUs on a machine without one (sm_80 and sm_90 by default).

    python -m bench.compile_check --arch 80,90 [--quick] [--json OUT]

Triton's interpreter, which runs the kernel tests here, accepts programs the compiler rejects
(size-1 ranges, dtype mixes, more shared memory than a GPU has). This check compiles what a GPU
would compile: every op runs on CPU tensors at the shapes decoding uses, with the kernel launch
replaced by a recorder (nothing executes); each distinct launch — kernel, argument types,
constexprs (tile sizes included), warps and stages — is compiled with ``triton.compile(ASTSource,
target=GPUTarget("cuda", arch, 32))`` through the ptxas that ships in the triton wheel, and
``ptxas -v`` on its PTX gives registers and spills. Integer arguments equal to 1 become
constexprs as Triton's launcher makes them (unless the kernel says ``do_not_specialize``).

Shapes: vocab 49,152 (SmolLM2) and 151,936 (Qwen2.5); frontiers of 1, 4 and 16 rows; K = 1, 4, 8;
trees of 1, 16 and 64 nodes; retrieval templates of 1 and 80 nodes with k = 1 and 8; head dim 64
and 128; GQA groups 1, 2, 7 and 8; quantized matmuls (int8 / int4, 1 to 64 rows, with and without
bias); fp32 / fp16 / bf16; exact mode's row-invariant attention at the tree shapes. Tree attention
is compiled at its heuristic tiles for every shape and, without ``--quick``, at every candidate tile of
graft-autotune's search space. Exit status 1, naming kernel and config, when a kernel does not
compile or needs more shared memory than the arch has.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"   # before graft_tk: its kernels must be jitted, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from graft_tk._fs import atomic_write_text  # noqa: E402
from graft_tk.kernels import draft_expand as expand_kernel  # noqa: E402
from graft_tk.kernels import tree_attention as attention_kernel  # noqa: E402
from graft_tk.adjacency import RetrievalTemplate, default_template, new_adjacency  # noqa: E402
from graft_tk.autotune import tree_attention as tunable_attention  # noqa: E402

from bench import cases  # noqa: E402  the op benchmark shapes
from graft_tk.kernels import probes  # noqa: E402  the ops' inputs

# Shared memory a block may use (bytes, with the opt-in carve-out): A100 163 KB, H100/H200 227 KB.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages")
KERNEL_MODULES = ("accept", "build_tree", "commit_kv", "draft_expand", "exact_attention", "prompt_lookup",
                  "quant_matmul", "retrieve", "tree_attention")


@dataclass(frozen=True)
class Launch:
    """One distinct launch to compile: the kernel, its signature and constexprs, its options."""
    kernel: str
    signature: tuple      # ((name, type), ...), "constexpr" for constexpr parameters
    constexprs: tuple     # ((name, value), ...)
    options: tuple        # ((num_warps, w), (num_stages, s)) as the launch passed them
    shape: str            # the case that first produced it

    @property
    def key(self) -> tuple:
        """What makes two launches one compile (the shape that produced them does not)."""
        return self.kernel, self.signature, self.constexprs, self.options

    def config(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.constexprs + self.options)


@dataclass
class Result:
    kernel: str
    shape: str
    config: str
    arch: int
    ok: bool
    shared_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    compile_s: float = 0.0
    error: str | None = None


# ----------------------------------------------------------------------------- recording launches
def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _describe(fn, args: tuple, kwargs: dict, shape: str) -> Launch:
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs = [], []
    for p in fn.params:
        value = values[p.name] if p.name in values else p.default
        specialised = (isinstance(value, int) and not isinstance(value, bool) and value == 1
                       and not p.do_not_specialize)
        if p.is_constexpr or value is None or specialised:
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, value))
        else:
            signature.append((p.name, _type_of(value)))
    options = tuple((k, kwargs[k]) for k in OPTIONS if k in kwargs)
    return Launch(fn.__name__, tuple(signature), tuple(constexprs), options, shape)


@contextmanager
def recording(shape: str, into: list):
    """Replace every kernel module's ``launch`` with a recorder for the duration (nothing runs)."""
    modules = [importlib.import_module(f"graft_tk.kernels.{m}") for m in KERNEL_MODULES]
    saved = [(m, m.launch) for m in modules]

    def record(kernel, grid, *args, **kwargs):
        into.append(_describe(kernel, args, kwargs, shape))

    for m in modules:
        m.launch = record
    try:
        yield
    finally:
        for m, f in saved:
            m.launch = f


# ----------------------------------------------------------------------------- the shapes
def op_calls(quick: bool):
    """(label, kernel module, function name, argument builder) for every shape checked."""
    vocabs = (151936,) if quick else (49152, 151936)
    for V in vocabs:
        for F in ((1, 4) if quick else (1, 4, 16)):
            for K in ((4,) if quick else (1, 4, 8)):
                def build(F=F, V=V, K=K):
                    scores, logits, _, log_tau = probes.draft_expand(F, V)("cpu")
                    return scores, logits, K, log_tau
                yield f"F={F} V={V} K={K}", "draft_expand", build
        for N, rows in ((1, 1), (16, 1), (64, 1), (16, 4)):
            for with_adj in (True, False):
                def build(N=N, V=V, rows=rows, with_adj=with_adj):
                    args = list(probes.accept(N, V, rows)("cpu"))
                    return tuple(args) if with_adj else (*args[:5], None, None)
                yield f"B={rows} N={N} V={V} adjacency={'on' if with_adj else 'off'}", "accept", build
    for k, template in ((8, default_template(8)), (1, RetrievalTemplate(torch.tensor([-1]), torch.tensor([0]), 1))):
        yield (f"T={template.n} k={k}", "retrieve",
               lambda k=k, template=template: (new_adjacency(1024, k), torch.tensor([7, 8]), template))
    for N in (1, 16, 64):
        yield f"P=84 C=90 N={N}", "build_tree", lambda N=N: probes.build_tree(N, cases.VOCAB, rows=2)("cpu")
    for dtype in ((torch.float32, torch.bfloat16) if quick else (torch.float32, torch.float16, torch.bfloat16)):
        for d in ((128,) if quick else (64, 128)):
            for n in (1, 6, 16):
                yield (f"{str(dtype)[6:]} d{d} n={n}", "commit_kv",
                       lambda dtype=dtype, d=d, n=n: probes.commit_kv(2, 2, 512, d, n, dtype, rows=2)("cpu"))
            for group in ((1, 7) if quick else (1, 2, 7, 8)):
                for T in ((1, 64) if quick else (1, 16, 64)):
                    for module in ("tree_attention", "exact_attention"):
                        yield (f"{str(dtype)[6:]} d{d} group {group} T={T}", module,
                               lambda dtype=dtype, d=d, group=group, T=T:
                               probes.tree_attention(T, 512, dtype, hq=2 * group, hkv=2, d=d, rows=2)("cpu"))
                yield (f"{str(dtype)[6:]} d{d} group {group} causal prefill T=256", "tree_attention",
                       lambda dtype=dtype, d=d, group=group: causal(
                           probes.tree_attention(256, 0, dtype, hq=2 * group, hkv=2, d=d)("cpu")))
    for committed in (256, 4096):
        yield f"context {committed}", "prompt_lookup", lambda committed=committed: probes.prompt_lookup(committed)("cpu")
    for dtype in ((torch.float32, torch.bfloat16) if quick else (torch.float32, torch.float16, torch.bfloat16)):
        for mode in ("int8", "int4"):
            for M in ((1, 64) if quick else (1, 16, 64)):
                for bias in ((mode == "int8",) if quick else (False, True)):
                    yield (f"{mode} {str(dtype)[6:]} M={M} N=2048 K=1536 bias={bias}", "quant_matmul",
                           lambda dtype=dtype, mode=mode, M=M, bias=bias:
                           probes.quant_matmul(M, 2048, 1536, mode, dtype, bias)("cpu"))


def causal(args: tuple) -> tuple:
    """A tree-attention case's arguments with the causal block (None): a prefill."""
    q, k, v, prefix, block, keys = args
    return q, k, v, prefix, None, keys


def record_launches(quick: bool) -> list[Launch]:
    """Every distinct launch of every op at every shape. An op that fails before its first launch
    (a bad shape, a wrapper error) raises: a kernel must never drop out of the check unseen."""
    recorded: list[Launch] = []
    for label, module, build in op_calls(quick):
        op = getattr(importlib.import_module(f"graft_tk.kernels.{module}"), module)
        before = len(recorded)
        with recording(f"{module} {label}", recorded), torch.no_grad():
            try:
                op(*build())
            except Exception as e:   # outputs are never written, so reading them back may fail afterwards
                if len(recorded) == before:
                    raise RuntimeError(f"{module} [{label}] failed before launching a kernel: {e}") from e
    # The vocabulary split over programs (draft_expand's stage 1 + finish), also GPU-only.
    for V in (151936,) if quick else (49152, 151936):
        for F, K in ((1, 4), (16, 8)):
            scores, logits, _, log_tau = probes.draft_expand(F, V, rows=2)("cpu")
            with recording(f"draft_expand split F={F} V={V} K={K}", recorded):
                expand_kernel._expand(scores[:, :F], logits[:, :F], K, log_tau, expand_kernel._config(F, V, K), 16)
    # Keys split over programs (flash-decoding: the split kernel and the combine), which the
    # launcher picks only on a GPU (by its SM count): at the heuristic tiles, 4 splits.
    for dtype in (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.float16, torch.bfloat16):
        for d in (128,) if quick else (64, 128):
            for group, T in ((1, 1), (7, 16)):
                q, k, v, prefix, block, keys = probes.tree_attention(T, 2048, dtype, hq=2 * group, hkv=2, d=d)("cpu")
                meta = {**attention_kernel.block_sizes(group * T, d, dtype), "KV_SPLITS": 4}
                with recording(f"tree_attention split {str(dtype)[6:]} d{d} group {group} T={T}", recorded):
                    attention_kernel._launch(q, k, v, prefix, block, keys, 1.0, torch.empty_like(q), meta)
    if not quick:   # every candidate tile of graft-autotune's search space
        for dtype in ("bfloat16", "float16", "float32"):
            for d in (64, 128):
                for rows in (16, 64, 128):
                    bucket = tunable_attention.bucket(rows, d, 1024, dtype)
                    q, k, v, prefix, block, keys, scale = tunable_attention.inputs(bucket, "cpu")
                    out = torch.empty_like(q)
                    for config in tunable_attention.configs(bucket):
                        with recording(f"tree_attention autotune {bucket}", recorded):
                            attention_kernel._launch(q, k, v, prefix, block, keys, scale, out, config)
    distinct: dict = {}
    for launch in recorded:
        distinct.setdefault(launch.key, launch)
    return list(distinct.values())


# ----------------------------------------------------------------------------- compiling
def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from ``ptxas -v`` on the PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        run = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return (int(regs.group(1)) if regs else None), (max(spills) if spills else None)


def compile_one(launch: Launch, arch: int) -> Result:
    fn = _kernel_by_name(launch.kernel)
    names = [p.name for p in fn.params]
    result = Result(launch.kernel, launch.shape, launch.config(), arch, ok=False)
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=dict(launch.signature),
                        constexprs={(names.index(k),): v for k, v in launch.constexprs})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
        result.compile_s = time.perf_counter() - t0
        result.shared_bytes = compiled.metadata.shared
        result.registers, result.spill_bytes = _ptxas_usage(compiled.asm["ptx"], arch)
        limit = SHARED_LIMIT.get(arch)
        if limit is not None and result.shared_bytes > limit:
            result.error = f"needs {result.shared_bytes} bytes of shared memory, sm_{arch} has {limit}"
        else:
            result.ok = True
    except Exception as e:   # noqa: BLE001 - every failure is reported, named
        result.compile_s = time.perf_counter() - t0
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]
    return result


def _compile_pair(pair: tuple[Launch, int]) -> Result:
    return compile_one(*pair)


def _kernel_by_name(name: str):
    for m in KERNEL_MODULES:
        fn = getattr(importlib.import_module(f"graft_tk.kernels.{m}"), name, None)
        if fn is not None:
            return fn
    raise LookupError(f"no kernel named {name}")


def summary_table(results: list[Result]) -> str:
    """Per kernel and arch: configs compiled, failures, max shared memory / registers / spills, compile time."""
    rows = {}
    for r in results:
        rows.setdefault((r.kernel, r.arch), []).append(r)
    lines = ["| kernel | arch | configs | failed | max shared | max registers | max spills | compile s (total) |",
             "|---|---|---|---|---|---|---|---|"]
    for (kernel, arch), rs in sorted(rows.items()):
        ok = [r for r in rs if r.ok]
        shared = max((r.shared_bytes or 0 for r in ok), default=0)
        regs = max((r.registers or 0 for r in ok), default=0)
        spills = max((r.spill_bytes or 0 for r in ok), default=0)
        lines.append(f"| {kernel.strip('_')} | sm_{arch} | {len(rs)} | {len(rs) - len(ok)} | {shared / 1024:.1f} KB | "
                     f"{regs} | {spills} B | {sum(r.compile_s for r in rs):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="80,90", help="comma list of compute capabilities (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and no autotune candidates (CI)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="every compile's result, written as it goes; a rerun with the same OUT compiles only what "
                        "it lacks (same triton and kernel sources), so a long run can be stopped and resumed")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compiles in parallel processes (default: one per CPU, %(default)s here)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        p.error(f"--arch must be a comma list of integers like 80,90, got {args.arch!r}")
    t0 = time.perf_counter()
    launches = record_launches(args.quick)
    print(f"{len(launches)} distinct launches recorded; compiling for {', '.join(f'sm_{a}' for a in archs)} ...",
          file=sys.stderr)
    work = [(launch, arch) for launch in launches for arch in archs]
    header = {"archs": archs, "quick": args.quick, "triton": triton.__version__, "sources": _sources_hash()}
    done = _resumable(args.json, header)
    results = [done[k] for k in map(_key, work) if k in done]
    work = [w for w in work if _key(w) not in done]
    total = len(results) + len(work)
    if results:
        print(f"{len(results)} compiles taken from {args.json}; {len(work)} to go", file=sys.stderr)
    # spawned workers (not forked from a process whose torch thread pool has run); results in order
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for result in pool.map(_compile_pair, work, chunksize=1):
            results.append(result)
            if not result.ok:  # at once, not only in the final list: a long run shows its failures as it goes
                print(f"\nFAILED {result.kernel} sm_{result.arch} [{result.shape}] {result.config}: {result.error}",
                      file=sys.stderr)
            print(f"\r  {len(results)}/{total}", end="", file=sys.stderr, flush=True)
            if args.json and len(results) % 20 == 0:
                _write_json(args.json, header, results)
    print(file=sys.stderr)
    print(summary_table(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED {r.kernel} sm_{r.arch} [{r.shape}] {r.config}: {r.error}")
    print(f"\n{len(results)} compiles, {len(failed)} failed, {time.perf_counter() - t0:.0f} s")
    if args.json:
        _write_json(args.json, header, results)
    return 1 if failed else 0


def _key(item) -> tuple:
    """A compile's identity across runs: (kernel, shape label, config, arch), from a work item or a Result."""
    if isinstance(item, Result):
        return item.kernel, item.shape, item.config, item.arch
    launch, arch = item
    return launch.kernel, launch.shape, launch.config(), arch


def _sources_hash() -> str:
    """The kernel modules' source: a result compiled from other sources is not reused."""
    digest = hashlib.sha256()
    for m in KERNEL_MODULES:
        digest.update(Path(importlib.import_module(f"graft_tk.kernels.{m}").__file__).read_bytes())
    return digest.hexdigest()[:16]


def _resumable(path: str | None, header: dict) -> dict:
    """The results of an earlier run into ``path`` made with the same archs, set, triton and
    sources, by key; none when there is no such file. A file that is not such a run is an error."""
    if not path or not Path(path).exists():
        return {}
    try:
        saved = json.loads(Path(path).read_text())
        results = [Result(**r) for r in saved["results"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path} is not a compile_check result file ({e}); pass another --json or delete it")
    stale = {k: (saved.get(k), v) for k, v in header.items() if saved.get(k) != v}
    if stale:
        differs = ", ".join(f"{k}: {a} != {b}" for k, (a, b) in stale.items())
        raise SystemExit(f"{path} was written by another run ({differs}); pass another --json or delete it")
    return {_key(r): r for r in results}


def _write_json(path: str, header: dict, results: list[Result]) -> None:
    atomic_write_text(Path(path), json.dumps({**header, "results": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
