"""Exact mode (graft_tk.models.exact): every row of a forward bitwise what it is alone.

The property itself, per op and end to end (``torch.equal``, bf16), each with the inverse check
that the same comparison fails without the mode; then what users see: bf16 greedy output and
seeded sampling of every method equal to ``ar``'s, alone and in a ragged batch.
"""
import contextlib

import pytest
import torch

import graft_tk
from graft_tk.decode import encode_prompt
from graft_tk.errors import InputError
from graft_tk.models import exact
from graft_tk.models.attention import AttentionPlan
from graft_tk.reference.tree_attention import tree_attention as reference_attention
from graft_tk.sampling import Sampling

from .conftest import real_prompts


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """An ancestor-or-self mask [n, n] of a random tree in depth order, and each node's depth."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j], j = True, parent[j]
    return mask, [int(mask[i].sum()) - 1 for i in range(n)]


def rows_alone(attention, q, k, v, prefix: list[int], mask, depth, **kw) -> list[bool]:
    """Whether each tree node's output of one verify call (rows of a ragged batch: prefix[b]
    cached keys, the same tree after them) equals plain decoding's 1-row call at its position,
    with its ancestors' keys laid out as committed tokens (where plain decoding has them)."""
    B, T = q.shape[0], q.shape[2]
    pre = torch.tensor(prefix)
    keys = max(prefix) + T
    out = attention(q, k, v, pre, mask.expand(B, T, T), keys, **kw)
    same = []
    for b, c in enumerate(prefix):
        for i in range(T):
            path = mask[i].nonzero().flatten()
            k1, v1 = k[b:b + 1].clone(), v[b:b + 1].clone()
            k1[:, :, c:c + len(path)], v1[:, :, c:c + len(path)] = k[b:b + 1, :, c + path], v[b:b + 1, :, c + path]
            p = c + depth[i]
            alone = attention(q[b:b + 1, :, i:i + 1], k1, v1, torch.tensor([p]), None, p + 1, **kw)
            same.append(torch.equal(alone[0, :, 0], out[b, :, i]))
    return same


@pytest.mark.parametrize("prefix,n,pad", [([5], 16, 0), ([63, 700], 16, 0), ([64, 130], 40, 0), ([300], 1, 0),
                                           ([250, 1000], 16, 16)])
def test_each_tree_row_of_exact_attention_is_its_one_row_decode(prefix, n, pad):
    gen = torch.Generator().manual_seed(n + prefix[0])
    mask, depth = random_tree(n, gen)
    B, S = len(prefix), 1024 + 128
    q = torch.randn(B, 12, n, 128, generator=gen).bfloat16()
    k, v = (torch.randn(B, 2, S, 128, generator=gen).bfloat16() for _ in range(2))
    rows = max(exact.attention_min_rows(128), pad)           # pad: GEMMs padded past the probed width
    assert all(rows_alone(exact.attention, q, k, v, prefix, mask, depth, min_rows=rows))
    close = exact.attention(q, k, v, torch.tensor(prefix), mask.expand(B, n, n), max(prefix) + n, min_rows=rows)
    want = reference_attention(q.float(), k.float(), v.float(), torch.tensor(prefix), mask.expand(B, n, n),
                               max(prefix) + n)
    torch.testing.assert_close(close.float(), want, atol=2e-2, rtol=2e-2)        # the same attention, in bf16


def test_the_reference_attention_fails_the_same_check():
    gen = torch.Generator().manual_seed(0)
    mask, depth = random_tree(16, gen)
    q = torch.randn(1, 12, 16, 128, generator=gen).bfloat16()
    k, v = (torch.randn(1, 2, 1024, 128, generator=gen).bfloat16() for _ in range(2))
    assert not all(rows_alone(reference_attention, q, k, v, [300], mask, depth))


