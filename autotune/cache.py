"""The autotune cache file: one JSON document of tuned configs, safe to share between machines.

    {"format": "graft_tk.autotune/1",
     "entries": [{"key": {"kernel": "tree_attention", "bucket": "rows=64,head_dim=128,kv_len=4096,dtype=bfloat16",
                          "source_hash": "3f2a...", "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                          "triton": "3.3.1", "torch": "2.7.1", "graft_tk": "0.1.0"},
                  "config": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                  "time_ms": 0.031, "heuristic_ms": 0.045, "tuned_at": "2025-06-01T12:00:00+00:00"}]}

An entry is used only when its whole key equals this machine's (``Key`` for the kernel and
bucket): entries from another GPU stay in the file, keyed to that GPU, and entries whose versions
or kernel source differ are *stale* and ignored with a warning. Reads tolerate a corrupt file or
entry (warning, ignored); writes read-merge-write under an exclusive ``flock`` on a side lock file
and replace the file atomically, so concurrent tuners never lose each other's entries.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from graft_tk._cpu import cpu_info
from graft_tk._fs import atomic_write_text, graft_home
from graft_tk._version import __version__
from graft_tk.errors import CorruptFileError

FORMAT = "graft_tk.autotune/1"
log = logging.getLogger(__name__)


class AutotuneWarning(UserWarning):
    """A cache file or entry was corrupt or stale, so it was ignored (the heuristic config is used)."""


def cache_path() -> Path:
    """``$GRAFT_TK_AUTOTUNE_CACHE``, default ``$GRAFT_TK_HOME/autotune.json``."""
    return Path(os.environ.get("GRAFT_TK_AUTOTUNE_CACHE", graft_home() / "autotune.json")).expanduser()


# --------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class Environment:
    """The machine half of a key: which GPU, and which software built the kernel."""
    gpu: str          # torch.cuda.get_device_name, or "CPU <model name>" (cpu_identity)
    capability: str   # "9.0"; on a CPU its kernel-picking ISA flags and torch's threads
    triton: str
    torch: str
    graft_tk: str


@functools.lru_cache(maxsize=None)
def environment(device_index: int | None = None) -> Environment:
    """This process's Environment for CUDA device ``device_index`` (default: the current one)."""
    import torch
    import triton

    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device_index is None else device_index
        gpu = torch.cuda.get_device_name(index)
        capability = "{}.{}".format(*torch.cuda.get_device_capability(index))
    else:
        gpu, capability = cpu_identity()
    return Environment(gpu=gpu, capability=capability, triton=triton.__version__, torch=torch.__version__,
                       graft_tk=__version__)


# The /proc/cpuinfo flags that decide which CPU kernel is fastest (vector width, dot products, bf16, AMX).
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_int8", "amx_bf16")


def cpu_identity() -> tuple[str, str]:
    """("CPU <model name>", "<ISA flags> threads=<n>"): what a CPU timing is keyed by (off Linux:
    the platform's processor string and no flags)."""
    import platform

    import torch
    model, flags = cpu_info()
    model = " ".join(model.split()) or platform.processor() or "unknown"
    isa = " ".join(f for f in ISA_FLAGS if f in flags)
    return f"CPU {model}", f"{isa} threads={torch.get_num_threads()}".strip()


@dataclass(frozen=True)
class Key:
    kernel: str        # registry name, e.g. "tree_attention"
    bucket: str        # canonical shape bucket, e.g. "rows=64,head_dim=128,kv_len=4096,dtype=bfloat16"
    source_hash: str   # sha256 of the kernel's Triton source: editing the kernel invalidates its entries
    gpu: str
    capability: str
    triton: str
    torch: str
    graft_tk: str

    @classmethod
    def make(cls, kernel: str, bucket: str, source_hash: str, env: Environment) -> Key:
        return cls(kernel=kernel, bucket=bucket, source_hash=source_hash, **dataclasses.asdict(env))

    def same_gpu(self, env: Environment) -> bool:
        return (self.gpu, self.capability) == (env.gpu, env.capability)


@dataclass(frozen=True)
class Entry:
    key: Key
    config: dict                 # the kernel's meta-parameters, e.g. BLOCK_M / BLOCK_N / num_warps / num_stages
    time_ms: float               # measured time of `config` on the key's GPU
    heuristic_ms: float | None   # the untuned default's time, for the record
    tuned_at: str                # ISO 8601, UTC

    def to_json(self) -> dict:
        return {"key": dataclasses.asdict(self.key), "config": self.config, "time_ms": self.time_ms,
                "heuristic_ms": self.heuristic_ms, "tuned_at": self.tuned_at}

    @classmethod
    def from_json(cls, d: dict) -> Entry:
        """Raises KeyError / TypeError / ValueError on a malformed entry."""
        key = Key(**d["key"])
        if not all(isinstance(v, str) for v in dataclasses.astuple(key)):
            raise ValueError("key fields must be strings")
        config = d["config"]
        if not (isinstance(config, dict) and config
                and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in config.values())):
            raise ValueError(f"config must be a non-empty object of ints and strings, got {config!r}")
        heuristic_ms = None if d.get("heuristic_ms") is None else float(d["heuristic_ms"])
        return cls(key=key, config=dict(config), time_ms=float(d["time_ms"]), heuristic_ms=heuristic_ms,
                   tuned_at=str(d["tuned_at"]))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def status(entry: Entry, env: Environment, source_hashes: dict[str, str]) -> str:
    """"usable" here, "other-GPU" (kept for that GPU, never applied here), or "stale" (same GPU but
    another Triton / torch / graft_tk version or kernel source, or a kernel this graft_tk lacks)."""
    if not entry.key.same_gpu(env):
        return "other-GPU"
    current = source_hashes.get(entry.key.kernel)
    return "usable" if current is not None and entry.key == Key.make(entry.key.kernel, entry.key.bucket,
                                                                     current, env) else "stale"


