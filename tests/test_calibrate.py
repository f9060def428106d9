"""graft-calibrate: a real (tiny) Optuna run on SmolLM2, profiles that decode picks up, bad input."""
import json
import warnings

import numpy as np
import optuna
import pytest

import graft_tk
from graft_tk.profiles import (ProfileWarning, find_profile, profile_key, read_profile,
                                           write_profile)
from graft_tk.calibration.warm_start import isotonic_increasing, suggest_tau
from graft_tk.cli import calibrate as cli
from graft_tk.config import GraftConfig
from graft_tk.errors import CorruptFileError
from graft_tk.bench.prompts import Prompt
from graft_tk.tree import DRAFT, RETRIEVAL

PROMPTS = ["Write a Python function that returns the square of a number.",
           "List three colours of the rainbow.",
           "What is the capital of France? Answer in one word."]


@pytest.fixture
def calib_env(tmp_path, monkeypatch):
    """Profiles and the study database in a temp folder; a 3-prompt file (2 tuning + 1 held out)."""
    monkeypatch.setenv("GRAFT_TK_PROFILE_DIR", str(tmp_path / "profiles"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"dir": tmp_path, "prompts": str(prompts), "storage": f"sqlite:///{tmp_path / 'studies.db'}"}


def _args(env, trials, validate=0):
    return ["--model", "smollm2-135m", "--drafter", "self:10", "--dtype", "fp32", "--prompts", env["prompts"],
            "--n-prompts", "2", "--validate", str(validate), "--max-new-tokens", "8", "--trials", str(trials),
            "--storage", env["storage"], "--study-name", "t"]


@pytest.fixture
def drafter10(smollm2):
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.mark.slow
def test_calibrate_writes_profile_resumes_and_decode_uses_it(calib_env, smollm2, drafter10, capsys):
    assert cli.main(_args(calib_env, trials=2)) == 0
    out = capsys.readouterr().out
    assert "best" in out and "default" in out
    profiles = list((calib_env["dir"] / "profiles").glob("*.json"))
    assert len(profiles) == 1
    profile = read_profile(profiles[0])
    assert profile.key == profile_key(smollm2, drafter10)
    assert profile.measured["tokens_per_s"] > 0 and profile.measured["trials"] == 2
    assert profiles[0].with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the first trial is the default config, the second the warm-start tau
    study = optuna.load_study(study_name="t", storage=calib_env["storage"])
    assert [t.user_attrs.get("origin") for t in study.trials[:2]] == ["default", "warm-start"]
    assert study.trials[0].user_attrs["config"] == json.loads(json.dumps(GraftConfig().__dict__))

    # a second run resumes the same study (and validates on the held-out prompt)
    assert cli.main(_args(calib_env, trials=1, validate=1)) == 0
    study = optuna.load_study(study_name="t", storage=calib_env["storage"])
    assert len(study.trials) == 3
    profile = read_profile(profiles[0])
    assert profile.measured["validation"]["prompts"] == ["3"]

    # decode picks the profile up when no config is passed; an explicit config overrides it
    r = graft_tk.decode(smollm2, PROMPTS[0], drafter=drafter10, method="graft", max_new_tokens=4)
    assert r.stats["config_source"] == f"profile {profiles[0]}"
    assert r.stats["config"]["tau"] == profile.config.tau and r.stats["config"]["budget"] == profile.config.budget
    r = graft_tk.decode(smollm2, PROMPTS[0], drafter=drafter10, method="graft", max_new_tokens=4,
                        config=GraftConfig())
    assert r.stats["config_source"] == "explicit"

    # the same study with other settings would mix incomparable trials: refused
    args = _args(calib_env, trials=1)
    args[args.index("--max-new-tokens") + 1] = "9"
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "max_new_tokens: 8 -> 9" in err


def test_corrupt_and_stale_profiles_are_reported_and_ignored(calib_env, smollm2, drafter10, capsys):
    key = profile_key(smollm2, drafter10)
    path = write_profile(key, "graft", GraftConfig(tau=0.5), {"tokens_per_s": 1.0})
    assert find_profile(smollm2, drafter10).config.tau == 0.5

    path.write_text(path.read_text()[:40])          # truncated: corrupt
    with pytest.warns(ProfileWarning, match="unreadable"):
        r = graft_tk.decode(smollm2, PROMPTS[0], drafter=drafter10, method="graft", max_new_tokens=2)
    assert r.stats["config_source"] == "default"
    with pytest.raises(CorruptFileError, match="rerun graft-calibrate"):
        read_profile(path)
    assert cli.main(["--show", "--storage", calib_env["storage"]]) == 0
    assert "UNUSABLE" in capsys.readouterr().out

    doc = {"format": "graft_tk.profile/4", "key": {**key.__dict__, "graft_tk": "0.0.1"}, "method": "graft",
           "config": GraftConfig().__dict__, "measured": {}}
    path.write_text(json.dumps(doc, default=list))   # another graft_tk version: stale
    with pytest.warns(ProfileWarning, match="stale.*graft_tk '0.0.1'"):
        assert find_profile(smollm2, drafter10) is None

    doc["key"]["graft_tk"] = key.graft_tk
    doc["config"]["tau"] = 7.0                       # out of range: invalid contents
    path.write_text(json.dumps(doc, default=list))
    with pytest.warns(ProfileWarning, match="invalid contents.*tau"):
        assert find_profile(smollm2, drafter10) is None

    old = {**doc, "format": "graft_tk.profile/1"}     # graft_tk 0.1's 'graft' meant graft+pld: never reused
    path.write_text(json.dumps(old, default=list))
    with pytest.warns(ProfileWarning, match="graft_tk 0.1.*graft\\+pld"):
        assert find_profile(smollm2, drafter10) is None


def test_unreachable_storage_is_a_clear_error(calib_env, smollm2, capsys):
    args = _args(calib_env, trials=1)
    args[args.index("--storage") + 1] = "sqlite:////nonexistent-dir/sub/studies.db"
    assert cli.main(args) == 2
    assert "cannot open Optuna storage 'sqlite:////nonexistent-dir/sub/studies.db'" in capsys.readouterr().err


def test_qwen3_without_a_local_copy_fails_at_once_with_the_list(calib_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))   # whatever this machine caches
    assert cli.main(["--model", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert "'qwen3' means Qwen/Qwen3-8B, which is not in the local Hugging Face cache" in err
    assert "smollm2-135m" in err and "qwen2.5-coder-1.5b" in err


def test_isotonic_fit_is_monotone_and_least_squares():
    x = np.array([3.0, 1.0, 2.0, 4.0, 5.0, 2.0])
    y = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    xs, fit = isotonic_increasing(x, y)
    assert list(xs) == sorted(x) and np.all(np.diff(fit) >= 0)
    # x=1 (y=1) and x=2 (y=0, 1) and x=3 (y=0) pool into one block of mean 0.5; x=4, 5 stay 1
    np.testing.assert_allclose(fit, [0.5, 0.5, 0.5, 0.5, 1.0, 1.0])


def test_suggest_tau_meets_the_retrieval_acceptance_rate():
    # drafted nodes: accepted iff score >= log(0.3); retrieved nodes accepted 40% of the time
    scores = np.log(np.linspace(0.01, 0.99, 50))
    log = [(DRAFT, 1, float(s), bool(s >= np.log(0.3))) for s in scores]
    log += [(RETRIEVAL, 1, float("-inf"), i < 4) for i in range(10)]
    warm = suggest_tau(log)
    assert abs(warm.tau - 0.3) < 0.03 and warm.retrieval_acceptance == 0.4
    assert warm.drafted_nodes == 50 and warm.retrieved_nodes == 10
    # too little data: the default tau comes back unchanged
    assert suggest_tau(log[:5], default_tau=0.1).tau == 0.1


def test_split_prompts_round_robins_categories():
    ps = [Prompt(f"{c}{i}", c, "x") for c in "ab" for i in range(3)]
    tune, held = cli.split_prompts(ps, 3, 2)
    assert [p.id for p in tune] == ["a0", "b0", "a1"] and [p.id for p in held] == ["b1", "a2"]
    with pytest.raises(graft_tk.GraftError, match="need 5 tuning"):
        cli.split_prompts(ps, 5, 2)


def test_profile_lookup_is_silent_without_profiles(calib_env, smollm2, drafter10):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = graft_tk.decode(smollm2, PROMPTS[0], drafter=drafter10, method="graft", max_new_tokens=2)
    assert r.stats["config_source"] == "default" and r.stats["config"]["tau"] == GraftConfig().tau


def test_pareto_front_keeps_only_undominated_trials():
    from graft_tk.calibration.search import pareto_front

    class Trial:  # the two fields pareto_front reads from an optuna FrozenTrial
        def __init__(self, speed, mat):
            self.values, self.user_attrs = [speed], {"mat": mat}

    trials = [Trial(10, 3), Trial(8, 5), Trial(9, 2), Trial(12, 1), Trial(8, 5)]
    front = pareto_front(trials)   # (9, 2) is beaten by (10, 3); ties on both objectives both stay
    assert [(t.values[0], t.user_attrs["mat"]) for t in front] == [(10, 3), (8, 5), (12, 1), (8, 5)]


@pytest.mark.slow
def test_calibrate_for_a_batch_size_writes_that_sizes_profile(calib_env, smollm2, drafter10, capsys):
    """--batch 2: tau, N and D searched on the prompts decoded two at a time; a profile of its own
    (file name ...__batch2.json) that batch_policy hands to graft-serve."""
    from graft_tk.profiles import batch_policy
    assert cli.main(_args(calib_env, trials=2) + ["--batch", "2"]) == 0
    profiles = list((calib_env["dir"] / "profiles").glob("*.json"))
    assert [p.name.endswith("__batch2.json") for p in profiles] == [True]
    profile = read_profile(profiles[0])
    assert profile.key == profile_key(smollm2, drafter10, batch=2) and profile.measured["batch"] == 2
    assert profile.measured["tokens_per_s"] > 0
    study = optuna.load_study(study_name="t", storage=calib_env["storage"])
    assert set(study.trials[1].params) == {"tau", "budget", "max_depth"}        # the first is the default, enqueued
    assert find_profile(smollm2, drafter10) is None                 # batch size 1 has none
    assert batch_policy(smollm2, drafter10, 4) == {2: profile.config}