def test_tree_sum_does_not_change_with_appended_zeros():
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 37)
    want = exact._tree_sum(x, 1)
    for n in (38, 64, 65, 200):
        assert torch.equal(exact._tree_sum(torch.nn.functional.pad(x, (0, n - 37)), 1), want)
    assert torch.equal(exact._tree_sum(x.T, 0), want)


def test_the_probe_finds_the_width_from_which_rows_agree():
    w, x = exact.cancelling(64, 96, 256, torch.float32)

    def narrow_differs(a):           # sums k in another order below 5 rows, as a GEMV path may
        if a.shape[0] < 5:
            return torch.stack([(a * w[n]).flip(-1).cumsum(-1)[:, -1] for n in range(w.shape[0])], 1)
        return torch.stack([(a * w[n]).cumsum(-1)[:, -1] for n in range(w.shape[0])], 1)

    assert exact.probe_min_rows(narrow_differs, x) == 5
    assert exact.probe_min_rows(lambda a: a @ w.T + torch.arange(a.shape[0])[:, None] * 1e-3, x) is None
    assert exact.probe_min_rows(lambda a: (a[:, None, :] * w).sum(-1), x) == 1
    # the cancelling inputs make an order change visible in almost every output
    assert (narrow_differs(x[:4]) != narrow_differs(x)[:4]).float().mean() > 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_tree_row_of_the_triton_exact_attention_is_its_one_row_decode(dtype):
    """The Triton kernel of exact mode (under the interpreter here): each tree node's output is
    bitwise its 1-row call's, in a ragged batch whose trees cross a key tile's end; the ordinary
    Triton tree attention fails the same check (in fp32, where bf16's rounding hides nothing)."""
    from graft_tk.kernels.exact_attention import exact_attention
    from graft_tk.kernels.tree_attention import tree_attention
    gen = torch.Generator().manual_seed(7)
    mask, depth = random_tree(12, gen)
    prefix, B, S = [27, 58], 2, 128           # keys tiled by 32 (fp32) and 64 (bf16): the trees cross both
    q = torch.randn(B, 6, 12, 64, generator=gen).to(dtype)
    k, v = (torch.randn(B, 2, S, 64, generator=gen).to(dtype) for _ in range(2))
    assert all(rows_alone(exact_attention, q, k, v, prefix, mask, depth))
    if dtype == torch.float32:
        assert not all(rows_alone(tree_attention, q, k, v, prefix, mask, depth))
    got = exact_attention(q, k, v, torch.tensor(prefix), mask.expand(B, 12, 12), max(prefix) + 12)
    want = reference_attention(q.float(), k.float(), v.float(), torch.tensor(prefix), mask.expand(B, 12, 12),
                               max(prefix) + 12)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)        # the same attention


@pytest.fixture(scope="module")
def smollm2_bf16():
    return graft_tk.load_model("smollm2-135m", dtype="bf16", progress=False)


def verify_rows_alone(net, attention, prompt: int = 300, n: int = 12) -> list[bool]:
    """A 12-node tree verified after a 300-token prompt: whether each node's logits equal plain
    decoding's 1-row forward at its position, its ancestors decoded one at a time before it."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 5000, (1, prompt), generator=gen)
    nodes = torch.randint(100, 5000, (1, n), generator=gen)
    mask, depth = random_tree(n, gen)
    net.setup_cache(prompt + 2 * n)
    with torch.inference_mode():
        net(ids, torch.arange(prompt), 0, logits_at=-1, attention=attention)
        cached = net.kv.clone()
        plan = AttentionPlan.tree(torch.tensor([prompt]), mask[None], prompt + n)
        tree = net(nodes, prompt + torch.tensor(depth), plan, attention=attention)[0]
        same = []
        for i in range(n):
            net.kv.copy_(cached)
            for d, j in enumerate(mask[i].nonzero().flatten().tolist()):
                alone = net(nodes[:, j:j + 1], torch.tensor([prompt + d]), prompt + d, attention=attention)[0, 0]
            same.append(torch.equal(alone, tree[i]))
    return same


@contextlib.contextmanager
def exact_net(net):
    """``net`` in exact mode for the block (its linear layers padded), back to plain after it;
    yields the rows exact attention's GEMMs need."""
    try:
        yield exact.enable(net)
    finally:
        for m in net.modules():
            if hasattr(m, "min_rows"):
                m.min_rows = 1
        net.head_min_rows = 1


