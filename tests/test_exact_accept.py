"""The sampled accept rule, checked exactly: the distribution of one speculative step with every
uniform integrated out equals the target's own distribution over what the step emits.

The step (``graft_tk.step._verify_and_commit``) makes the target's choice at every tree node with
``graft_tk.sampling.choose`` -- an inverse-CDF draw at ONE uniform per sequence position, so every
node at depth d uses the uniform of position d + 1 -- then ``accept`` walks the tree and emits the
accepted path's tokens plus the bonus. Given the per-position uniforms u_0 .. u_D (D = the tree's
depth) the output is a fixed function of them, constant on the cells of a product grid: per
position, the breakpoints are the CDF values of every distribution drawn at that position (all
nodes at that depth). We evaluate the real code once at the midpoint of every cell (the uniforms
are injected in place of ``position_uniforms``), weight the output by the cell's volume and sum:
that is the exact output distribution, up to float rounding (the code's uniforms have 53 bits;
the grid treats them as continuous, an error below 2**-53 per breakpoint).

What it must equal: the step emits s = (x_1 .. x_k) exactly when x_1 .. x_{k-1} are the tokens of
a root-to-node path n_0 (root) .. n_{k-1} and the draw at n_{k-1} is x_k, a token that is NOT a
child of n_{k-1} (else the walk would go on). Each draw is at its own position, so
P(emit s) = prod_i p_{n_{i-1}}(x_i), the target's conditionals along the path (p_n: softmax of
node n's logits / T, cut to the top-p nucleus, renormalised -- defined here from scratch), and
every other sequence has probability 0. Checked to 1e-9 in float64, for every sequence.

Trees: the accept op sees only a tree (tokens, parents, depth, mask), whatever method built it.
Every method's tree is a rooted tree with distinct sibling tokens: ``ar`` the root alone, ``pld``
a chain, ``tree``/``pruned`` drafter trees of up to K children per node, ``retrieval`` template
trees, the hybrids their unions. The family (``SHAPES``) is EVERY unordered rooted tree with
  * depth <= 3 and <= 2 children per node (66 shapes: chains up to depth 3, binary trees), or
  * depth <= 2 and <= 3 children per node (35 shapes, 25 of them new), or
  * the root with 4 or 5 children (5: every token of the vocabulary is drafted),
93 shapes in all, on a vocabulary of V = 5 (up to 25,245 cells per case). Every node
gets its own random logits (the target's distribution depends on the path), and the children of
a node carry the parent's likeliest tokens, its unlikeliest (outside the nucleus at top_p = 0.8,
or nearly impossible at T = 0.3), or random distinct ones: node i of shape number s follows rule
(s + i) mod 3, so every tree mixes them and the root's children follow each rule in a third of
the shapes. Every shape is run at every T in {0.3, 1.0, 1.7} and top_p in {1.0, 0.8}.

Power: the last tests break the rule inside the real code (``truncated_probs``, the one function
``choose`` builds its distribution with, made to ignore T or top_p) and require the enumeration
to find a deviation > 1e-3. The grid also holds the breakpoints of the distributions the code
under test builds, so the enumeration stays exact for a broken rule too. The Triton walk
(``graft_tk.kernels.accept``, Triton's interpreter without CUDA) is enumerated on small shapes.
Chi-square tests of the draws stay in test_sampling.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from graft_tk import sampling
from graft_tk.methods import METHODS
from graft_tk.reference.accept import accept as accept_reference
from graft_tk.tree import Tree

V = 5                    # vocabulary
PREFIX = 40              # tokens in the target's KV cache: node positions PREFIX + depth, choices at + 1
SEED = 7                 # the Sampling seed (irrelevant: the uniforms are injected)
TOL = 1e-9               # exact up to float64 rounding
MERGE = 1e-12            # breakpoints closer than this are one (the cell between them weighs < 1e-12)
TEMPERATURES = (0.3, 1.0, 1.7)
TOP_PS = (1.0, 0.8)
TOKEN_RULES = ("likeliest", "unlikeliest", "random")   # how a node's children's tokens are picked


# --------------------------------------------------------------------------- the tree shapes
def canonical(shape: tuple) -> tuple:
    """A shape is the tuple of its children's shapes (a leaf is ``()``); canonical: sorted."""
    return tuple(sorted(canonical(child) for child in shape))


def all_shapes(max_depth: int, max_children: int) -> list[tuple]:
    """Every unordered rooted tree of depth <= max_depth with <= max_children children per node,
    each once, canonical."""
    if max_depth == 0:
        return [()]
    smaller = all_shapes(max_depth - 1, max_children)
    return [canonical(tuple(smaller[i] for i in combo))
            for k in range(max_children + 1)
            for combo in itertools.combinations_with_replacement(range(len(smaller)), k)]


