"""Fixtures for the pytest-benchmark suite (``python -m pytest bench/ --benchmark-only``).

This folder is outside ``testpaths``, so the default test run never collects it: timings are
recorded, never judged. Every benchmark records the device and versions in ``extra_info``.
"""
import pytest
import torch

from graft_tk.bench.compare import machine_info


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def env_info(device) -> dict:
    info = machine_info()
    return {"device": str(device), **{k: info[k] for k in ("gpu", "cpu", "cores", "torch_threads", "torch",
                                                             "triton", "transformers", "graft_tk", "date")}}


@pytest.fixture(autouse=True)
def _record_env(request, env_info):
    """Stamp every benchmark with where and with what it ran (saved with --benchmark-json / -autosave)."""
    if "benchmark" in request.fixturenames:
        request.getfixturevalue("benchmark").extra_info.update(env_info)
