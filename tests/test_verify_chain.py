"""The verify -> accept -> commit chain (``graft_tk.verify_chain``): from its fixed buffers it does
exactly what the step's forward + ``accept_and_commit`` do, and it is one program with no host
read and no data-dependent shape — what a CUDA graph captures (checked here by compiling it whole
with ``fullgraph=True``: a host read or a shape that follows a value would break the graph).

Real SmolLM2 weights in fp32, cut to a few layers; a real prompt's tree from ``Engine.propose``.
"""
import pytest
import torch
from torch._dynamo.utils import counters

import graft_tk
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.models.transformer import cache_visibility
from graft_tk.verify_chain import VerifyChain, accept_and_commit, unpack_mask


@pytest.fixture(scope="module")
def target(smollm2_gguf):
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=4, progress=False)


def _step(target, method="retrieval+pld"):
    """(engine, request state, proposal) after a real prompt's prefill: a padded tree of N = 12."""
    engine = Engine(target, None, GraftConfig(budget=12), static_shapes=True)
    ids = encode_prompt(target, "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return", chat=False)
    target.net.setup_cache(len(ids) + 32)
    seq = engine.begin(ids, method, 16, 0.0, 1.0, None, None)
    return engine, seq, engine.propose(seq)


def _snapshot(engine, seq):
    return engine.target.net.kv.clone(), engine.adjacency.clone(), seq.context.clone()


def _restore(engine, seq, state):
    kv, adjacency, context = state
    engine.target.net.kv.copy_(kv)
    engine.adjacency.copy_(adjacency)
    seq.context.copy_(context)


def test_unpacked_mask_bits_are_the_trees_ancestor_mask(target):
    _, _, proposal = _step(target)
    tree, n = proposal.tree, proposal.tree.n
    valid = int(proposal.built.n_nodes)
    assert valid < n   # padding rows present: their bits are not the tree's business
    assert torch.equal(unpack_mask(proposal.built.mask, n)[:valid], tree.attn_mask()[:valid])


def test_chain_does_what_the_eager_step_does(target):
    engine, seq, proposal = _step(target)
    net, tree, start = target.net, proposal.tree, seq.target_len
    before = _snapshot(engine, seq)
    with torch.inference_mode():
        visible = cache_visibility(net.cache_len, start, tree.attn_mask())
        logits = net.forward_static(tree.tokens.clamp(min=0)[None], tree.positions(start)[None],
                                    start + torch.arange(tree.n), visible, attention=engine.ops.tree_attention)[0]
        want = accept_and_commit(engine.ops, tree, logits, engine.adjacency, 0.0, 1.0, None, seq.context,
                                 seq.length, net.kv, start, start)
        want_state = _snapshot(engine, seq)
        _restore(engine, seq, before)
        chain = VerifyChain(net, engine.ops, 12, engine.adjacency, seq.context)
        got = chain(proposal.built, start, seq.length)
    assert int(want[1]) >= 1 and torch.equal(got.path, want[0])
    assert torch.equal(got.n_path, want[1]) and torch.equal(got.bonus, want[2])
    for name, a, b in zip(("kv", "adjacency", "context"), _snapshot(engine, seq), want_state):
        assert torch.equal(a, b), name
    # What the chain wrote to the context: the path's tokens after the root, then the bonus.
    n_path = int(got.n_path)
    path = got.path[:n_path]
    new = seq.context[seq.length:seq.length + n_path].tolist()
    assert new == tree.tokens[path].tolist()[1:] + [int(got.bonus)]


def test_chain_is_one_program_with_no_host_read(target):
    """Compiled whole with fullgraph=True (a .item(), a .tolist() or a value-dependent shape would
    raise), the chain gives the eager chain's outcome bit for bit on the same state."""
    engine, seq, proposal = _step(target)
    net, start = target.net, seq.target_len
    before = _snapshot(engine, seq)
    with torch.inference_mode():
        chain = VerifyChain(net, engine.ops, 12, engine.adjacency, seq.context)
        eager = chain(proposal.built, start, seq.length)
        eager = [t.clone() for t in eager[:3]]
        eager_state = _snapshot(engine, seq)
        _restore(engine, seq, before)
        breaks = sum(counters["graph_break"].values())
        chain._run = torch.compile(chain._run, fullgraph=True)
        compiled = chain(proposal.built, start, seq.length)
    assert sum(counters["graph_break"].values()) == breaks
    for a, b in zip(compiled[:3], eager):
        assert torch.equal(a, b)
    assert torch.equal(engine.adjacency, eager_state[1]) and torch.equal(seq.context, eager_state[2])
    torch.testing.assert_close(net.kv, eager_state[0], atol=1e-5, rtol=1e-5)   # fused reductions may round differently


def test_chain_refuses_a_tree_of_another_budget(target):
    engine, seq, proposal = _step(target)
    chain = VerifyChain(target.net, engine.ops, 8, engine.adjacency, seq.context)
    with pytest.raises(ValueError, match="trees of 8 nodes"):
        chain(proposal.built, seq.target_len, seq.length)


def test_chain_refuses_a_tree_past_the_cache(target):
    engine, seq, proposal = _step(target)
    chain = VerifyChain(target.net, engine.ops, 12, engine.adjacency, seq.context)
    with pytest.raises(RuntimeError, match="cache slots"):
        chain(proposal.built, target.net.cache_len - 4, seq.length)


def test_a_capture_that_fails_warns_and_leaves_the_chain_eager(target, monkeypatch):
    """Where CUDA cannot capture the chain (an op that syncs, a driver that refuses), the step
    still runs, eagerly, with a warning; here a CUDA graph that raises stands in for that."""
    class Refused:
        def __init__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Refused)
    engine, seq, proposal = _step(target)
    before = _snapshot(engine, seq)
    with torch.inference_mode():
        want = [t.clone() for t in VerifyChain(target.net, engine.ops, 12, engine.adjacency, seq.context)(
            proposal.built, seq.target_len, seq.length)[:3]]
        _restore(engine, seq, before)
        chain = VerifyChain(target.net, engine.ops, 12, engine.adjacency, seq.context)
        chain.capture = True                  # as on CUDA
        chain(proposal.built, seq.target_len, seq.length)   # the eager first step
        _restore(engine, seq, before)
        with pytest.warns(UserWarning, match="could not be captured"):
            got = chain(proposal.built, seq.target_len, seq.length)
    assert chain.capture is False and chain.graph is None
    for a, b in zip(got[:3], want):
        assert torch.equal(a, b)
