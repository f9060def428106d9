"""graft-train-eagle3: the training-time test unrolls exactly what the head does when it drafts,
a few steps on the real SmolLM2 target lower the held-out loss, a resumed run is bit-identical to
an uninterrupted one, and the folder it writes is a head that decode, profiles and the CLIs use."""
import dataclasses
import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import graft_tk
from graft_tk.cli._models import load_drafter
from graft_tk.profiles import find_profile, profile_key, weights_fingerprint, write_profile
from graft_tk.cli import train_eagle3 as cli
from graft_tk.config import GraftConfig
from graft_tk.decode import decode, encode_prompt
from graft_tk.errors import CorruptFileError, InputError
from graft_tk.models.eagle3_checkpoint import load_eagle3
from graft_tk.models.attention import AttentionPlan
from graft_tk.training.corpus import Corpus, draft_vocab, file_documents, function_prompts, greedy_answers
from graft_tk.training.eagle3 import STATE_FILE, TrainConfig, init_head, target_batch, train, unroll


# Small and quick: ~2k tokens of standard-library source, one distilled answer, 64-token windows.
TINY = TrainConfig(steps=6, batch_size=2, seq_len=64, lr=3e-3, warmup=2, ttt_depth=3, draft_vocab=4096,
                   stdlib_tokens=2000, distill_prompts=1, distill_tokens=12, save_every=3)


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "run"
    result = train(smollm2, out, TINY, progress=False)
    return out, result


def test_unroll_is_what_the_head_computes_when_drafting(smollm2):
    """Step 0 of the unroll == the head over (features, next token) pairs; step j == a draft chain
    j deep that feeds each entry's own hidden state to its child (Eagle3Drafter's test-time use)."""
    head = init_head(smollm2, torch.zeros(2048, dtype=torch.long), seed=0).requires_grad_(False)
    text = "Complete this Python function.\n\ndef mean(xs):\n    \"\"\"The arithmetic mean of xs.\"\"\"\n"
    tokens = torch.tensor([encode_prompt(smollm2, text, True)[:40]])
    batch = target_batch(smollm2, head, tokens, torch.ones_like(tokens, dtype=torch.bool))
    with torch.no_grad():
        steps = unroll(head, batch.features, tokens, depth=3)
    T = tokens.shape[1]
    head.setup_cache(T + 4)
    with torch.no_grad():
        logits, hidden = head(tokens[:, 1:], torch.arange(T - 1), 0, features=batch.features[:, :-1])
        torch.testing.assert_close(logits[..., head.draft_ids], steps[0], atol=2e-4, rtol=0)
        for t in (0, 9, T - 5):          # a chain under entry t: token x_{t+1+j} at position t + j
            h, slots = hidden[:, t:t + 1], list(range(t + 1))
            for j in range(1, 3):
                slot = T - 1 + j - 1      # scratch slots after the committed entries
                mask = torch.zeros(1, 1, slot + 1, dtype=torch.bool)
                mask[0, 0, slots + list(range(T - 1, slot + 1))] = True
                plan = AttentionPlan.explicit(torch.tensor([[slot]]), torch.tensor([0]), mask, slot + 1)
                lg, h = head(tokens[:, t + 1 + j:t + 2 + j], torch.tensor([t + j]), plan, features=h)
                torch.testing.assert_close(lg[0, 0, head.draft_ids], steps[j][0, t], atol=2e-4, rtol=0)


def test_a_few_steps_lower_the_loss_and_write_a_loadable_head(smollm2, trained):
    out, result = trained
    log = json.loads((out / "training_log.json").read_text())
    evals = log["evals"]
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert evals[-1]["loss"] < evals[0]["loss"] - 1.0, evals
    assert result == evals[-1]
    assert len(log["log"]) == TINY.steps and all(r["loss"] > 0 for r in log["log"])
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
    head = load_eagle3(out, smollm2)
    assert head.config.draft_vocab_size == TINY.draft_vocab and head.name == "eagle3:run"
    # A trained head drafts losslessly (fp32: every method == ar).
    ids = encode_prompt(smollm2, "Write a Python function that adds two numbers.", chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=12)
    for method in ("tree", "graft"):
        got = graft_tk.decode(smollm2, ids, drafter=head, method=method, max_new_tokens=12, config=GraftConfig())
        assert got.tokens == ref.tokens, method


