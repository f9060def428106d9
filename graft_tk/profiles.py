"""Calibration profiles: the best GraftConfig found for one (target, drafter, device, dtype).

``graft-calibrate`` writes a profile; ``decode`` loads the matching one when no ``config=`` is
given. A profile is a JSON file under ``$GRAFT_TK_PROFILE_DIR`` (default
``$GRAFT_TK_HOME/profiles``), named after the target, drafter, device and dtype::

    {"format": "graft_tk.profile/4",
     "key": {"target": "qwen2.5-coder-1.5b", "target_weights": "cc32...", "drafter": ...,
             "drafter_weights": ..., "device": "cpu: Intel(R) Xeon(R) ...", "dtype": "bfloat16",
             "graft_tk": "0.6.0"},
     "method": "graft", "config": {GraftConfig fields}, "measured": {tokens/s, MAT, ...}}

The file name finds the profile; the full key decides whether it may be used. A profile whose
weights hash or graft_tk version differs is *stale*, one that does not parse is *corrupt*: both
are reported (a warning naming the file and the fix) and ignored, never used.

The runtime reads profiles (``decode``, graft-serve's batch policy); ``graft-calibrate`` writes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ._cpu import cpu_info
from ._fs import atomic_write_text, exclusive, graft_home
from ._version import __version__
from .config import GraftConfig
from .errors import CorruptFileError, GraftError
from .methods import METHODS
from .models import Model
from .models.eagle3 import Eagle3Head
from .models.registry import STAMP, sha256_file

# /2: methods name their sources (graft, graft+pld, ...); /3: acceptance priors by source name;
# /4: ``graft`` holds every source (the paper's drafter + M is ``graft-paper``)
FORMAT = "graft_tk.profile/4"


class ProfileWarning(UserWarning):
    """A profile exists for this model pair but is stale or corrupt, so it was ignored."""


def profile_dir() -> Path:
    return Path(os.environ.get("GRAFT_TK_PROFILE_DIR", graft_home() / "profiles")).expanduser()


# --------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class ProfileKey:
    target: str
    target_weights: str
    drafter: str | None
    drafter_weights: str | None
    device: str
    dtype: str
    graft_tk: str
    batch: int = 1      # requests verified together (graft-serve --max-batch): a config per batch size

    def file_name(self) -> str:
        """Target, drafter, device, dtype and a batch size past 1 (not weights or version: a
        mismatch there is *stale*)."""
        parts = [self.target, self.drafter or "none", self.device, self.dtype]
        slug = "__".join(re.sub(r"[^A-Za-z0-9._-]+", "-", p).strip("-") for p in parts)
        return slug[:180] + (f"__batch{self.batch}" if self.batch > 1 else "") + ".json"


def profile_key(target: Model, drafter: Model | Eagle3Head | None, batch: int = 1) -> ProfileKey:
    """The pair's identity; a quantized model's format is part of its dtype (``bfloat16-int4``):
    its costs, and so its best config, are its own; so are a batch size's."""
    return ProfileKey(target=target.name, target_weights=weights_fingerprint(target),
                      drafter=drafter.name + _quant_suffix(drafter) if drafter else None,
                      drafter_weights=weights_fingerprint(drafter) if drafter else None,
                      device=device_name(target.device),
                      dtype=str(target.dtype).removeprefix("torch.") + _quant_suffix(target), graft_tk=__version__,
                      batch=batch)


def _quant_suffix(model) -> str:
    quant = getattr(model, "quant", "none")
    return "" if quant == "none" else f"-{quant}"


