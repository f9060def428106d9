"""Each CPU linear layer's path per call width (graft_tk.models.cpu_paths): the paths agree with
F.linear, the plan follows the autotune cache (keyed by this CPU) and falls back to the heuristic,
and graft-autotune tunes a model's shapes on a CPU."""
import json

import pytest
import torch
import torch.nn.functional as F

from graft_tk.autotune import AutotuneWarning, cache, tuner
from graft_tk.cli import autotune as cli
from graft_tk.models import cpu_paths
from graft_tk.models.quant import QuantLinear
from graft_tk.models.transformer import Linear

from .tolerances import QUANT_MATMUL_TOL


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("GRAFT_TK_AUTOTUNE_CACHE", str(path))
    return path


def test_blocks_multiply_the_same_weights_as_f_linear(monkeypatch):
    """A bf16 layer in blocks (here 5 output rows per block) is F.linear within bf16's rounding;
    widths the plan keeps native are F.linear exactly; the output is never the scratch."""
    monkeypatch.setattr(cpu_paths, "BLOCK_ELEMENTS", 5 * 64)
    torch.manual_seed(0)
    layer = Linear(64, 23, bias=True, dtype=torch.bfloat16).requires_grad_(False)
    layer.paths = ("native",) * 4 + ("blocks",) * 5          # blocks from 16 rows
    x = torch.randn(2, 9, 64).to(torch.bfloat16)              # 18 rows: blocks
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    rtol, atol = QUANT_MATMUL_TOL[torch.bfloat16]
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 9, 23)
    torch.testing.assert_close(y.float(), want, rtol=rtol, atol=atol * want.abs().max().item())
    assert y.data_ptr() != cpu_paths._scratch.buf.data_ptr()
    narrow = x[0, :4]
    assert torch.equal(layer(narrow), F.linear(narrow, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_blocks_multiply_the_weights_the_packed_kernel_holds(monkeypatch, dtype):
    """An int4 layer in blocks (here 64 output rows a block, 3 blocks) rebuilds torch's packed
    weight: the kernel's own result within the scratch's rounding (fp32: the float sums'; bf16:
    the rebuilt weight's), the bias added; a layer whose rows are not whole blocks of 64 has
    only the packed kernel, and this torch's packing is the one the path reads."""
    assert cpu_paths.int4_layout_known()
    monkeypatch.setattr(cpu_paths, "BLOCK_ELEMENTS", 64 * 96)
    torch.manual_seed(0)
    layer = QuantLinear.from_float(torch.randn(192, 96), torch.randn(192), "int4", dtype)
    x = torch.randn(3, 7, 96).to(dtype)
    native = layer(x)
    layer.paths = ("blocks",) * len(cpu_paths.WIDTHS)
    y = layer(x)
    want = F.linear(x.float(), layer.dequantized().float(), layer.bias.float())
    assert y.dtype == dtype and y.shape == (3, 7, 192) and y.data_ptr() != cpu_paths._scratch.buf.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (y.float() - want).abs().max() <= tol * want.abs().max()
    assert (native.float() - want).abs().max() <= tol * want.abs().max()
    assert cpu_paths.candidates("int4", 192) == ("native", "blocks")
    assert cpu_paths.candidates("int4", 48) == ("native",) and cpu_paths.plan("int4", 48, 96) == ("native",) * 9


def test_the_scratch_serves_calls_in_and_out_of_inference_mode(monkeypatch):
    """A scratch made under inference mode (decoding) was an inference tensor, and the next call
    outside it (a plain forward) failed writing into it."""
    monkeypatch.setattr(cpu_paths, "_scratch", type(cpu_paths._scratch)())     # a fresh one for this thread
    weight, x = torch.randn(8, 32), torch.randn(3, 32)
    with torch.inference_mode():
        inside = cpu_paths.blocks(x, weight)
    outside = cpu_paths.blocks(x, weight)
    torch.testing.assert_close(inside, F.linear(x, weight))
    torch.testing.assert_close(outside, inside)
    assert not outside.is_inference()


def test_widths_map_to_their_slot_and_heuristic_by_cpu(monkeypatch):
    assert [cpu_paths.width_slot(r) for r in (1, 2, 3, 8, 9, 128, 129, 500)] == [0, 1, 2, 3, 4, 7, 8, 8]
    assert cpu_paths.bucket("bf16", 10, 20, 3) == "format=bf16,n=10,k=20,rows=4"
    with pytest.raises(ValueError, match="format"):
        cpu_paths.bucket("int3", 10, 20, 3)
    monkeypatch.setattr(cpu_paths, "native_bf16_cpu", lambda: False)
    assert [cpu_paths.heuristic("bf16", r) for r in (8, 16)] == ["native", "blocks"]
    assert cpu_paths.heuristic("int8", 128) == "native" and cpu_paths.heuristic("fp32", 128) == "native"
    monkeypatch.setattr(cpu_paths, "native_bf16_cpu", lambda: True)
    assert cpu_paths.heuristic("bf16", 128) == "native"
    assert [cpu_paths.heuristic("int8", r) for r in (32, 64)] == ["native", "blocks"]
    assert [cpu_paths.heuristic("int4", r) for r in (128, 256)] == ["native", "blocks"]
    assert cpu_paths.candidates("fp32", 64) == ("native",)


def test_the_plan_takes_this_cpus_tuned_entries_and_ignores_stale_ones(cache_file, monkeypatch):
    monkeypatch.setattr(cpu_paths, "native_bf16_cpu", lambda: False)
    tunable = tuner.get_tunable("cpu_linear")
    times = {"native": 2.0, "blocks": 1.0}                 # a fake timer: blocks wins at 4 rows
    tuner.tune(tunable, cpu_paths.bucket("bf16", 48, 32, 4), benchmark=lambda b, c: times[c["path"]])
    assert cpu_paths.plan("bf16", 48, 32) == ("native", "native", "blocks", "native") + ("blocks",) * 5
    env = cache.environment()
    assert env.gpu.startswith("CPU ") and f"threads={torch.get_num_threads()}" in env.capability
    # the same entry from another version of cpu_paths.py is stale: warned about, not used
    doc = json.loads(cache_file.read_text())
    doc["entries"][0]["key"]["source_hash"] = "0" * 64
    cache_file.write_text(json.dumps(doc))
    with pytest.warns(AutotuneWarning, match="stale"):
        assert cpu_paths.plan("bf16", 48, 32)[2] == "native"


def test_a_loaded_bf16_model_gets_plans_and_its_forward_matches_the_native_one(smollm2_gguf, monkeypatch, cache_file):
    """Where bf16 is not native the layers take blocks from 16 rows; the whole forward's logits
    equal the all-native forward's within bf16's rounding; an fp32 model gets no plan."""
    import graft_tk
    monkeypatch.setattr(cpu_paths, "native_bf16_cpu", lambda: False)
    model = graft_tk.load_model("smollm2-135m", dtype="bf16", num_layers=2, progress=False)
    net = model.net
    layers = [m for m in net.modules() if isinstance(m, Linear)]
    assert layers and all(m.paths == ("native",) * 4 + ("blocks",) * 5 for m in layers)
    assert net.head_paths is not None                        # SmolLM2's LM head is the tied embedding
    tokens = torch.randint(1000, (1, 20))
    with torch.inference_mode():
        net.setup_cache(32)
        planned = net(tokens, torch.arange(20), 0)
        for m in layers:
            m.paths = None
        net.head_paths = None
        native = net(tokens, torch.arange(20), 0)
    # the two paths round the same fp32 sums to bf16 in each layer: a few bf16 steps (2^-8 of a
    # value) at the logits' scale (measured on a Zen 4: 0.64% of the largest logit), and no
    # choice moves that is not a near tie
    diff = (planned - native).abs().max()
    assert diff <= 2 ** -6 * native.abs().max()
    top2 = native.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert clear.any() and torch.equal(planned.argmax(-1)[clear], native.argmax(-1)[clear])
    fp32 = graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=1, progress=False).net
    assert all(m.paths is None for m in fp32.modules() if isinstance(m, Linear)) and fp32.head_paths is None


def test_a_loaded_int4_model_reads_long_calls_in_blocks_and_agrees_with_the_packed_kernel(smollm2_gguf, monkeypatch,
                                                                                         cache_file):
    """With native bf16 an int4 model's layers take blocks from 129 rows (a prompt's read, a
    drafter's window): the forward's logits equal the all-packed-kernel forward's within bf16's
    rounding of the rebuilt weights, and no clear choice moves."""
    import graft_tk
    from graft_tk.models.quant import QuantLinear
    monkeypatch.setattr(cpu_paths, "native_bf16_cpu", lambda: True)
    model = graft_tk.load_model("smollm2-135m", dtype="bf16", quant="int4", num_layers=2, progress=False)
    layers = [m for m in model.net.modules() if isinstance(m, QuantLinear)]
    int4 = [m for m in layers if m.format == "int4"]      # the GGUF's finer tensors stay int8
    assert len(int4) >= 8 and all(m.paths == ("native",) * 8 + ("blocks",) for m in int4)
    tokens = torch.randint(1000, (1, 160))
    with torch.inference_mode():
        model.net.setup_cache(160)
        planned = model.net(tokens, torch.arange(160), 0)
        for m in layers:
            m.paths = None
        native = model.net(tokens, torch.arange(160), 0)
    diff = (planned - native).abs().max()
    assert 0 < diff <= 2 ** -4 * native.abs().max()
    top2 = native.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert clear.any() and torch.equal(planned.argmax(-1)[clear], native.argmax(-1)[clear])


def test_graft_autotune_tunes_cpu_linears_and_says_what_a_cpu_needs(cache_file, capsys):
    assert cli.main(["tune", "--kernels", "cpu_linear", "--shapes", "format=bf16,n=64,k=32,rows=16",
                     "format=fp16,n=64,k=32,rows=1"]) == 0
    out = capsys.readouterr().out
    assert "cpu_linear format=bf16,n=64,k=32,rows=16: tuned path=" in out
    assert cli.main(["show"]) == 0
    shown = capsys.readouterr().out
    assert "2 entries" in shown and "CPU " in shown and "threads=" in shown and "usable" in shown
    if not torch.cuda.is_available():
        assert cli.main(["tune"]) == 2
        assert "--model NAME" in capsys.readouterr().err
    assert cli.main(["tune", "--kernels", "cpu_linear"]) == 2
    assert "needs --model" in capsys.readouterr().err


def test_the_tunable_times_a_model_s_shapes_at_every_width(smollm2_gguf):
    import graft_tk
    from graft_tk.autotune import cpu_linear
    net = graft_tk.load_model("smollm2-135m", dtype="bf16", num_layers=1, progress=False).net
    shapes = cpu_linear.shapes_of(net)
    distinct = {(s["format"], s["n"], s["k"]) for s in shapes}
    assert len(shapes) == len(distinct) * len(cpu_paths.WIDTHS)
    assert ("bf16", 49152, 576) in distinct                   # the tied head
    ms = cpu_linear.benchmark("format=bf16,n=64,k=32,rows=4", {"path": "blocks"})
    assert 0 < ms < 1000


def test_a_model_is_tuned_in_whole_forwards_and_loads_with_the_picks(smollm2_gguf, cache_file, capsys):
    """tune_model times the whole forward at every width, native then blocks, writes the faster
    for every layer shape at that width; a model loaded afterwards takes those picks; the CLI's
    --model runs it and a second run finds every entry cached."""
    import graft_tk
    from graft_tk.autotune import cpu_linear
    model = graft_tk.load_model("smollm2-135m", dtype="bf16", num_layers=1, progress=False)
    seen = []
    entries = cpu_linear.tune_model(model, repeats=1, prefix=8, progress=lambda w, ms: seen.append((w, ms)))
    n_shapes = len(cpu_linear.shapes_of(model.net)) // len(cpu_paths.WIDTHS)
    assert [w for w, _ in seen] == list(cpu_paths.WIDTHS)[::-1] and len(entries) == n_shapes * len(cpu_paths.WIDTHS)
    best = {w: min(ms, key=ms.get) for w, ms in seen}
    assert all(e.config["path"] == best[cpu_linear.parse_bucket(e.key.bucket)["rows"]] for e in entries)
    again = graft_tk.load_model("smollm2-135m", dtype="bf16", num_layers=1, progress=False).net
    want = tuple(best[w] for w in cpu_paths.WIDTHS)
    assert again.head_paths == (want if "blocks" in want else None)
    assert cli.main(["tune", "--model", "smollm2-135m", "--dtype", "bf16"]) == 0
    assert "every layer shape has a usable entry" in capsys.readouterr().out