SHAPES = sorted(set(all_shapes(3, 2) + all_shapes(2, 3) + [((),) * 4, ((),) * 5]), key=lambda s: (len(str(s)), s))
CHAIN_3 = ((((),),),)            # root -> a -> b -> c: a prompt-lookup chain
BINARY_2 = (((), ()), ((), ()))  # the full binary tree of depth 2


def depth_of(shape: tuple) -> int:
    return 1 + max(map(depth_of, shape)) if shape else 0


def shape_name(shape: tuple) -> str:
    """Children counts in breadth-first order, e.g. '2,1,0,0' (readable in failure messages)."""
    counts, level = [], [shape]
    while level:
        counts += [len(s) for s in level]
        level = [c for s in level for c in s]
    return ",".join(map(str, counts))


# --------------------------------------------------------------------------- one case
def node_rule(shape_index: int, node: int) -> str:
    return TOKEN_RULES[(shape_index + node) % len(TOKEN_RULES)]


def make_case(shape: tuple) -> tuple[Tree, torch.Tensor]:
    """The tree of ``shape`` (breadth-first: parents before children) with random float32 logits
    [n, V] per node (seeded by the shape's index in ``SHAPES``), the children of each node
    carrying distinct tokens picked by the node's rule (``node_rule``) from its logits: its
    likeliest, its unlikeliest, or random ones."""
    shape = canonical(shape)
    index = SHAPES.index(shape)
    g = torch.Generator().manual_seed(index)
    parents, subshapes, node = [-1], [shape], 0
    while node < len(subshapes):              # breadth-first: the list grows while we walk it
        for child in subshapes[node]:
            parents.append(node)
            subshapes.append(child)
        node += 1
    n = len(parents)
    logits = torch.randn(n, V, generator=g) * 2.0
    tokens = [int(torch.randint(V, (), generator=g))] + [-1] * (n - 1)
    for node in range(n):
        kids = [i for i in range(n) if parents[i] == node]
        by_rank = logits[node].argsort(descending=True).tolist()
        order = {"likeliest": by_rank, "unlikeliest": by_rank[::-1],
                 "random": torch.randperm(V, generator=g).tolist()}[node_rule(index, node)]
        for kid, token in zip(kids, order):
            tokens[kid] = token
    return Tree.from_lists(tokens, parents), logits


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The definition, one row, float64: softmax(logits / T); walk the tokens by probability
    (ties: lower id first), keeping each while the mass before it is < top_p; renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    kept, mass = torch.zeros_like(probs), 0.0
    for token in sorted(range(len(probs)), key=lambda t: (-float(probs[t]), t)):
        if mass < top_p:
            kept[token] = probs[token]
        mass += float(probs[token])
    return kept / kept.sum()


def encode(seq: list[int]) -> int:
    """A sequence of tokens < V (length <= 5) as one integer: digits base V + 1, 0 = empty."""
    return sum((tok + 1) * (V + 1) ** i for i, tok in enumerate(seq))


N_CODES = (V + 1) ** 5


def decode(code: int) -> tuple[int, ...]:
    out = []
    while code:
        code, digit = divmod(code, V + 1)
        out.append(digit - 1)
    return tuple(out)