# --------------------------------------------------------------------------- reading
def read_entries(path: Path, strict: bool) -> list[Entry]:
    """The entries of a cache file; a missing file has none.

    strict (import, merge): a corrupt file or entry raises CorruptFileError. Otherwise (lookups,
    the local cache): it warns (AutotuneWarning) and is skipped, so a bad file costs only tuning.
    """
    path = Path(path)
    if not path.exists():
        return []

    def bad(what: str) -> None:
        if strict:
            raise CorruptFileError(f"autotune cache {path}: {what}; re-export it with graft-autotune export")
        warnings.warn(f"autotune cache {path}: {what}; ignoring it (heuristic tile sizes are used until it is "
                      f"retuned or replaced: graft-autotune clear, then tune or import)", AutotuneWarning,
                      stacklevel=4)

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        bad(f"unreadable ({e})")
        return []
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        bad(f"not a {FORMAT} document")
        return []
    entries = []
    for i, d in enumerate(doc["entries"]):
        try:
            entries.append(Entry.from_json(d))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad(f"entry #{i} is malformed ({type(e).__name__}: {e})")
    return entries


@functools.lru_cache(maxsize=8)
def _index(path: Path, signature: tuple) -> dict[Key, Entry]:
    """Entries by key, parsed once per version of the file (``signature`` = inode, size, mtime)."""
    return {e.key: e for e in read_entries(path, strict=False)}


@functools.lru_cache(maxsize=1024)
def _lookup(key: Key, path: Path, signature: tuple) -> Entry | None:
    index = _index(path, signature)
    entry = index.get(key)
    if entry is None:
        stale = [k for k in index if (k.kernel, k.bucket, k.gpu, k.capability)
                 == (key.kernel, key.bucket, key.gpu, key.capability)]
        if stale:
            diff = ", ".join(f"{f} {getattr(stale[0], f)!r} != {getattr(key, f)!r}"
                             for f in ("source_hash", "triton", "torch", "graft_tk")
                             if getattr(stale[0], f) != getattr(key, f))
            warnings.warn(f"autotune cache {path}: the {key.kernel} entry for {key.bucket} on this GPU is stale "
                          f"({diff}); using the heuristic config. Rerun graft-autotune tune to refresh it",
                          AutotuneWarning, stacklevel=4)
    return entry


def lookup(key: Key, path: Path | None = None) -> Entry | None:
    """The entry for exactly ``key``, or None. Cheap enough for every launch: one stat, then memoised."""
    path = Path(path or cache_path())
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return _lookup(key, path, (st.st_ino, st.st_size, st.st_mtime_ns))


# --------------------------------------------------------------------------- writing
def merge(*groups: list[Entry]) -> list[Entry]:
    """Union by key; on a key in several groups the latest ``tuned_at`` wins (ties: the later group)."""
    by_key: dict[Key, Entry] = {}
    for group in groups:
        for e in group:
            if e.key not in by_key or e.tuned_at >= by_key[e.key].tuned_at:
                by_key[e.key] = e
    return sorted(by_key.values(), key=lambda e: (e.key.kernel, e.key.gpu, e.key.bucket, e.tuned_at))


def write_entries(path: Path, entries: list[Entry]) -> None:
    """Write a complete document atomically (readers see the old file or the new one)."""
    doc = {"format": FORMAT, "entries": [e.to_json() for e in entries]}
    atomic_write_text(Path(path), json.dumps(doc, indent=1) + "\n")


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive ``flock`` on ``<path>.lock`` (a side file: the cache itself is replaced, not edited)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update(entries: list[Entry], path: Path | None = None, replace: bool = False,
           drop_stale: bool = False) -> list[Entry]:
    """Merge ``entries`` into the cache file (or replace its contents) under the lock; returns the result.
    ``drop_stale``: entries of the same kernel, bucket and GPU under other versions go (a probe
    that refreshes itself, never one a user tuned).

    A corrupt cache is replaced after a warning: its entries were unusable anyway.
    """
    path = Path(path or cache_path())
    slots = {(e.key.kernel, e.key.bucket, e.key.gpu, e.key.capability) for e in entries} if drop_stale else set()
    with locked(path):
        kept = [] if replace else [e for e in read_entries(path, strict=False)
                                   if (e.key.kernel, e.key.bucket, e.key.gpu, e.key.capability) not in slots]
        merged = merge(kept, entries)
        write_entries(path, merged)
    log.info("autotune cache %s: %d entries", path, len(merged))
    return merged
