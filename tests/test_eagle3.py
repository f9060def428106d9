"""EAGLE-3 heads: target features, the published layer formula, checkpoints (EAGLE / SpecForge /
speculators layouts) and clear errors, tree-masked steps against causal runs, the vocabulary map."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from graft_tk.errors import GraftError, InputError
from graft_tk.models import Model
from graft_tk.models.attention import AttentionPlan
from graft_tk.models.checkpoint import load_transformer, read_config
from graft_tk.models.eagle3 import Eagle3Config, Eagle3Head, default_target_layers
from graft_tk.models.eagle3_checkpoint import Eagle3CheckpointError, load_eagle3, save_eagle3
from graft_tk.ops import ops_for
from graft_tk.reference.draft_expand import draft_expand

from .kernel_utils import DEVICE, on_device
from .tolerances import LOGITS_FP32_ATOL

VOCAB, DRAFT_VOCAB, DIM, LAYERS = 97, 40, 64, 8


def _hf_target(tmp_path, vocab=VOCAB, dim=DIM, n_layers=LAYERS):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=96, num_hidden_layers=n_layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path / f"target-{vocab}-{dim}-{n_layers}"
    hf.save_pretrained(path)
    net = load_transformer(path, read_config(path), torch.float32, torch.device("cpu"))
    return hf, Model("tiny", path, net.config, None, net)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _hf_target(tmp_path_factory.mktemp("eagle3"))


def _random_head(target_model, seed=1, own_embedding=False, hidden=None, **kw) -> Eagle3Head:
    """Every weight random (norms around 1), and a random sorted draft vocabulary of DRAFT_VOCAB ids."""
    g = torch.Generator().manual_seed(seed)
    tc = target_model.config
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=DRAFT_VOCAB, **kw)
    if hidden is not None:   # a head narrower than its target (then it ships its own embedding)
        layer = cfg.layer.__class__(**{**cfg.layer.__dict__, "dim": hidden, "head_dim": hidden // cfg.layer.n_heads})
        cfg = Eagle3Config(layer, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.target_layers,
                           cfg.norm_before_residual)
    head = Eagle3Head(cfg, None if own_embedding else target_model.net.tok_embeddings.weight)
    for p in head.parameters():
        noise = torch.randn(p.shape, generator=g)
        p.data = 1 + 0.1 * noise if p.dim() == 1 else 0.2 * noise
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    head.set_vocab_map(ids - torch.arange(DRAFT_VOCAB))
    return head.eval().requires_grad_(False)


def _run(head, tokens, features, start=0, **kw):
    head.setup_cache(64)
    return head(tokens, torch.arange(start, start + tokens.shape[1]), start, features=features, **kw)


def _prompt(n=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


# ----------------------------------------------------------------------------- target features
def test_hidden_layers_are_the_residual_stream_hf_reports(target):
    hf, model = target
    tokens = _prompt()
    model.net.setup_cache(64)
    plain = model.net(tokens, torch.arange(tokens.shape[1]), 0)
    logits, hidden = model.net(tokens, torch.arange(tokens.shape[1]), 0, hidden_layers=(5, 1, 3))
    assert torch.equal(logits, plain)
    want = hf(tokens, output_hidden_states=True).hidden_states     # [0] embeddings, [i + 1] output of layer i
    assert hidden.shape == (1, tokens.shape[1], 3 * DIM)
    assert (hidden - torch.cat([want[6], want[2], want[4]], dim=-1)).abs().max() <= LOGITS_FP32_ATOL
    last_logits, last_hidden = model.net(tokens, torch.arange(tokens.shape[1]), 0, hidden_layers=(5, 1, 3),
                                         logits_at=-1)
    assert torch.equal(last_hidden, hidden)              # features of every token; logits of the last only
    # (logits: a 1-row matmul rounds differently)
    assert (last_logits - logits[:, -1:]).abs().max() <= LOGITS_FP32_ATOL
    for bad in ((), (LAYERS,), (-1, 2)):
        with pytest.raises(InputError, match="hidden_layers"):
            model.net(tokens, torch.arange(tokens.shape[1]), 0, hidden_layers=bad)


def test_default_target_layers_are_eagle3s():
    # EAGLE captures the INPUTS of layers 2, L//2, L-3: the outputs of 1, L//2-1, L-4 (SpecForge's ids).
    assert default_target_layers(32) == (1, 15, 28) and default_target_layers(LAYERS) == (1, 3, 4)
    with pytest.raises(InputError, match="too shallow"):
        default_target_layers(3)


# ----------------------------------------------------------------------------- the layer formula
def _reference(t: dict, emb_w, tokens, features, cfg: Eagle3Config, norm_before_residual: bool):
    """The published EAGLE-3 step written out from the checkpoint's own tensors (causal, positions 0..T-1)."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer.rms_norm_eps))

    lc, p = cfg.layer, "midlayer."
    T = tokens.shape[1]
    h = features @ t["fc.weight"].T
    normed = rms(h, t[p + "hidden_norm.weight"])
    x = torch.cat([rms(emb_w[tokens], t[p + "input_layernorm.weight"]), normed], dim=-1)
    q, k, v = (x @ t[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    q, k, v = (y.view(1, T, -1, lc.head_dim).transpose(1, 2) for y in (q, k, v))
    inv = 1.0 / (lc.rope_theta ** (torch.arange(0, lc.head_dim, 2).float() / lc.head_dim))
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = lc.head_dim // 2
    q, k = ((y * cos + torch.cat([-y[..., half:], y[..., :half]], -1) * sin) for y in (q, k))
    rep = lc.n_heads // lc.n_kv_heads
    att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    att = att.transpose(1, 2).reshape(1, T, -1) @ t[p + "self_attn.o_proj.weight"].T
    h = (normed if norm_before_residual else h) + att
    m = rms(h, t[p + "post_attention_layernorm.weight"])
    gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
    h = h + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, h


@pytest.mark.parametrize("norm_before_residual", [False, True], ids=["eagle", "speculators-residual"])
def test_head_computes_the_published_formula(target, tmp_path, norm_before_residual):
    _, model = target
    head = _random_head(model, norm_before_residual=norm_before_residual)
    save_eagle3(head, tmp_path / "head")
    t = load_file(tmp_path / "head" / "model.safetensors")
    assert "embed_tokens.weight" not in t           # shared with the target: not written (as SpecForge)
    tokens, features = _prompt(), torch.randn(1, 12, 3 * DIM)
    logits, hidden = _run(head, tokens, features)
    draft_logits, want_hidden = _reference(t, model.net.tok_embeddings.weight, tokens, features, head.config,
                                           norm_before_residual)
    assert (hidden - want_hidden).abs().max() <= LOGITS_FP32_ATOL
    assert (logits[..., head.draft_ids] - draft_logits).abs().max() <= LOGITS_FP32_ATOL


# ----------------------------------------------------------------------------- vocabulary map
def test_logits_cover_the_target_vocab_through_d2t(target):
    _, model = target
    head = _random_head(model)
    features = torch.randn(1, 12, 3 * DIM)
    logits, hidden = _run(head, _prompt(), features)
    assert logits.shape == (1, 12, VOCAB)
    assert torch.isneginf(logits[..., ~head.t2d]).all() and torch.isfinite(logits[..., head.t2d]).all()
    draft = F.linear(head.norm(hidden), head.lm_head.weight)            # [1, 12, DRAFT_VOCAB]
    assert torch.equal(logits[..., head.draft_ids], draft)
    best = draft.argmax(-1)
    assert torch.equal(logits.argmax(-1), best + head.d2t[best])        # target id = draft id + d2t
    assert int(head.t2d.sum()) == DRAFT_VOCAB and torch.equal(head.t2d.nonzero()[:, 0], head.draft_ids)
    # A drafter ranks the draft-vocabulary logits and maps only the K winners: the same children
    # and scores as ranking the target-wide row (-inf outside the draft vocabulary).
    small, _ = _run(head, _prompt(), features, draft_vocab=True)
    assert small.shape == (1, 12, DRAFT_VOCAB) and torch.equal(small, draft)
    frontier, tau = -torch.rand(1, 12, generator=torch.Generator().manual_seed(1)), torch.tensor([-3.0])
    wide = draft_expand(frontier, logits, 4, tau)
    narrow = draft_expand(frontier, small, 4, tau)
    assert torch.equal(wide[0], head.draft_ids[narrow[0]]) and torch.allclose(wide[2], narrow[2])
    assert all(torch.equal(a, b) for a, b in zip(wide[3:], narrow[3:])) and torch.equal(wide[1], narrow[1])
    with pytest.raises(InputError, match="same target id"):
        head.set_vocab_map(torch.zeros(DRAFT_VOCAB, dtype=torch.long).index_fill_(0, torch.tensor([1]), -1))
    with pytest.raises(InputError, match="outside the target vocabulary"):
        head.set_vocab_map(torch.full((DRAFT_VOCAB,), VOCAB))


# ----------------------------------------------------------------------------- checkpoints
def _to_bin(path):
    """EAGLE's own release layout: the same tensors in pytorch_model.bin."""
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def _to_bin_with_embedding(path, embedding):
    """EAGLE's releases also carry the frozen copy of the target's embedding."""
    _to_bin(path)
    torch.save({**torch.load(path / "pytorch_model.bin"), "embed_tokens.weight": embedding.clone()},
               path / "pytorch_model.bin")


def _to_speculators(path):
    """vLLM speculators layout: nested layer config, layers.0.*, vLLM's layer ids (0 = embeddings)."""
    cfg = json.loads((path / "config.json").read_text())
    ids = cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    layer = {k: cfg.pop(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size")}
    out = {**cfg, "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": {"model_type": "llama", **layer},
           "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]}
    (path / "config.json").write_text(json.dumps(out))
    t = load_file(path / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in t.items()}, path / "model.safetensors")


@pytest.mark.parametrize("layout", ["safetensors", "own-embedding", "pytorch_model.bin", "bin+target-embedding",
                                    "speculators"])
def test_save_load_round_trip(target, tmp_path, layout):
    _, model = target
    head = _random_head(model, own_embedding=layout == "own-embedding", target_layers=(2, 6, 0),
                        hidden=48 if layout == "own-embedding" else None)
    path = tmp_path / "head"
    save_eagle3(head, path)
    if layout == "bin+target-embedding":
        _to_bin_with_embedding(path, model.net.tok_embeddings.weight)
    {"pytorch_model.bin": _to_bin, "speculators": _to_speculators}.get(layout, lambda p: None)(path)
    loaded = load_eagle3(path, model)
    assert loaded.config == head.config and loaded.target_layers == (2, 6, 0)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    if layout != "own-embedding":   # the target's table itself, not a copy (also when a copy was shipped)
        assert loaded.embedding_weight.data_ptr() == model.net.tok_embeddings.weight.data_ptr()
    tokens, features = _prompt(), torch.randn(1, 12, 3 * DIM)
    for a, b in zip(_run(head, tokens, features), _run(loaded, tokens, features)):
        assert torch.equal(a, b)


def test_target_features_drive_the_loaded_head(target, tmp_path):
    """The pipeline the drafter will run: target features at the head's default layers -> head."""
    _, model = target
    save_eagle3(_random_head(model), tmp_path / "head")
    head = load_eagle3(tmp_path / "head", model, dtype=torch.bfloat16)
    assert head.target_layers == default_target_layers(LAYERS) and head.lm_head.weight.dtype == torch.bfloat16
    tokens = _prompt(13)
    model.net.setup_cache(64)
    _, features = model.net(tokens[:, :-1], torch.arange(12), 0, hidden_layers=head.target_layers)
    logits, hidden = _run(head, tokens[:, 1:], features)   # entry t: (features of x_t, token x_t+1)
    assert logits.shape == (1, 12, VOCAB) and hidden.dtype == torch.bfloat16
    assert torch.isfinite(logits[..., head.t2d]).all()


def _config_edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _tensors_edit(path, drop=(), **add):
    t = load_file(path / "model.safetensors")
    for k in drop:
        del t[k]
    save_file({**t, **add}, path / "model.safetensors")


@pytest.fixture
def saved(target, tmp_path):
    _, model = target
    save_eagle3(_random_head(model), tmp_path / "head")
    return tmp_path / "head"


def test_checkpoint_for_another_target_is_a_clear_error(saved, tmp_path):
    _, wider = _hf_target(tmp_path, dim=96)
    with pytest.raises(Eagle3CheckpointError, match="hidden size mismatch.*hidden size 64, the target's is 96"):
        load_eagle3(saved, wider)
    _config_edit(saved, target_hidden_size=None)          # EAGLE's own configs omit it: = hidden_size
    with pytest.raises(Eagle3CheckpointError, match="hidden size mismatch.*hidden size 64, the target's is 96"):
        load_eagle3(saved, wider)
    _config_edit(saved, target_hidden_size=96)            # a config that lies: fc's shape still tells
    with pytest.raises(Eagle3CheckpointError, match=r"hidden size mismatch: fc.weight is \[64, 192\], the head "
                                                    r"needs \[64, 288\] \(3 target layers x hidden 96\)"):
        load_eagle3(saved, wider)
    _config_edit(saved, target_hidden_size=64)
    _, other_vocab = _hf_target(tmp_path, vocab=101)
    with pytest.raises(Eagle3CheckpointError, match="vocabulary mismatch.*vocab_size=97, the target has 101"):
        load_eagle3(saved, other_vocab)
    _, shallow = _hf_target(tmp_path, n_layers=4)
    with pytest.raises(Eagle3CheckpointError, match=r"target layers \(1, 3, 4\).*has 4 layers"):
        load_eagle3(saved, shallow)
    assert issubclass(Eagle3CheckpointError, GraftError)


def test_missing_or_wrong_tensors_are_named(target, saved):
    _, model = target
    _tensors_edit(saved, drop=["midlayer.mlp.down_proj.weight"])
    with pytest.raises(Eagle3CheckpointError, match=r"missing tensors \['midlayer.mlp.down_proj.weight'\]"):
        load_eagle3(saved, model)
    _tensors_edit(saved, **{"midlayer.mlp.down_proj.weight": torch.zeros(DIM, 7)})
    with pytest.raises(Eagle3CheckpointError, match=r"midlayer.mlp.down_proj.weight is \[64, 7\], expected \[64, 96\]"):
        load_eagle3(saved, model)
    _tensors_edit(saved, drop=["midlayer.mlp.down_proj.weight", "d2t"],
                  **{"midlayer.mlp.down_proj.weight": torch.zeros(DIM, 96)})
    with pytest.raises(Eagle3CheckpointError, match=r"missing tensors \['d2t'\]"):
        load_eagle3(saved, model)
    _tensors_edit(saved, d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.long),
                  **{"layers.1.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(Eagle3CheckpointError, match=r"unexpected tensors \['layers.1.mlp.up_proj.weight'\]"):
        load_eagle3(saved, model)


def test_unknown_layouts_are_clear_errors(target, saved, tmp_path):
    _, model = target
    with pytest.raises(Eagle3CheckpointError, match="not an EAGLE-3 head"):
        load_eagle3(model.path, model)             # a full Llama checkpoint
    _config_edit(saved, num_hidden_layers=2)
    with pytest.raises(Eagle3CheckpointError, match="num_hidden_layers=2"):
        load_eagle3(saved, model)
    _config_edit(saved, num_hidden_layers=1)
    (saved / "model.safetensors").unlink()
    with pytest.raises(Eagle3CheckpointError, match="neither"):
        load_eagle3(saved, model)
    with pytest.raises(GraftError, match="no config.json"):
        load_eagle3(tmp_path / "nowhere", model)


# ----------------------------------------------------------------------------- tree steps
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tree_step_equals_running_each_path_causally(target, backend):
    """A prefix of 10 entries (target features), then ONE tree-masked step over 4 nodes fed head-width
    states (as deeper draft levels are): nodes 0 and 1 hang off the prefix, 2 off 0, 3 off 2. Each
    node's logits must equal those of its root-to-node path run causally on a fresh cache."""
    _, model = target
    head = _random_head(model, own_embedding=True).to(DEVICE)   # own embedding: .to() moves all of it
    attention = ops_for(backend, DEVICE).tree_attention
    g = torch.Generator().manual_seed(5)
    P = 10
    prefix, feats = on_device(torch.randint(0, VOCAB, (1, P), generator=g), torch.randn(1, P, 3 * DIM, generator=g))
    nodes, node_h = on_device(torch.randint(0, VOCAB, (1, 4), generator=g), torch.randn(1, 4, DIM, generator=g))
    parents = [-1, -1, 0, 2]
    pos = on_device(torch.tensor([0, 0, 1, 2]) + P)            # prefix_len + depth
    mask = on_device(torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
    with torch.inference_mode():
        head.setup_cache(32)
        head(prefix, on_device(torch.arange(P)), 0, features=feats, attention=attention)
        plan = AttentionPlan.tree(on_device(torch.tensor([P])), mask[None], P + 4)
        tree_logits, tree_h = head(nodes, pos, plan, features=node_h, attention=attention)
        for i in range(4):
            path = [i]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            idx = on_device(torch.tensor(path))
            head.kv.zero_()
            head(prefix, on_device(torch.arange(P)), 0, features=feats, attention=attention)
            ref, ref_h = head(nodes[:, idx], pos[idx], P, features=node_h[:, idx], attention=attention)   # causal
            assert (ref[0, -1, head.t2d] - tree_logits[0, i, head.t2d]).abs().max() <= LOGITS_FP32_ATOL, (backend, i)
            assert (ref_h[0, -1] - tree_h[0, i]).abs().max() <= LOGITS_FP32_ATOL, (backend, i)


def test_full_vocab_head_needs_no_map(target, tmp_path):
    _, model = target
    head = Eagle3Head(Eagle3Config.for_target(model.config), model.net.tok_embeddings.weight).eval()
    save_eagle3(head, tmp_path / "head")
    _tensors_edit(tmp_path / "head", drop=["d2t", "t2d"])     # vLLM and SGLang treat both as optional
    loaded = load_eagle3(tmp_path / "head", model)
    logits, _ = _run(loaded, _prompt(), torch.randn(1, 12, 3 * DIM))
    assert logits.shape == (1, 12, VOCAB) and torch.isfinite(logits).all() and bool(loaded.t2d.all())