def test_each_verify_row_of_an_exact_model_is_its_one_row_decode(smollm2_bf16):
    net = smollm2_bf16.net
    off = verify_rows_alone(net, None)
    with exact_net(net) as rows:
        on = verify_rows_alone(net, lambda *a, **kw: exact.attention(*a, min_rows=rows, **kw))
    assert all(on), on
    assert not all(off), "without exact mode the rows should differ (the inverse check)"


def test_each_verify_row_of_an_exact_model_is_its_one_row_decode_with_the_triton_kernel(smollm2_bf16):
    """The same with exact mode's Triton attention (what exact mode runs with backend="triton"),
    under the interpreter here; and an engine built so takes it as the target's attention."""
    from graft_tk.kernels.exact_attention import exact_attention
    with exact_net(smollm2_bf16.net):
        on = verify_rows_alone(smollm2_bf16.net, exact_attention, prompt=40, n=5)
    assert all(on), on
    assert graft_tk.Engine(smollm2_bf16, None, backend="triton", exact=True).runtime.target_attention is exact_attention


def test_norms_rope_and_activations_are_per_row():
    from graft_tk.models.transformer import RMSNorm, apply_rope, rope_tables
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    norm = RMSNorm(576, 1e-5)
    assert all(torch.equal(norm(x[i:i + 1])[0], norm(x)[i]) for i in range(64))
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = rope_tables(torch.arange(64)[None], inv, torch.bfloat16)
    q = x.view(1, 64, 9, 64).transpose(1, 2)
    whole = apply_rope(q, cos, sin)
    assert all(torch.equal(apply_rope(q[:, :, i:i + 1], cos[:, :, i:i + 1], sin[:, :, i:i + 1])[:, :, 0],
                           whole[:, :, i]) for i in range(64))
    act = torch.nn.functional.silu(x) * x
    assert all(torch.equal(torch.nn.functional.silu(x[i:i + 1]) * x[i:i + 1], act[i:i + 1]) for i in range(64))


@pytest.fixture(scope="module")
def exact_pair(smollm2_bf16):
    drafter = graft_tk.load_model("smollm2-135m", dtype="bf16", num_layers=6, progress=False)
    return smollm2_bf16, drafter


@pytest.mark.parametrize("prompt", real_prompts(n_humaneval=1, n_spec_bench=2))
def test_bf16_greedy_output_of_every_method_equals_ar_in_exact_mode(exact_pair, prompt):
    target, drafter = exact_pair
    want = graft_tk.decode(target, prompt.text, max_new_tokens=40, exact=True).tokens
    for method in ("graft", "tree", "pld", "graft-paper"):
        got = graft_tk.decode(target, prompt.text, drafter=drafter, method=method, max_new_tokens=40, exact=True)
        assert got.tokens == want, method
        assert got.stats["exact"]


def test_greedy_output_on_an_a8w8_target_equals_its_ar_in_exact_mode(exact_pair):
    """int8 activations x int8 weights (quant="a8w8"): integer sums are row-invariant, and exact
    mode makes what feeds them so; every method's output equals the a8w8 target's own ``ar``."""
    target = graft_tk.load_model("smollm2-135m", dtype="bf16", quant="a8w8", progress=False)
    drafter = exact_pair[1]
    for text in [p.text for p in load_real_prompts()][:1]:
        want = graft_tk.decode(target, text, max_new_tokens=32, exact=True).tokens
        for method in ("graft", "pld"):
            got = graft_tk.decode(target, text, drafter=drafter, method=method, max_new_tokens=32, exact=True)
            assert got.tokens == want, (text[:40], method)


