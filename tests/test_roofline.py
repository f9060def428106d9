"""The roofline table: bytes each forward reads, its time against the measured bandwidth, the plot."""
import json

import pytest
import torch
from torch import nn

from graft_tk.bench import roofline
from graft_tk.cli.bench import main
from graft_tk.models.quant import QuantLinear

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bytes_read_count_what_each_format_stores():
    net = nn.Module()
    net.a = QuantLinear.from_float(torch.randn(64, 96), None, "int4", torch.bfloat16)
    net.b = QuantLinear.from_float(torch.randn(32, 64), torch.randn(32), "int8", torch.bfloat16)
    net.c = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    nbytes, weights = roofline.linear_bytes_and_weights(net)
    assert weights == 64 * 96 + 32 * 64 + 16 * 8
    int4 = net.a.qweight.numel() + net.a.scales.numel() * 2       # packed nibbles + bf16 scales and zeros
    assert net.a.qweight.numel() == 64 * 96 // 2 and net.a.scales.numel() == 2 * 64 * 96 // 32
    assert nbytes == int4 + (32 * 64 + 32 * 2 + 32 * 2) + 16 * 8 * 2


def test_a_tied_head_reads_the_embedding(smollm2):
    nbytes, weights = roofline.linear_bytes_and_weights(smollm2.net)
    assert smollm2.net.output is None                       # SmolLM2 ties its head
    e = smollm2.net.tok_embeddings.weight
    layers = sum(m.weight.numel() for m in smollm2.net.modules() if isinstance(m, nn.Linear))
    assert weights == layers + e.numel() and nbytes == 4 * weights       # fp32


def test_measure_times_every_forward_kind_against_the_bandwidth(smollm2, tmp_path):
    bw, rows = roofline.measure(smollm2, smollm2, budget=4, top_k=2, prefill=8, context=16, repeats=1,
                                bandwidth_gbs=10.0)
    assert bw == 10.0
    assert [(r.kind, r.rows, r.compiled) for r in rows] == [("ar", 1, False), ("verify", 4, False), ("drafter", 1, False),
                                                             ("drafter", 2, False), ("prefill", 8, False)]
    nbytes, weights = roofline.linear_bytes_and_weights(smollm2.net)
    for r in rows:
        assert r.ms > 0
        assert r.mb_read == pytest.approx((nbytes + roofline.kv_bytes(smollm2.net, 16)) / 1e6, abs=0.1)
        assert r.gb_per_s == pytest.approx(r.mb_read / r.ms, rel=0.02)
        assert r.pct_bandwidth == pytest.approx(100 * r.gb_per_s / 10.0, rel=0.02)
        assert r.floor_ms == pytest.approx(r.mb_read / 10.0, rel=0.02)
        assert r.gflop_per_s == pytest.approx(2 * r.rows * weights / r.ms / 1e6, rel=0.02)
    data = roofline.as_json(bw, rows)
    table = roofline.markdown(json.loads(json.dumps(data)))
    assert table.count("\n| ") == 1 + len(rows) and "| verify | " in table
    roofline.plot(data, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_the_bandwidth_probe_reads_its_buffer():
    gbs = roofline.read_bandwidth_gbs(torch.device("cpu"), repeats=2, nbytes=1 << 24)
    assert 0.1 < gbs < 10_000


def test_graft_bench_roofline_prints_stores_and_plots_it(smollm2, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "hi", "category": "chat", "prompt": "Say hi."}) + "\n")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["--model", "smollm2-135m", "--drafter", "self:4", "--methods", "ar,pruned", "--prompts", str(prompts),
               "--max-new-tokens", "3", "--dtype", "fp32", "--no-anchors", "--budget", "4", "--roofline",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["roofline"]["read_bandwidth_gbs"] > 0
    assert [f["kind"] for f in report["roofline"]["forwards"]] == ["ar", "verify", "drafter", "drafter", "prefill"]
    assert report["roofline"]["forwards"][1]["rows"] == 4
    assert "roofline:" in capsys.readouterr().out
    assert (tmp_path / "out-roofline.png").read_bytes()[:8] == PNG_MAGIC
