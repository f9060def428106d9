"""graft-autotune: tune Triton tile sizes once per GPU, and each CPU linear layer's path per call
width once per CPU, then share the cache with a team and CI.

    graft-autotune tune [--kernels tree_attention] [--shapes rows=64,head_dim=128,kv_len=4096,dtype=bfloat16]
    graft-autotune tune --model qwen2.5-coder-1.5b [--dtype bf16] [--quant int8]   # CPU linears
    graft-autotune check                # every kernel against its torch reference on this GPU
    graft-autotune show
    graft-autotune export FILE          # on the tuning box
    graft-autotune import FILE          # in the serving image / CI
    graft-autotune merge A B -o OUT
    graft-autotune clear

The cache is $GRAFT_TK_AUTOTUNE_CACHE (default $GRAFT_TK_HOME/autotune.json). An entry is used
only on the GPU (or the CPU model, ISA flags and threads), versions and kernel source it was tuned
with; imported entries for other machines are kept for them and never applied here.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import GraftError, InputError


def build_parser() -> argparse.ArgumentParser:
    # --cache and -v work before or after the command (SUPPRESS: a command's parser sets them only if given).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS, help="cache file (default: GRAFT_TK_AUTOTUNE_CACHE "
                        "or GRAFT_TK_HOME/autotune.json; kernels read the same place)")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)
    p = argparse.ArgumentParser(prog="graft-autotune", description=__doc__, parents=[common],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    t = add("tune", "benchmark candidate configs on this GPU (or CPU) and cache the fastest")
    t.add_argument("--kernels", nargs="+", default=None, help="kernels to tune (default: cpu_linear with --model, else every GPU kernel)")
    t.add_argument("--shapes", nargs="+", default=None, metavar="NAME=VALUE,...",
                   help="shapes to tune, e.g. rows=54,head_dim=128,kv_len=1000,dtype=bfloat16 "
                        "(rounded to their bucket; default: each kernel's common shapes)")
    t.add_argument("--model", default=None, help="tune the CPU paths (cpu_linear) of this model's linear layers "
                   "at every call width: a built-in name, checkpoint folder or .gguf file")
    t.add_argument("--dtype", default="bf16", help="with --model: its compute dtype (default bf16)")
    t.add_argument("--quant", default="none", help="with --model: its weight format (none, int8, int4, int4-all)")
    t.add_argument("--force", action="store_true", help="retune buckets that already have a usable entry")
    add("check", "run every Triton kernel beside its torch reference on this GPU (in Triton's interpreter "
                 "without one), store the verdicts in the cache and print them; exit 1 if one fails")
    add("show", "list the cached entries and whether each is usable here")
    e = add("export", "write the cache to FILE (to import on other machines)")
    e.add_argument("file", type=Path)
    i = add("import", "merge FILE into the cache (entries stay keyed to their GPU)")
    i.add_argument("file", type=Path)
    m = add("merge", "merge cache files A and B into OUT (latest entry wins per key)")
    m.add_argument("a", type=Path)
    m.add_argument("b", type=Path)
    m.add_argument("-o", "--out", type=Path, required=True)
    add("clear", "remove every entry from the cache")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verbose, cache_arg = getattr(args, "verbose", False), getattr(args, "cache", None)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    from .. import autotune  # after argparse: --help stays fast
    path = Path(cache_arg).expanduser() if cache_arg else autotune.cache_path()
    try:
        return COMMANDS[args.command](args, path)
    except GraftError as e:
        print(f"graft-autotune: error: {e}", file=sys.stderr)
        return 2


def tune(args, path: Path) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..autotune import cache, tuner
    # by default: --model's CPU linears, else every GPU kernel
    names = args.kernels or ([CPU_LINEAR] if args.model else [k for k in tuner.KERNELS if k != CPU_LINEAR])
    jobs = []   # (tunable, bucket)
    whole_model = False   # cpu_linear without --shapes: timed in --model's whole forwards, after the buckets
    for name in names:
        tunable = tuner.get_tunable(name)
        if tunable.device == "cuda" and not torch.cuda.is_available():
            raise tuner.AutotuneError(
                f"tuning {name} needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False). "
                "Tune on a machine with the target GPU, run graft-autotune export FILE there, and "
                "graft-autotune import FILE here; without a tuned entry kernels use their heuristic tile sizes. "
                "On a CPU, graft-autotune tune --model NAME tunes that model's linear layers")
        if args.shapes:
            shapes = [tuner.parse_bucket(s) for s in args.shapes]
        elif name == CPU_LINEAR:
            whole_model = True
            continue
        else:
            shapes = list(tunable.shapes)
        for shape in shapes:
            try:
                bucket = tunable.bucket(**shape)
            except (TypeError, ValueError) as e:
                raise InputError(f"--shapes {shape}: {e}") from e
            if bucket not in [b for t, b in jobs if t is tunable]:
                jobs.append((tunable, bucket))
    if jobs:
        print(f"tuning {len(jobs)} bucket(s) on {cache.environment().gpu} into {path}", file=sys.stderr)
    for tunable, bucket in jobs:
        cached = cache.lookup(tuner.key_for(tunable, bucket), path)
        if cached is not None and not args.force:
            print(f"{tunable.name} {bucket}: cached {_config(cached.config)} {cached.time_ms:.4f} ms "
                  "(--force to retune)")
            continue
        n = len(tunable.configs(bucket)) + (tunable.heuristic(bucket) not in tunable.configs(bucket))
        with tqdm(total=n, desc=f"{tunable.name} {bucket}", unit="config", leave=False) as bar:
            entry = tuner.tune(tunable, bucket, path=path, on_result=lambda config, ms: bar.update(1))
        if entry.heuristic_ms is None:
            versus = "heuristic failed to run"
        else:
            versus = f"heuristic {entry.heuristic_ms:.4f} ms ({entry.heuristic_ms / entry.time_ms:.2f}x)"
        print(f"{tunable.name} {bucket}: tuned {_config(entry.config)} {entry.time_ms:.4f} ms vs {versus}")
    return _tune_model(args, path) if whole_model else 0


CPU_LINEAR = "cpu_linear"


def check(args, path: Path) -> int:
    import torch

    from ..kernels import selfcheck
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = selfcheck.device_name(device)
    failed = selfcheck.failed_ops(device, force=True, path=path)
    for op in selfcheck.PROBES:
        print(f"{op:<15} {'FAILED: ' + failed[op] if op in failed else 'ok'}")
    print(f"{len(selfcheck.PROBES) - len(failed)} of {len(selfcheck.PROBES)} kernels agree with their torch references "
          f"on {where}{'' if device.type == 'cuda' else ' (Triton interpreter)'}; verdicts stored in {path}",
          file=sys.stderr)
    return 1 if failed else 0


def _tune_model(args, path: Path) -> int:
    """cpu_linear for every layer of ``--model``, timed in whole forwards at each width
    (``graft_tk.autotune.cpu_linear.tune_model``)."""
    if not args.model:
        raise InputError("tuning cpu_linear needs --model NAME (timed in its whole forwards) or --shapes "
                         "format=bf16,n=17920,k=1536,rows=16 (one layer alone)")
    import graft_tk
    from tqdm.auto import tqdm

    from ..autotune import cache, cpu_linear, tuner
    from ..models import cpu_paths
    model = graft_tk.load_model(args.model, dtype=args.dtype, device="cpu", quant=args.quant)
    shapes = cpu_linear.shapes_of(model.net)
    if not shapes:
        print(f"{model.name}: no layer has more than one CPU path in {args.dtype} / {args.quant}; nothing to tune")
        return 0
    keys = [tuner.key_for(cpu_linear.TUNABLE, cpu_paths.bucket(**s)) for s in shapes]
    if not args.force and all(cache.lookup(k, path) is not None for k in keys):
        print(f"{model.name}: every layer shape has a usable entry at every width (--force to retune)")
        return 0
    print(f"tuning the CPU paths of {model.name} ({len(shapes) // len(cpu_paths.WIDTHS)} layer shapes) in whole "
          f"forwards on {cache.environment().gpu} into {path}", file=sys.stderr)
    with tqdm(total=len(cpu_paths.WIDTHS), desc="widths", unit="width") as bar:
        def report(width: int, ms: dict) -> None:
            bar.update(1)
            tqdm.write(f"{width:>4} rows: native {ms['native']:.1f} ms, blocks {ms['blocks']:.1f} ms -> "
                       f"{min(ms, key=ms.get)}")
        cpu_linear.tune_model(model, path, progress=report)
    return 0


def show(args, path: Path) -> int:
    from ..autotune import cache
    entries = cache.read_entries(path, strict=False)
    print(f"{path}: {len(entries)} entries")
    if entries:
        rows = _table(entries)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def export(args, path: Path) -> int:
    from ..autotune import cache
    entries = cache.read_entries(path, strict=True)
    if not entries:
        raise InputError(f"nothing to export: {path} has no entries (run graft-autotune tune first, "
                         "or point --cache / GRAFT_TK_AUTOTUNE_CACHE at the cache to export)")
    cache.write_entries(args.file, entries)
    print(f"exported {len(entries)} entries to {args.file}")
    return 0


def import_(args, path: Path) -> int:
    from ..autotune import cache
    if not args.file.exists():
        raise InputError(f"{args.file} does not exist")
    incoming = cache.read_entries(args.file, strict=True)
    cache.update(incoming, path)
    counts = _status_counts(incoming)
    print(f"imported {len(incoming)} entries from {args.file} into {path}: "
          + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if counts.get("other-GPU"):
        print(f"note: {counts['other-GPU']} entries were tuned on another GPU; they are kept for that GPU and "
              "never used on this one", file=sys.stderr)
    return 0


def merge(args, path: Path) -> int:
    from ..autotune import cache
    for f in (args.a, args.b):
        if not f.exists():
            raise InputError(f"{f} does not exist")
    merged = cache.merge(cache.read_entries(args.a, strict=True), cache.read_entries(args.b, strict=True))
    cache.write_entries(args.out, merged)
    print(f"merged {args.a} and {args.b} into {args.out}: {len(merged)} entries")
    return 0


def clear(args, path: Path) -> int:
    from ..autotune import cache
    before = len(cache.read_entries(path, strict=False))
    cache.update([], path, replace=True)
    print(f"cleared {before} entries from {path}")
    return 0


COMMANDS = {"tune": tune, "check": check, "show": show, "export": export, "import": import_, "merge": merge, "clear": clear}


def _config(config: dict) -> str:
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in config.items())


def _source_hashes(entries) -> dict[str, str]:
    from ..autotune import tuner
    from ..models import exact
    names = {e.key.kernel for e in entries}
    hashes = {name: tuner.source_hash(tuner.get_tunable(name).kernel) for name in names if name in tuner.KERNELS}
    if exact.KERNEL in names:     # exact mode's probes (they refresh themselves)
        hashes[exact.KERNEL] = exact.probe_source()
    return hashes


def _status_counts(entries) -> dict[str, int]:
    from ..autotune import cache
    env, hashes = cache.environment(), _source_hashes(entries)
    counts: dict[str, int] = {}
    for e in entries:
        s = cache.status(e, env, hashes)
        counts[s] = counts.get(s, 0) + 1
    return counts


def _table(entries) -> list[tuple[str, ...]]:
    from ..autotune import cache
    env, hashes = cache.environment(), _source_hashes(entries)
    rows = [("KERNEL", "GPU", "BUCKET", "CONFIG", "MS", "HEURISTIC MS", "STATUS")]
    for e in entries:
        gpu = e.key.gpu if not e.key.capability else (f"{e.key.gpu} ({e.key.capability})" if e.key.gpu.startswith("CPU")
                                                      else f"{e.key.gpu} (sm {e.key.capability})")
        rows.append((e.key.kernel, gpu, e.key.bucket, _config(e.config), f"{e.time_ms:.4f}",
                     f"{e.heuristic_ms:.4f}" if e.heuristic_ms is not None else "-", cache.status(e, env, hashes)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
