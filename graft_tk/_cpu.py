"""This machine's CPU as Linux's /proc/cpuinfo names it: what CPU timings and profiles are keyed by."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", no flags) where it cannot
    be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", frozenset()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields.get("model name", ""), frozenset(fields.get("flags", "").split())
