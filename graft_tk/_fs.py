"""Cache locations and atomic writes: a reader never sees a half-written file."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path


def graft_home() -> Path:
    """Root of every cache graft_tk writes: ``$GRAFT_TK_HOME``, default ``~/.cache/graft_tk``."""
    return Path(os.environ.get("GRAFT_TK_HOME", Path.home() / ".cache" / "graft_tk")).expanduser()


def _umask_mode(base: int) -> int:
    """``base`` less the process umask: mkstemp/mkdtemp create 0600/0700, a cache should not."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a fresh temp folder beside ``final``; on success it is renamed to ``final``.

    On any error the temp folder is removed, so ``final`` is either complete or absent.
    An existing ``final`` is replaced only after the new one is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    os.chmod(tmp, _umask_mode(0o777))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old.{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(lock_file: Path):
    """Hold an exclusive lock on ``lock_file`` (created if missing) for the block: a second
    process that wants to build the same cache entry waits, then finds it built."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
