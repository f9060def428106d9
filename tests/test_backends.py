"""The Triton backend end to end: the same tokens as the torch backend for every method, alone and
in a batch, greedy and sampled; and what a step costs, counted per step, the same at B = 1 and
B = 4. The models live on DEVICE (CUDA: compiled kernels vs the torch references on the GPU; CPU:
Triton's interpreter); decode runs on the model's device."""
import pytest
import torch

import graft_tk
from graft_tk.batch import decode_batch
from graft_tk.config import GraftConfig
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.models import Model
from graft_tk.models.transformer import ModelConfig, Transformer
from graft_tk.sampling import Sampling

from .kernel_utils import DEVICE
from .test_engine import SPECULATIVE, _TinyTokenizer

CONFIG = GraftConfig(budget=12, top_k=3, max_depth=4, tau=0.05, retrieval_k=4, template=(4, 6, 4), pld_tokens=5)


def _model(seed: int, n_layers: int, vocab: int = 300) -> Model:
    """A small random llama with the kernels' real shapes (head dim 64, GQA 4:2, vocab not a power of two),
    drawn on CPU (the same weights on every machine), then moved to DEVICE."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, dim=256, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=64, intermediate_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=False)
    net = Transformer(cfg)
    for p in net.parameters():
        p.data.normal_(0, 0.15)
    net.to(DEVICE)
    return Model(f"small{seed}", None, cfg, _TinyTokenizer(), net.eval().requires_grad_(False))


@pytest.fixture(scope="module")
def pair():
    target = _model(1, 2)
    drafter = _model(1, 1)           # the target's first layer: agrees often enough to accept drafts
    drafter.net.load_state_dict(target.net.state_dict(), strict=False)
    return target, drafter


PROMPT = [5, 17, 3, 99, 5, 17, 3, 42, 7, 5, 17]   # repeats, so prompt lookup has something to find
PROMPTS = [PROMPT, [8, 8, 9], PROMPT[3:] + [11] * 9, [200, 1, 2, 3, 200, 1]]   # ragged: 11, 3, 17, 6 tokens


# tree+pld, retrieval+pld and graft-paper run the same ops as tree, retrieval and graft (the Triton interpreter is slow: each method costs a minute here)
@pytest.mark.parametrize("method", ["ar"] + [m for m in SPECULATIVE
                                             if m not in ("tree+pld", "retrieval+pld", "graft-paper")])
def test_triton_backend_gives_the_torch_backend_tokens(pair, method):
    target, drafter = pair
    kw = dict(drafter=drafter, method=method, max_new_tokens=16, config=CONFIG)
    ref = graft_tk.decode(target, PROMPT, backend="torch", **kw)
    got = graft_tk.decode(target, PROMPT, backend="triton", **kw)
    assert got.tokens == ref.tokens
    if method != "ar":
        s = got.stats
        assert s["backend"] == "triton" and s["mat"] == ref.stats["mat"]
        assert s["kernel_launches_per_step"] > 0
        assert ref.stats["kernel_launches_per_step"] is None      # torch backend launches no kernels


def test_a_batch_on_the_triton_backend_gives_the_torch_backends_tokens(pair):
    """Four ragged rows in every step: the batched tree attention (each row over its own prefix),
    build_tree, accept and the KV moves, kernels against references; greedy and seeded sampling."""
    target, drafter = pair
    for sampling in (Sampling(), Sampling(0.9, 0.95, 3)):
        got = {backend: [t for t, _ in decode_batch(Engine(target, drafter, CONFIG, backend=backend).batch(4),
                                                    PROMPTS, "graft", 10, sampling)]
               for backend in ("torch", "triton")}
        assert got["triton"] == got["torch"]
        want = [graft_tk.decode(target, p, max_new_tokens=10, temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=None if sampling.seed is None else sampling.seed + i).tokens
                for i, p in enumerate(PROMPTS)]
        assert got["torch"] == want


def step_counters(target, drafter, method: str, rows: int, steps: int = 3):
    """The counters of ``steps`` steps of ``rows`` requests decoding together on the Triton
    backend, torch ops counted, after the first step: there a drafter reads each row's prompt
    window, once per request (one prefill per row, as admitting it does for the target)."""
    engine = Engine(target, drafter, CONFIG, backend="triton", count_torch_ops=True)
    batch = engine.batch(rows)
    with torch.inference_mode():
        for ids in PROMPTS[:rows]:
            batch.add(ids, method, 32)
        batch.step()
        records = []
        for _ in range(steps):
            batch.step()
            records.append(batch.last_step)
    assert all(r.size == rows for r in records)
    return [r.counters for r in records]


@pytest.mark.parametrize("method", ["ar", "retrieval+pld", "tree"])
def test_a_steps_launches_host_reads_and_torch_ops_do_not_grow_with_the_batch(pair, method):
    """B = 4 costs what B = 1 costs in launches (each op is one launch for every row), host reads
    (one per step; ``tree`` never prunes, so no read per depth) and torch ops dispatched."""
    target, drafter = pair
    one, four = (step_counters(target, drafter, method, rows) for rows in (1, 4))
    for a, b in zip(one, four):
        assert a.launches == b.launches and a.host_reads == b.host_reads == 1
        assert a.torch_ops == b.torch_ops > 0
    if method != "ar":
        assert {"_build_tree_kernel", "_walk_kernel", "_commit_kv_kernel"} <= set(one[0].launches)


def test_host_reads_of_a_pruning_batch_are_one_per_depth(pair):
    """graft prunes: one read per drafter depth for the whole batch, plus the step's read."""
    target, drafter = pair
    for counters in step_counters(target, drafter, "graft", 4):
        depths = counters.launches["_draft_expand_kernel"]
        assert counters.host_reads <= 1 + depths


def test_backend_errors(pair):
    target, drafter = pair
    with pytest.raises(InputError, match="unknown backend 'cuda'"):
        graft_tk.decode(target, PROMPT, backend="cuda")
    engine = Engine(target, drafter, CONFIG, backend="torch")
    with pytest.raises(InputError, match="engine runs the torch backend"):
        graft_tk.decode(target, PROMPT, method="graft", engine=engine, backend="triton")
