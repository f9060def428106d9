"""Bad input at the edges is a clear error naming the problem and the fix, never a traceback:
devices, damaged checkpoint files, out-of-range flags, a prompt awaited on a terminal."""
import dataclasses
import io
import json
import shutil

import pytest
import torch

import graft_tk
from graft_tk.errors import CorruptFileError, InputError
from graft_tk.models import parse_device
from graft_tk.models.registry import STAMP, stamp_ok


@pytest.mark.parametrize("device, message", [("gpu", "unknown device 'gpu'"), ("mps", "use cpu or cuda")])
def test_a_device_torch_cannot_use_is_named(device, message):
    with pytest.raises(InputError, match=message):
        parse_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_so_before_loading_anything(capsys):
    with pytest.raises(InputError, match="sees no CUDA GPU"):
        graft_tk.load_model("no-such-model", device="cuda")       # the device first: no lookup, no download
    from graft_tk.cli import generate
    assert generate.main(["--model", "smollm2-135m", "--device", "cuda", "--prompt", "x"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_cpu_is_cpu():
    assert parse_device("cpu") == torch.device("cpu") and parse_device(None).type in ("cpu", "cuda")


@pytest.fixture
def folder(smollm2, tmp_path):
    """A copy of SmolLM2's checkpoint folder to damage."""
    out = tmp_path / "model"
    shutil.copytree(smollm2.path, out)
    return out


@pytest.mark.parametrize("file, text, message", [
    ("config.json", "{\"model_type\": \"llama\"", "config.json cannot be read"),
    ("config.json", "[1, 2]", "holds a JSON list"),
    ("config.json", None, "lacks a positive integer"),      # hidden_size removed
    ("tokenizer_config.json", "{not json", "tokenizer_config.json cannot be read"),
    ("tokenizer.json", "{}", "tokenizer.json cannot be parsed"),
])
def test_a_damaged_checkpoint_file_is_named(folder, file, text, message):
    if text is None:
        cfg = json.loads((folder / file).read_text())
        del cfg["hidden_size"]
        text = json.dumps(cfg)
    (folder / file).write_text(text)
    with pytest.raises(CorruptFileError, match=message) as e:
        graft_tk.load_model(folder, dtype="fp32", progress=False)
    assert str(folder) in str(e.value)


def test_a_stamp_without_its_file_list_is_stale(folder):
    (folder / STAMP).write_text(json.dumps({"source_sha256": "x", "converter_version": 1}))
    assert not stamp_ok(folder, "x")
    (folder / STAMP).write_text("[]")
    assert not stamp_ok(folder, "x")


@pytest.mark.parametrize("cli, flag, value", [
    ("calibrate", "--trials", "0"), ("calibrate", "--timeout", "-5"), ("calibrate", "--n-prompts", "0"),
    ("calibrate", "--repeats", "two"), ("bench", "--repeats", "0"), ("bench", "--n-per-category", "0"),
    ("generate", "--max-new-tokens", "0"),
])
def test_an_out_of_range_flag_names_itself(cli, flag, value, capsys):
    import importlib
    main = importlib.import_module(f"graft_tk.cli.{cli}").main
    with pytest.raises(SystemExit) as exit:
        main(["--model", "smollm2-135m", flag, value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and value in err, err


def test_generate_says_it_waits_for_a_prompt_on_a_terminal(smollm2, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdin", Terminal("Say hi."))
    from graft_tk.cli import generate
    assert generate.main(["--model", "smollm2-135m", "--dtype", "fp32", "--max-new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "end it with Ctrl-D" in out.err and json.loads(out.out)["stats"]["tokens"] >= 1


def test_a_drafter_with_another_tokenizer_is_refused_by_name(smollm2, tmp_path):
    """Same vocabulary size, other ids: refused before it proposes tokens it does not mean."""
    folder = tmp_path / "shuffled"
    shutil.copytree(smollm2.path, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    other = graft_tk.load_model(folder, dtype="fp32", num_layers=2, progress=False)
    assert other.config.vocab_size == smollm2.config.vocab_size
    with pytest.raises(InputError, match="tokenizer is not target .*'(hello|world)' is id .*2 tokens differ"):
        graft_tk.decode(smollm2, "Hi", drafter=other, method="tree", max_new_tokens=2)


def test_a_drafter_whose_vocabulary_is_a_prefix_of_the_targets_drafts_losslessly(smollm2):
    """A drafter with fewer embedding rows (its vocabulary a prefix of the target's) proposes only
    ids it has; the target verifies them as usual."""
    drafter = graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)
    keep = smollm2.config.vocab_size - 4096
    emb = drafter.net.tok_embeddings
    emb.weight = torch.nn.Parameter(emb.weight.data[:keep].clone(), requires_grad=False)
    emb.num_embeddings = keep
    assert drafter.net.output is None          # tied: the head is the cut embedding
    drafter = dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, vocab_size=keep))
    prompt = "Count from 1 to 20: 1, 2, 3,"
    want = graft_tk.decode(smollm2, prompt, max_new_tokens=24).tokens
    got = graft_tk.decode(smollm2, prompt, drafter=drafter, method="tree", max_new_tokens=24)
    assert got.tokens == want and got.stats["accepted_by_source"].get("draft", 0) > 0

    bigger = dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, vocab_size=smollm2.config.vocab_size + 1))
    with pytest.raises(InputError, match="a prefix of it"):
        graft_tk.decode(smollm2, prompt, drafter=bigger, method="tree", max_new_tokens=2)


def test_a_folders_weights_are_hashed_once_across_processes(folder, tmp_path, monkeypatch):
    """A checkpoint folder without a registry stamp is hashed once; the next process reads the
    fingerprint stored by (path, size, mtime), and a changed file is hashed again."""
    from graft_tk import profiles
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path / "home"))
    (folder / STAMP).unlink()
    model = graft_tk.load_model(folder, dtype="fp32", num_layers=2, progress=False)
    first = profiles.weights_fingerprint(model)
    assert (tmp_path / "home" / profiles.FINGERPRINTS_FILE).exists()
    monkeypatch.setattr(profiles, "_FINGERPRINTS", {})            # a new process
    hashed = []
    real = profiles.sha256_file
    monkeypatch.setattr(profiles, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert profiles.weights_fingerprint(model) == first and not hashed
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert profiles.weights_fingerprint(model) != first and hashed


def test_a_converted_file_damaged_after_conversion_is_named(smollm2, tmp_path, monkeypatch):
    """A converted folder keeps every file's sha256: graft-generate --verify-cache names a file
    changed since (same size, so the load-time size check passes), and a load that fails on a
    converted file says which one and to delete the folder."""
    from graft_tk.cli import generate
    from graft_tk.models.registry import verify_stamp, write_stamp
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path))
    folder = tmp_path / "models" / "smollm2-135m"
    shutil.copytree(smollm2.path, folder)
    write_stamp(folder, "source-sha")
    assert verify_stamp(folder) == [] and generate.main(["--model", "smollm2-135m", "--verify-cache"]) == 0
    weights = next(folder.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1000] ^= 0xFF                                   # one byte of a tensor, the size unchanged
    weights.write_bytes(bytes(data))
    assert stamp_ok(folder, "source-sha")                 # the cheap check at every load cannot see it
    assert [p for p in verify_stamp(folder) if weights.name in p and "sha256" in p]
    assert generate.main(["--model", "smollm2-135m", "--verify-cache"]) == 2
    weights.write_bytes(bytes(data[:len(data) // 2]))     # truncated: the load fails and says why
    with pytest.raises(CorruptFileError, match=f"converted by graft_tk and .*{weights.name}: .* bytes.*Delete"):
        graft_tk.load_model(folder, dtype="fp32", progress=False)