def device_name(device: torch.device) -> str:
    """A human-readable device identity: the GPU's name, or the CPU model and core count."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = cpu_info()[0] or platform.processor() or platform.machine()
    return f"cpu: {cpu}, {os.cpu_count()} cores"


_FINGERPRINTS: dict[str, str] = {}
FINGERPRINTS_FILE = "fingerprints.json"      # under GRAFT_TK_HOME: {memo key: fingerprint}, across processes


def weights_fingerprint(model: Model | Eagle3Head) -> str:
    """A hash that changes when the weights change.

    Registry and GGUF conversions carry their source's sha256 in a stamp file; other checkpoint
    folders (EAGLE-3 heads included) are hashed (config.json and every weight file), memoised by
    path, size and mtime. Self-drafters (``name[:L]``) differ by name and by layer count.
    """
    if isinstance(model, Eagle3Head):
        if model.path is None:
            raise GraftError("an EAGLE-3 head built in memory has no weights file to fingerprint; "
                             "save it (save_eagle3) and load it (load_eagle3)")
        path, extra = Path(model.path), "eagle3"
    else:
        path, extra = Path(model.path), f"layers={model.config.n_layers}" + _quant_suffix(model)
    stamp = path / STAMP
    if stamp.exists():
        try:
            return hashlib.sha256((json.loads(stamp.read_text())["source_sha256"] + extra).encode()).hexdigest()[:16]
        except (OSError, ValueError, KeyError):
            pass  # fall through to hashing the files
    files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin")
                                                                  or p.name == "config.json"))
    memo = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files] + [extra])
    if memo not in _FINGERPRINTS:
        _FINGERPRINTS.update(_stored_fingerprints())
    if memo not in _FINGERPRINTS:
        digests = [extra] + [sha256_file(p) for p in files]
        _FINGERPRINTS[memo] = hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]
        with exclusive(graft_home() / (FINGERPRINTS_FILE + ".lock")):
            stored = _stored_fingerprints()
            stored[memo] = _FINGERPRINTS[memo]
            atomic_write_text(graft_home() / FINGERPRINTS_FILE, json.dumps(stored))
    return _FINGERPRINTS[memo]


def _stored_fingerprints() -> dict[str, str]:
    """What earlier processes hashed (a damaged file is ignored: it is rewritten on the next hash)."""
    try:
        stored = json.loads((graft_home() / FINGERPRINTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str)}


# --------------------------------------------------------------------------- files
@dataclass(frozen=True)
class Profile:
    key: ProfileKey
    method: str
    config: GraftConfig
    measured: dict
    path: Path


def write_profile(key: ProfileKey, method: str, config: GraftConfig, measured: dict,
                  directory: Path | None = None) -> Path:
    """Write the profile atomically (a reader sees the old file or the new one, never half)."""
    path = Path(directory or profile_dir()) / key.file_name()
    doc = {"format": FORMAT, "key": dataclasses.asdict(key), "method": method,
           "config": dataclasses.asdict(config), "measured": measured}
    atomic_write_text(path, json.dumps(doc, indent=1, default=str) + "\n")
    return path


def read_profile(path: Path) -> Profile:
    """Parse and validate one profile file; CorruptFileError says what is wrong and how to fix it."""
    path = Path(path)
    fix = f"delete {path} or rerun graft-calibrate for this model pair"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"profile {path} is unreadable ({e}); {fix}") from e
    if isinstance(doc, dict) and doc.get("format") == "graft_tk.profile/1":
        raise CorruptFileError(f"profile {path} was written by graft_tk 0.1 (its 'graft' included prompt lookup, "
                               f"now 'graft+pld'); {fix}")
    if isinstance(doc, dict) and doc.get("format") == "graft_tk.profile/2":
        raise CorruptFileError(f"profile {path} was written by graft_tk 0.3 (its acceptance priors are not "
                               f"kept by source); {fix}")
    if isinstance(doc, dict) and doc.get("format") == "graft_tk.profile/3":
        raise CorruptFileError(f"profile {path} was written by graft_tk 0.4 (its 'graft' was the drafter + M, now "
                               f"'graft-paper'; 'graft' holds every source); {fix}")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptFileError(f"profile {path} is not a {FORMAT} file; {fix}")
    try:
        key = ProfileKey(**doc["key"])
        cfg = dict(doc["config"])
        cfg["template"] = tuple(cfg["template"])
        config = GraftConfig(**cfg)
        method = doc["method"]
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}")
        return Profile(key=key, method=method, config=config, measured=dict(doc.get("measured", {})), path=path)
    except (GraftError, KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"profile {path} has invalid contents ({e}); {fix}") from e


def find_profile(target: Model, drafter: Model | Eagle3Head | None, directory: Path | None = None,
                 batch: int = 1) -> Profile | None:
    """The usable profile for this pair (at this batch size), or None. Stale or corrupt ones warn
    (ProfileWarning) and give None."""
    key = profile_key(target, drafter, batch)
    path = Path(directory or profile_dir()) / key.file_name()
    if not path.exists():
        return None
    try:
        profile = read_profile(path)
    except CorruptFileError as e:
        warnings.warn(f"{e}; using the default config", ProfileWarning, stacklevel=3)
        return None
    if profile.key != key:
        diff = ", ".join(f"{f.name} {getattr(profile.key, f.name)!r} != {getattr(key, f.name)!r}"
                         for f in dataclasses.fields(key) if getattr(profile.key, f.name) != getattr(key, f.name))
        warnings.warn(f"profile {path} is stale ({diff}); using the default config. Rerun graft-calibrate "
                      f"--model {target.name} to refresh it", ProfileWarning, stacklevel=3)
        return None
    return profile


def batch_policy(target: Model, drafter: Model | Eagle3Head | None, max_batch: int,
                 directory: Path | None = None) -> dict[int, GraftConfig]:
    """Batch size -> config, from the pair's profiles for batch sizes 2 .. max_batch
    (``graft-calibrate --batch B``): what ``graft_tk.batch.Batch`` takes as its policy."""
    found = {b: find_profile(target, drafter, directory, batch=b) for b in range(2, max_batch + 1)}
    return {b: p.config for b, p in found.items() if p is not None}


def list_profiles(directory: Path | None = None) -> list[tuple[Path, Profile | CorruptFileError]]:
    """Every *.json in the profile folder, parsed, or the error that says why it is unusable."""
    directory = Path(directory or profile_dir())
    out: list[tuple[Path, Profile | CorruptFileError]] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            out.append((path, read_profile(path)))
        except CorruptFileError as e:
            out.append((path, e))
    return out