def expected_output(tree: Tree, dists: torch.Tensor) -> torch.Tensor:
    """P(the step emits s) for every s (indexed by ``encode``): for every node n and every token x
    that is not one of n's children, (the target's probability of n's path) * p_n(x)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    want = torch.zeros(N_CODES, dtype=torch.float64)
    path_prob, path_tokens = [1.0], [[]]
    for node in range(1, tree.n):             # parents first
        p = parents[node]
        path_prob.append(path_prob[p] * float(dists[p, tokens[node]]))
        path_tokens.append(path_tokens[p] + [tokens[node]])
    for node in range(tree.n):
        kids = {tokens[i] for i in range(tree.n) if parents[i] == node}
        for x in range(V):
            if x not in kids:
                want[encode(path_tokens[node] + [x])] += path_prob[node] * float(dists[node, x])
    return want


def uniform_grid(tree: Tree, logits: torch.Tensor, dists: torch.Tensor, temperature: float, top_p: float):
    """Cell midpoints [cells, D + 1] and volumes [cells] of the product grid over the positions'
    uniforms. Position d's breakpoints: the CDF values of every node at depth d, under the
    definition AND under the distribution the code builds (``sampling.truncated_probs`` as bound
    now, normalised as ``choose`` normalises it), so the code is constant on every cell even when
    its rule differs from the definition."""
    built = sampling.truncated_probs(logits.double(), temperature, top_p)
    code_cdf = built.cumsum(-1) / built.sum(-1, keepdim=True)
    depth = tree.depth.long()
    mids, widths = [], []
    for d in range(int(depth.max()) + 1):
        at = depth == d
        points = sorted(torch.cat([dists[at].cumsum(-1).flatten(), code_cdf[at].flatten()]).tolist())
        edges = [0.0]
        for x in points:
            if MERGE < x < 1.0 - MERGE and x - edges[-1] > MERGE:
                edges.append(x)
        edges.append(1.0)
        e = torch.tensor(edges, dtype=torch.float64)
        mids.append((e[1:] + e[:-1]) / 2)
        widths.append(e[1:] - e[:-1])
    grid = torch.cartesian_prod(*mids).reshape(-1, len(mids))
    volume = torch.cartesian_prod(*widths).reshape(-1, len(widths)).prod(-1)
    return grid, volume


def step_outputs(tree: Tree, logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor,
                 accept=accept_reference, distinct_rows: bool = False) -> torch.Tensor:
    """The step's accept path, as ``_verify_and_commit`` calls it, on B copies of the tree (row b
    with the uniform of position PREFIX + 1 + d set to uniforms[b, d]): ``choose`` then ``accept``.
    Returns the emitted sequences (accepted tokens after the root, then the bonus), ``encode``d,
    [B]. ``distinct_rows``: run ``accept`` once per distinct choice row (for the interpreter)."""
    B, N = uniforms.shape[0], tree.n
    tokens = tree.tokens.expand(B, N)
    parents, depth = tree.parents.expand(B, N), tree.depth.expand(B, N)
    mask = tree.packed_mask().expand(B, N, -1)
    positions = PREFIX + depth.long()
    injected = []

    def position_uniforms(keys, pos):
        assert keys.shape == (B, 1) and pos.shape == (B, N), (keys.shape, pos.shape)
        injected.append(True)
        return uniforms.gather(1, pos - (PREFIX + 1))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "position_uniforms", position_uniforms)
        choice = sampling.choose(logits.expand(B, N, V), positions + 1,
                                 [sampling.Sampling(temperature, top_p, SEED)] * B)
    assert injected, "choose no longer draws through sampling.position_uniforms: update this test's injection"
    if distinct_rows:
        rows, back = choice.unique(dim=0, return_inverse=True)
        k = rows.shape[0]
        path, n_path, bonus = (t[back] for t in accept(tokens[:k].contiguous(), parents[:k].contiguous(),
                                                       depth[:k].contiguous(), mask[:k], rows, None, None))
    else:
        path, n_path, bonus = accept(tokens, parents, depth, mask, choice, None, None)
    # the emitted tokens: path nodes 1 .. n_path - 1, then the bonus (as the step writes the context)
    i = torch.arange(N)
    emitted = torch.where(i < n_path[:, None] - 1, tree.tokens[path.roll(-1, 1).clamp(min=0)], -1)
    emitted = torch.where(i == n_path[:, None] - 1, bonus[:, None], emitted)
    digits = torch.where(emitted >= 0, emitted + 1, 0)
    return (digits * (V + 1) ** i).sum(-1)


def enumerate_step(shape: tuple, temperature: float, top_p: float, accept=accept_reference,
                   distinct_rows: bool = False):
    """(exact distribution of the step's output, the target's, the tree) for one case."""
    tree, logits = make_case(shape)
    dists = torch.stack([target_distribution(row, temperature, top_p) for row in logits])
    grid, volume = uniform_grid(tree, logits, dists, temperature, top_p)
    codes = step_outputs(tree, logits, temperature, top_p, grid, accept, distinct_rows)
    got = torch.zeros(N_CODES, dtype=torch.float64).index_add_(0, codes, volume)
    return got, expected_output(tree, dists), tree


def worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    gap = (got - want).abs()
    code = int(gap.argmax())
    return float(gap[code]), f"sequence {decode(code)}: step {float(got[code]):.12g}, target {float(want[code]):.12g}"


# --------------------------------------------------------------------------- the tests
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors of ~10^6 elements: one torch thread is as fast, and on a busy machine two threads
    that wait for each other are several times slower. Restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_family_is_what_the_docstring_says():
    assert len(set(all_shapes(3, 2))) == 66 and len(set(all_shapes(2, 3))) == 35 and len(SHAPES) == 93
    assert () in SHAPES and CHAIN_3 in SHAPES and BINARY_2 in SHAPES and ((),) * V in SHAPES
    assert max(map(depth_of, SHAPES)) == 3
    assert {node_rule(i, 0) for i, s in enumerate(SHAPES) if s} == set(TOKEN_RULES)   # at the root, every rule
    # every method's trees are trees of this kind: an example of each (any shape could come from a
    # drafter) is in the family, and a method added to METHODS must be given one here
    examples = {"ar": (), "tree": BINARY_2, "pruned": (((),), ()), "retrieval": (((), ()), ()),
                "graft-paper": ((((),),), ((), ())), "pld": CHAIN_3,
                "tree+pld": ((((),),), ((),)), "retrieval+pld": ((((),),), ((), ())),
                "suffix": (((), ()), ((),)), "graft": ((((),), ()), ((),))}
    assert set(METHODS) <= set(examples), f"a method without an example tree here: {set(METHODS) - set(examples)}"
    assert all(canonical(s) in SHAPES for s in examples.values())


@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_step_emits_exactly_the_targets_distribution(temperature, top_p):
    for shape in SHAPES:
        got, want, tree = enumerate_step(shape, temperature, top_p)
        where = f"shape {shape_name(shape)} tokens {tree.tokens.tolist()} (T={temperature}, top_p={top_p})"
        assert abs(float(want.sum()) - 1.0) < 1e-12, f"the target's probabilities sum to {float(want.sum())}: {where}"
        assert abs(float(got.sum()) - 1.0) < 1e-12, f"the cells' volumes sum to {float(got.sum())}: {where}"
        gap, detail = worst(got, want)
        assert gap <= TOL, f"{where}: the step's output distribution differs from the target's by {gap:.3g} at {detail}"


SMALL_SHAPES = [(), ((),), CHAIN_3, ((), ()), ((),) * V, (((), ()),)]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=shape_name)
def test_the_triton_walk_emits_exactly_the_targets_distribution(shape):
    """The kernel sees only the choices (made in torch), so one (T, top_p) is enough; each distinct
    choice row is walked once (Triton's interpreter runs one program per row)."""
    from graft_tk.kernels.accept import accept as accept_kernel
    from tests.kernel_utils import on_device

    def accept_on_device(*args):     # CUDA when there is one, else the interpreter on CPU
        return tuple(t.cpu() for t in accept_kernel(*on_device(*args)))
    got, want, tree = enumerate_step(shape, 1.0, 0.8, accept_on_device, distinct_rows=True)
    gap, detail = worst(got, want)
    assert gap <= TOL, f"kernel, shape {shape_name(shape)} tokens {tree.tokens.tolist()}: off by {gap:.3g} at {detail}"


# --------------------------------------------------------------------------- power: a broken rule is caught
POWER_SHAPES = [(), ((),), CHAIN_3, BINARY_2, ((((),), ()), ()), ((),) * V]


def _break(monkeypatch, **forced):
    """``sampling.truncated_probs`` (what ``choose`` builds its distribution with) with some of
    its arguments forced, e.g. temperature=1.0: the real code with one thing broken."""
    real = sampling.truncated_probs

    def broken(logits, temperature, top_p):
        args = {"temperature": temperature, "top_p": top_p, **forced}
        return real(logits, args["temperature"], args["top_p"])
    monkeypatch.setattr(sampling, "truncated_probs", broken)


def _assert_caught(temperature: float, top_p: float, broken_what: str):
    for shape in POWER_SHAPES:
        got, want, _ = enumerate_step(shape, temperature, top_p)
        assert abs(float(got.sum()) - 1.0) < 1e-12
        gap, detail = worst(got, want)
        assert gap > 1e-3, (f"an accept rule that {broken_what} went unnoticed on shape {shape_name(shape)} "
                            f"(T={temperature}, top_p={top_p}): largest gap {gap:.3g} at {detail}")


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_a_rule_that_ignores_the_temperature_is_caught(monkeypatch, temperature):
    _break(monkeypatch, temperature=1.0)
    _assert_caught(temperature, 1.0, "ignores the temperature")


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_a_rule_that_ignores_top_p_is_caught(monkeypatch, temperature):
    _break(monkeypatch, top_p=1.0)
    _assert_caught(temperature, 0.8, "ignores top_p")


def test_the_enumeration_is_exact_for_a_broken_rule_too(monkeypatch):
    """With the rule broken, the grid (which also holds the code's breakpoints) gives the broken
    rule's own exact distribution: the definition evaluated at T = 1."""
    _break(monkeypatch, temperature=1.0)
    got, _, tree = enumerate_step(BINARY_2, 0.3, 1.0)
    _, logits = make_case(BINARY_2)
    at_one = expected_output(tree, torch.stack([target_distribution(row, 1.0, 1.0) for row in logits]))
    gap, detail = worst(got, at_one)
    assert gap <= TOL, f"the enumeration of the T = 1 rule is off by {gap:.3g} at {detail}"
