"""The Triton backend end to end: the same tokens as the torch backend for every method, greedy and
sampled, and the launch budget per step. The models live on DEVICE (CUDA: compiled kernels vs the
torch references on the GPU; CPU: Triton's interpreter); decode runs on the model's device."""
import pytest
import torch

import graft_tk
from graft_tk.config import GraftConfig
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.models import Model
from graft_tk.models.transformer import ModelConfig, Transformer

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


# tree+pld and retrieval+pld run the same ops as tree, retrieval and graft+pld (the Triton
# interpreter is slow: each method costs minutes here)
@pytest.mark.parametrize("method", ["ar"] + [m for m in SPECULATIVE if m not in ("tree+pld", "retrieval+pld")])
def test_triton_backend_gives_the_torch_backend_tokens(pair, method):
    target, drafter = pair
    kw = dict(drafter=drafter, method=method, max_new_tokens=16, config=CONFIG)
    ref = graft_tk.decode(target, PROMPT, backend="torch", **kw)
    got = graft_tk.decode(target, PROMPT, backend="triton", **kw)
    assert got.tokens == ref.tokens
    if method != "ar":
        s = got.stats
        assert s["backend"] == "triton" and s["mat"] == ref.stats["mat"]
        # the launch goal per step outside the model forwards: drafter depths + 6
        assert s["kernel_launches_per_step"] > 0 and s["kernel_launches_max_minus_depth"] <= 6, s
        assert ref.stats["kernel_launches_per_step"] is None      # torch backend launches no kernels


def test_triton_backend_sampling_matches_torch_with_the_same_seed(pair):
    target, drafter = pair
    kw = dict(drafter=drafter, method="graft", max_new_tokens=12, config=CONFIG, temperature=0.9, top_p=0.95,
              seed=7)
    ref = graft_tk.decode(target, PROMPT, backend="torch", **kw)
    got = graft_tk.decode(target, PROMPT, backend="triton", **kw)
    assert got.tokens == ref.tokens


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_shapes_give_the_same_tokens_on_both_backends(pair, temperature):
    """Trees verified at the full budget (padding rows the kernels must skip, M writes included):
    the Triton backend still gives the torch backend's tokens, greedy and sampled."""
    target, drafter = pair
    kw = dict(drafter=drafter, method="graft+pld", max_new_tokens=12, config=CONFIG, temperature=temperature,
              top_p=0.95, seed=3)
    got = {}
    for backend in ("torch", "triton"):
        engine = Engine(target, drafter, CONFIG, backend=backend, static_shapes=True)
        got[backend] = graft_tk.decode(target, PROMPT, engine=engine, **kw).tokens
    assert got["triton"] == got["torch"]
    if temperature == 0.0:
        assert got["torch"] == graft_tk.decode(target, PROMPT, max_new_tokens=12).tokens


def test_backend_errors(pair):
    target, drafter = pair
    with pytest.raises(InputError, match="unknown backend 'cuda'"):
        graft_tk.decode(target, PROMPT, backend="cuda")
    engine = Engine(target, drafter, CONFIG, backend="torch")
    with pytest.raises(InputError, match="engine runs the torch backend"):
        graft_tk.decode(target, PROMPT, method="graft", engine=engine, backend="triton")
