"""The self-check a GPU runs before it trusts the Triton kernels (here in Triton's interpreter):
every kernel agrees with its reference on its probe, the verdicts are stored and read back, and
a kernel that computes wrong or does not run is replaced by its reference with one warning."""
import warnings

import pytest
import torch

from graft_tk.autotune import cache
from graft_tk.kernels import selfcheck
from graft_tk.ops import OPS, ops_for

CPU = torch.device("cpu")


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("GRAFT_TK_AUTOTUNE_CACHE", str(path))
    monkeypatch.setattr(selfcheck, "_warned", set())
    return path


def test_every_op_has_a_probe():
    assert set(selfcheck.PROBES) == set(OPS)


def test_every_kernel_passes_and_the_verdicts_are_read_back(cache_file, monkeypatch):
    assert selfcheck.failed_ops(CPU) == {}
    entries = cache.read_entries(cache_file, strict=True)
    assert sorted(e.key.bucket for e in entries) == sorted(f"op={op}" for op in OPS)
    assert all(e.key.kernel == "selfcheck" and e.config == {"verdict": "ok"} for e in entries)
    monkeypatch.setattr(selfcheck, "check", lambda op, device: pytest.fail(f"{op} checked again"))
    assert selfcheck.failed_ops(CPU) == {}                    # a later process reads the verdicts


def _wrong_accept(real):
    def accept(*args):
        out = real(*args)
        out[0].add_(1)                                    # every accepted length one too long
        return out
    return accept


def test_a_kernel_that_computes_wrong_is_replaced_by_its_reference_with_one_warning(cache_file, monkeypatch):
    import graft_tk.kernels.accept as kernel
    import graft_tk.reference.accept as reference
    monkeypatch.setattr(kernel, "accept", _wrong_accept(kernel.accept))
    with pytest.warns(selfcheck.KernelCheckWarning, match="kernel of accept failed its check.*torch reference"):
        ops = ops_for("triton", CPU, selfcheck=True)
    assert ops.accept is reference.accept and ops.tree_attention.__module__ == "graft_tk.kernels.tree_attention"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # once per process: no second warning
        assert ops_for("triton", CPU, selfcheck=True).accept is reference.accept
    stored = {e.key.bucket: e.config for e in cache.read_entries(cache_file, strict=True)}
    assert stored["op=accept"]["verdict"] == "failed" and "differ" in stored["op=accept"]["why"]


def test_a_kernel_that_raises_is_named_with_the_error(cache_file, monkeypatch):
    import graft_tk.kernels.prompt_lookup as kernel

    def broken(*args):
        raise RuntimeError("PTX compilation failed\nmore lines")
    monkeypatch.setattr(kernel, "prompt_lookup", broken)
    with pytest.warns(selfcheck.KernelCheckWarning):
        failed = selfcheck.failed_ops(CPU, force=True)
    assert failed == {"prompt_lookup": "RuntimeError: PTX compilation failed"}


def test_the_check_can_be_switched_off_and_is_off_on_a_cpu_by_default(cache_file, monkeypatch):
    monkeypatch.setenv("GRAFT_TK_SELFCHECK", "0")
    assert selfcheck.failed_ops(CPU) == {} and not cache_file.exists()
    monkeypatch.delenv("GRAFT_TK_SELFCHECK")
    ops_for("triton", CPU)                                # the interpreter: tests check the kernels
    assert not cache_file.exists()


def test_graft_autotune_check_prints_each_kernel(cache_file, capsys):
    from graft_tk.cli import autotune
    assert autotune.main(["check", "--cache", str(cache_file)]) == 0
    out = capsys.readouterr()
    assert all(f"{op}" in out.out for op in OPS) and out.out.count(" ok") == len(OPS)
    assert f"{len(OPS)} of {len(OPS)} kernels agree" in out.err