def test_resume_is_bit_identical_to_an_uninterrupted_run(smollm2, trained, tmp_path):
    out, _ = trained
    part = tmp_path / "part"
    train(smollm2, part, dataclasses.replace(TINY, steps=3), progress=False)
    assert torch.load(part / STATE_FILE, weights_only=True)["step"] == 3
    train(smollm2, part, TINY, progress=False)               # same settings, more steps: resumes at 3
    a, b = load_eagle3(out, smollm2), load_eagle3(part, smollm2)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert torch.equal(a.d2t, b.d2t)


def test_init_fine_tunes_a_trained_head(smollm2, trained, tmp_path):
    out, _ = trained
    small = dataclasses.replace(TINY, init=str(out), steps=1, stdlib_tokens=600, distill_prompts=0)
    with pytest.raises(InputError, match="draft vocabulary of 4096; pass --draft-vocab 4096"):
        train(smollm2, tmp_path / "bad", dataclasses.replace(small, draft_vocab=2048), progress=False)
    train(smollm2, tmp_path / "ft", small, progress=False)
    assert torch.equal(load_eagle3(out, smollm2).d2t, load_eagle3(tmp_path / "ft", smollm2).d2t)
    start = json.loads((tmp_path / "ft" / "training_log.json").read_text())["evals"][0]
    first = json.loads((out / "training_log.json").read_text())["evals"]
    assert start["loss"] < first[0]["loss"] - 1.0      # it starts from the trained weights, not from scratch


def test_bad_runs_are_clear_errors(smollm2, trained, tmp_path):
    out, _ = trained
    with pytest.raises(InputError, match="other settings.*lr"):
        train(smollm2, out, dataclasses.replace(TINY, lr=1e-4), progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a graft-train-eagle3 run"):
        train(smollm2, tmp_path / "junk", TINY, progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / STATE_FILE).write_bytes(b"truncated")
    with pytest.raises(CorruptFileError, match="cannot be read.*--restart"):
        train(smollm2, broken, TINY, progress=False)
    with pytest.raises(InputError, match="--ttt-depth must be >= 1"):
        TrainConfig(ttt_depth=0)
    assert cli.main(["--model", "smollm2-135m", "--out", str(out), "--lr", "0.5", "-q", "--dtype", "fp32"]) == 2


def test_profiles_and_cli_drafters_take_a_trained_head(smollm2, trained, tmp_path, monkeypatch):
    out, _ = trained
    monkeypatch.setenv("GRAFT_TK_PROFILE_DIR", str(tmp_path / "profiles"))
    head = load_drafter(f"eagle3:{out}", smollm2, "smollm2-135m")
    key = profile_key(smollm2, head)
    assert key.drafter == "eagle3:run" and key.drafter_weights == weights_fingerprint(head)
    tuned = GraftConfig(budget=12, tau=0.05)
    write_profile(key, "graft", tuned, {})
    ids = encode_prompt(smollm2, "Say hi.", chat=True)
    got = graft_tk.decode(smollm2, ids, drafter=head, method="graft", max_new_tokens=4)
    assert got.stats["config_source"].startswith("profile") and got.stats["config"]["budget"] == 12
    # Retraining changes the weights: the profile is stale, warned about, and not used.
    head.path = tmp_path / "copy"
    shutil.copytree(out, head.path)
    st = head.path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-4] + b"\x00\x00\x00\x01")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_profile(smollm2, head) is None
    assert any("stale" in str(w.message) for w in caught)


