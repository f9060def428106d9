"""Triton tile-size autotuning with a persistent, shareable cache (``graft-autotune``).

Tile sizes depend on the GPU, so each GPU model is tuned once and the result shared as a file:

* ``cache``: the JSON cache at ``$GRAFT_TK_AUTOTUNE_CACHE`` (default ``$GRAFT_TK_HOME/autotune.json``).
  Entries are keyed by kernel, shape bucket, kernel source hash, GPU name and compute capability,
  and Triton / torch / graft_tk versions; only an exact match is ever used. Corrupt or stale
  entries are ignored with a warning; writes are locked and atomic.
* ``tuner``: the registry of tunable kernels (``KERNELS``), the search (``tune``) and ``select``,
  which a launcher calls before each launch on a GPU: cached config, else a search when
  ``GRAFT_TK_AUTOTUNE=1``, else the kernel's heuristic. On CPU / under the interpreter:
  the heuristic, always (no cache read, no search).
* ``tree_attention``: the tree-attention kernel's candidate tiles, buckets and GPU benchmark.
"""
from .cache import AutotuneWarning, Entry, Environment, Key, cache_path
from .tuner import KERNELS, AutotuneError, Tunable, get_tunable, resolve, select, tune

__all__ = ["AutotuneWarning", "AutotuneError", "Entry", "Environment", "Key", "KERNELS", "Tunable", "cache_path",
           "get_tunable", "resolve", "select", "tune"]