def test_seeded_sampling_is_the_same_alone_and_in_a_ragged_batch(exact_pair):
    target, drafter = exact_pair
    prompts = [p.text for p in load_real_prompts()]
    prompts[0] = "\n\n".join(prompts) + "\nComplete the last function."     # longer than a prompt chunk
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=1234)
    engine = graft_tk.Engine(target, drafter, exact=True)
    ids = [encode_prompt(target, p, chat=True) for p in prompts]
    alone = engine.generate(engine.request(ids[0], "graft", 32, sampling))[0]
    plain = graft_tk.decode(target, prompts[0], method="ar", max_new_tokens=32, temperature=1.0, top_p=0.95,
                            seed=1234, exact=True).tokens
    batch = engine.batch(4, prefill_chunk=200, prefill_seconds=0.5)
    # every reading of a prompt runs the same forwards, however long they take
    assert batch.prefill_chunk == exact.PREFILL_GRID and batch.prefill_seconds is None
    others = []
    for i, method in zip(ids[1:], ("pld", "ar", "tree")):     # admitted as a server does: one prompt at a time
        others.append(batch.add(i, method, 32, Sampling(temperature=1.0, seed=7)))
        while batch.full:
            batch.step()
    assert len(ids[0]) > exact.PREFILL_GRID
    first = batch.add(ids[0], "graft", 32, sampling)        # joins three rows decoding, its prompt in chunks
    while len(batch):
        batch.step()
    assert alone == plain
    assert first.out == alone
    assert all(r.out for r in others)


def load_real_prompts():
    from graft_tk.bench.prompts import load_prompts
    return load_prompts("humaneval")[:4]


def test_exact_mode_refuses_a_compiled_target(smollm2_bf16):
    with pytest.raises(InputError, match="exact mode runs the target eagerly"):
        graft_tk.Engine(smollm2_bf16, None, compile=True, exact=True)


def test_decode_refuses_an_engine_built_without_exact(smollm2_bf16):
    engine = graft_tk.Engine(smollm2_bf16, None)
    with pytest.raises(InputError, match="exact=True"):
        graft_tk.decode(smollm2_bf16, "hi", engine=engine, exact=True, max_new_tokens=2)


def test_a_seeded_request_gets_the_same_text_on_a_warm_exact_server_alone_and_beside_others(exact_pair):
    """graft-serve --exact --max-batch 4, bf16: a seeded sampled request returns plain sampling's
    text (ar, same seed), twice on a warm server and while three other requests share its steps."""
    import concurrent.futures

    import openai

    from graft_tk.server.app import serving_in_thread
    from graft_tk.server.metrics import Metrics
    from graft_tk.server.scheduler import Scheduler

    target, drafter = exact_pair
    prompt = "Once upon a time"
    plain = graft_tk.decode(target, prompt, method="ar", max_new_tokens=24, temperature=1.0, top_p=0.95, seed=11,
                            chat=False, exact=True).text
    scheduler = Scheduler(target, drafter, "graft", graft_tk.GraftConfig(), 64, Metrics(), 4, max_model_len=1024,
                          exact=True)
    with serving_in_thread(scheduler, "smollm2-135m") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        ask = dict(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=1.0, top_p=0.95, seed=11)
        assert client.completions.create(**ask).choices[0].text == plain
        assert client.completions.create(**ask).choices[0].text == plain
        others = ["The sea is", "def fib(n):", "Three colours:"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            mine = pool.submit(lambda: client.completions.create(**ask).choices[0].text)
            rest = [pool.submit(lambda p=p: client.completions.create(**{**ask, "prompt": p, "seed": 5}))
                    for p in others]
            assert mine.result(timeout=300) == plain
            assert all(r.result(timeout=300).choices[0].text for r in rest)
        assert scheduler.peak_batch > 1