def test_corpus_windows_batches_and_draft_vocabulary(smollm2, tmp_path):
    corpus = Corpus.from_documents([list(range(10, 30)), [5, 6], [7, 8, 9]], seq_len=8)
    assert corpus.lengths.tolist() == [8, 8, 4, 3]            # [5, 6] is too short for a training entry
    a, valid = corpus.batch(step=3, batch_size=3, seed=1)
    b, _ = corpus.batch(step=3, batch_size=3, seed=1)
    assert torch.equal(a, b) and a.shape[1] == int(valid.sum(1).max())
    seen = torch.cat([corpus.batch(s, 2, seed=1)[0][:, 0] for s in range(2)])
    assert sorted(seen.tolist()) == sorted(corpus.tokens[:, 0].tolist())   # an epoch visits every window once
    repeated = Corpus.from_documents(3 * [list(range(10, 30))] + [[1, 2, 3]], seq_len=8)   # 3 x 3 windows + 1
    train_set, heldout = repeated.split(2, seed=0)
    every, trained, held = ({tuple(w[:n]) for w, n in zip(c.tokens.tolist(), c.lengths.tolist())}
                            for c in (repeated, train_set, heldout))
    assert not trained & held and trained | held == every   # no copy of a held-out window is trained on
    counts = torch.tensor([5, 0, 7, 7, 1])
    d2t = draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 3]    # most frequent; the 7-7 tie kept in id order
    with pytest.raises(InputError, match="--draft-vocab"):
        draft_vocab(counts, 6)
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"text": "x = 1"}\n{"prompt": "Hi", "response": "Hello"}\n')
    docs = file_documents([rows], smollm2)
    assert docs[0] == smollm2.tokenizer.encode("x = 1", add_special_tokens=False) and len(docs) == 2
    rows.write_text('{"question": "?"}\n')
    with pytest.raises(InputError, match="d.jsonl:1.*'text'"):
        file_documents([rows], smollm2)
    prompts = function_prompts(5, seed=0)
    assert len(prompts) == 5 and all("\ndef " in p for p in prompts)
    assert prompts == function_prompts(5, seed=0)


def test_batched_distillation_is_plain_greedy_decoding(smollm2):
    """Rows of different lengths share a batch, left-padded and each masked to its own tokens:
    every answer is the tokens decode(method="ar") gives; a row ends at its end-of-sequence token."""
    prompts = [encode_prompt(smollm2, t, chat=True) for t in function_prompts(3, seed=1)]
    prompts.append(prompts[0][:9])  # much shorter than the rest: mostly padding in its batch
    answers = greedy_answers(smollm2, prompts, 12, batch_size=3, progress=False)
    for ids, answer in zip(prompts, answers):
        assert answer == decode(smollm2, ids, method="ar", max_new_tokens=12).tokens

    stop = answers[0][4]  # make the fifth token of the first answer an end-of-sequence token
    config = dataclasses.replace(smollm2.config, eos_token_ids=(stop,))
    stopped = greedy_answers(dataclasses.replace(smollm2, config=config), prompts, 12, batch_size=3, progress=False)
    assert stopped == [a[:a.index(stop) + 1] if stop in a else a for a in answers] and len(stopped[0]) <= 5


def test_generate_cli_drafts_with_the_trained_head(trained):
    out, _ = trained

    def generate(*extra):
        r = subprocess.run([sys.executable, "-m", "graft_tk.cli.generate", "--model", "smollm2-135m", "--dtype", "fp32",
                            "--prompt", "Write a Python function that adds two numbers.", "--max-new-tokens", "10",
                            "--json", *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    ar, graft = generate(), generate("--eagle3", str(out), "--method", "graft")
    assert graft["tokens"] == ar["tokens"]
    assert graft["stats"]["nodes_by_source"].get("draft", 0) > 0
