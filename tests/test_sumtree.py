import contextlib
import unittest.mock

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from equibuffer._sumtree import _writes, SumTree, SumTrees

from .helpers import budget, chi_square_pvalue, scatters


# (fanout, top): the default (a single dense level below 2048 leaves), deep binary and
# ternary trees, a wide tree, and a tree whose top level is searched densely above leaves.
LAYOUTS = [(16, 2048), (2, 1), (3, 4), (16, 1), (4, 8)]


def _assign(ref: np.ndarray, indices, values, mask=None) -> None:
    """NumPy's `ref[indices] = values` (masked), written as the loop it stands for: each
    entry in order, so that the last value given for a leaf is the one it keeps."""
    keep = np.ones(len(indices), bool) if mask is None else np.asarray(mask)
    for i, v, k in zip(np.asarray(indices), _flushed(values), keep, strict=True):
        if k:
            ref[i] = v


def _check_against(tree: SumTree, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(np.asarray(tree.values()), ref.astype(np.float32))
    np.testing.assert_allclose(float(tree.total()), ref.astype(np.float64).sum(), rtol=1e-5)
    # Every internal node is the sum of its children, the root the sum of the top level;
    # padding stays zero.
    k = tree.fanout
    levels = [np.asarray(level, np.float64) for level in tree.levels]
    for below, above in zip(levels[:-2], levels[1:-1], strict=True):
        sums = below.reshape(-1, k).sum(axis=1)
        np.testing.assert_allclose(above[: sums.shape[0]], sums, rtol=1e-5, atol=1e-6)
        assert not above[sums.shape[0] :].any()
    np.testing.assert_allclose(levels[-1], [levels[-2].sum()], rtol=1e-5, atol=1e-6)
    assert not levels[0][tree.capacity :].any()
    assert len(levels[-2]) <= max(tree.top, 1) + tree.fanout


CAPACITIES = [1, 5, 23, 64, 300]
BATCH = 8  # fixed batch shape: one compilation per (capacity, layout)


@st.composite
def _updates(draw):
    capacity = draw(st.sampled_from(CAPACITIES))
    layout = draw(st.sampled_from(LAYOUTS))
    batches = []
    for _ in range(draw(st.integers(1, 5))):
        # Few distinct indices, so that duplicates within a batch are common.
        pool = draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=BATCH))
        indices = draw(st.lists(st.sampled_from(pool), min_size=BATCH, max_size=BATCH))
        values = draw(
            st.lists(
                st.one_of(st.just(0.0), st.floats(0.0, 1e3, width=32, allow_subnormal=False)),
                min_size=BATCH,
                max_size=BATCH,
            )
        )
        batches.append((np.array(indices, np.int32), np.array(values, np.float32)))
    return capacity, layout, batches


_set = eqx.filter_jit(SumTree.set)
_get = eqx.filter_jit(SumTree.get)
_find = eqx.filter_jit(SumTree.find)
_sample = eqx.filter_jit(SumTree.sample)
_search = eqx.filter_jit(SumTree.search)
_sample_values = eqx.filter_jit(SumTree.sample_values)
_read = eqx.filter_jit(SumTree.read)
_write_block = eqx.filter_jit(SumTree.write_block)


@settings(max_examples=budget(25), deadline=None)
@given(_updates())
def test_set_get_total_match_numpy(case):
    capacity, layout, batches = case
    tree = SumTree(capacity, *layout)
    ref = np.zeros(capacity, np.float32)
    for indices, values in batches:
        tree = _set(tree, jnp.asarray(indices), jnp.asarray(values))
        _assign(ref, indices, values)
        _check_against(tree, ref)
        probe = np.arange(capacity, dtype=np.int32)
        np.testing.assert_array_equal(np.asarray(_get(tree, jnp.asarray(probe))), ref[probe])
        np.testing.assert_array_equal(np.asarray(_read(tree, jnp.asarray(probe))), ref[probe])


def _built(case) -> tuple[SumTree, np.ndarray]:
    """The tree after a drawn sequence of batched sets, and its NumPy reference leaves."""
    capacity, layout, batches = case
    tree = SumTree(capacity, *layout)
    ref = np.zeros(capacity, np.float32)
    for indices, values in batches:
        tree = _set(tree, jnp.asarray(indices), jnp.asarray(values))
        _assign(ref, indices, values)
    return tree, ref


@settings(max_examples=budget(15), deadline=None)
@given(_updates(), st.integers(0, 2**31 - 1))
def test_find_and_sample_match_numpy(case, seed):
    tree, ref = _built(case)
    capacity = tree.capacity
    _check_against(tree, ref)
    if not (ref > 0).any():
        return
    # The middle of each positive leaf's cumulative interval finds that leaf (leaves far above
    # the float32 rounding of the running sum, so that the middle is unambiguous).
    before = np.concatenate([[0.0], np.cumsum(ref.astype(np.float64))[:-1]])
    clear = np.flatnonzero(ref > 1e-4 * ref.astype(np.float64).sum())
    middles = np.zeros(capacity, np.float32)
    middles[: clear.size] = (before + ref / 2.0)[clear]
    found = np.asarray(_find(tree, jnp.asarray(middles)))[: clear.size]
    np.testing.assert_array_equal(found, clear)
    # `search` finds the same leaves and gives their exact values.
    leaves, values = (np.asarray(x) for x in _search(tree, jnp.asarray(middles)))
    np.testing.assert_array_equal(leaves[: clear.size], clear)
    np.testing.assert_array_equal(values, ref[leaves])
    # Draws (stratified or not) only ever land on leaves of positive priority, including for
    # prefixes at and past the total; `sample_values` draws the same leaves as `sample` and
    # gives their exact values.
    for stratified in (True, False):
        draws = _sample(tree, jax.random.key(seed), 64, stratified=stratified)
        assert (ref[np.asarray(draws)] > 0).all()
        same, values = _sample_values(tree, jax.random.key(seed), 64, stratified=stratified)
        np.testing.assert_array_equal(np.asarray(same), np.asarray(draws))
        np.testing.assert_array_equal(np.asarray(values), ref[np.asarray(draws)])
    total = np.float32(tree.total())
    edge = jnp.array([total, np.nextafter(total, np.float32(np.inf))] * (capacity // 2 + 1))
    assert (ref[np.asarray(_find(tree, edge[:capacity]))] > 0).all()


@settings(max_examples=budget(20), deadline=None)
@given(_updates(), st.data())
def test_write_block_matches_write(case, data):
    # A block of contiguous leaves, wrapping from the last leaf to leaf 0 or not, written
    # with slices only gives the tree `write` gives.
    tree, ref = _built(case)
    capacity = tree.capacity
    m = data.draw(st.integers(1, capacity), label="m")
    start = data.draw(st.integers(0, capacity - 1), label="start")
    values = np.asarray(data.draw(st.lists(st.floats(0, 10, width=32), min_size=m, max_size=m)))
    block = _write_block(tree, jnp.int32(start), jnp.asarray(values, np.float32))
    leaves = (start + np.arange(m)) % capacity
    ref[leaves] = _flushed(values)
    _check_against(block, ref)
    scattered = tree.write(jnp.asarray(leaves), jnp.asarray(values, np.float32))
    np.testing.assert_allclose(np.asarray(block.nodes), np.asarray(scattered.nodes), rtol=1e-6)


def _flushed(values: np.ndarray) -> np.ndarray:
    """The leaves a write stores: float32, subnormal values as 0 (documented)."""
    values = np.asarray(values, np.float32)
    return np.where(values < np.finfo(np.float32).tiny, np.float32(0), values)


@pytest.mark.parametrize("layout", [(2, 1), (16, 2048), (3, 4)])
def test_subnormal_values_are_stored_as_zero(layout):
    # XLA's CPU sums read a subnormal float32 as 0: the leaf is stored as 0 too, so that the
    # leaf, its sums and the draws agree (a subnormal leaf alone would leave total() == 0
    # under a leaf that is not 0).
    tiny = np.finfo(np.float32).tiny
    values = np.array([5e-42, tiny, tiny / 2, 1.0, 0.0, 1e-45], np.float32)
    indices = jnp.arange(6)
    expect = np.array([0.0, tiny, 0.0, 1.0, 0.0, 0.0], np.float32)
    tree = SumTree(11, *layout)
    for written in (
        _set(tree, indices, jnp.asarray(values)),
        eqx.filter_jit(SumTree.write)(tree, indices, jnp.asarray(values)),
        _write_block(tree, jnp.int32(0), jnp.asarray(values)),
    ):
        np.testing.assert_array_equal(np.asarray(written.values())[:6], expect)
        _check_against(written, np.pad(expect, (0, 5)))
    alone = _set(tree, jnp.array([4]), jnp.array([5e-42], jnp.float32))
    assert float(alone.total()) == 0.0 and not np.asarray(alone.values()).any()


@pytest.mark.parametrize("layout", [(2, 1), (16, 2048)])
def test_duplicate_indices_the_last_wins(layout):
    """Documented: the last value given for a repeated index is written, as in NumPy, and
    the nodes above agree with it."""
    indices = jnp.array([3, 5, 3, 3, 5, 9])
    values = jnp.array([1.0, 2.0, 7.0, 4.0, 0.0, 0.5])
    for set_ in (SumTree.set, eqx.filter_jit(SumTree.set)):
        tree = set_(SumTree(10, *layout), indices, values)
        assert np.asarray(tree.get(jnp.array([3, 5, 9]))).tolist() == [4.0, 0.0, 0.5]
        ref = np.zeros(10, np.float32)
        ref[[3, 5, 9]] = [4.0, 0.0, 0.5]
        _check_against(tree, ref)


@st.composite
def _masked_writes(draw):
    """A tree's capacity and layout, and batches of writes with few distinct indices (so
    that most batches repeat some), each with a mask."""
    capacity, layout, batches = draw(_updates())
    masks = [
        np.array(draw(st.lists(st.booleans(), min_size=BATCH, max_size=BATCH))) for _ in batches
    ]
    return capacity, layout, [(*b, m) for b, m in zip(batches, masks, strict=True)]


_write = eqx.filter_jit(SumTree.write)


def _ways(jitted, eager) -> list:
    """`(write, _IN_TURN, _PAIRWISE)`: the three ways a write of a small batch can go on the
    CPU: one entry after the other (the default there, jitted), and by one scatter per level
    (elsewhere's way) after the pairwise comparison or after the marks (both eagerly)."""
    return [(jitted, _writes.IN_TURN, _writes.PAIRWISE), (eager, 0, 64), (eager, 0, 0)]


def _patched(in_turn: int, pairwise: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(unittest.mock.patch.object(_writes, "IN_TURN", in_turn))
    stack.enter_context(unittest.mock.patch.object(_writes, "PAIRWISE", pairwise))
    return stack


@settings(max_examples=budget(25), deadline=None)
@given(_masked_writes())
def test_write_with_repeated_indices_matches_numpy(case):
    """`write` with and without a mask: the last entry not skipped wins for every leaf, one
    entry after the other (a small batch on the CPU, jitted), and by scatters after the
    pairwise comparison or the marks (eagerly, so that no compiled program of another way
    is reused)."""
    capacity, layout, batches = case
    for write, in_turn, pairwise in _ways(_write, SumTree.write):
        tree = SumTree(capacity, *layout)
        ref = np.zeros(capacity, np.float32)
        with _patched(in_turn, pairwise):
            for indices, values, mask in batches:
                tree = write(
                    tree, jnp.asarray(indices), jnp.asarray(values), mask=jnp.asarray(mask)
                )
                _assign(ref, indices, values, mask)
                _check_against(tree, ref)
                tree = write(tree, jnp.asarray(indices[::-1]), jnp.asarray(values))  # no mask
                _assign(ref, indices[::-1], values)
                _check_against(tree, ref)


@settings(max_examples=budget(50), deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12).flatmap(
        lambda xs: st.tuples(
            st.just(xs), st.lists(st.booleans(), min_size=len(xs), max_size=len(xs))
        )
    )
)
def test_the_scatter_after_the_deduplication_has_unique_indices(case):
    """The mechanism, not only its result on this platform (the CPU's scatter keeps the last
    of repeated indices anyway; an H200 kept the first): after `_last_of_each`, by pairwise
    comparison or by marks, the entries still written have distinct leaves, and each is the
    last entry not skipped of its leaf. So the value scatter, declared
    `unique_indices=True`, leaves nothing to the platform."""
    indices, mask = np.array(case[0], np.int32), np.array(case[1])
    end = 100
    tree = SumTree(6).set(jnp.arange(6), jnp.full(6, 0.5))
    target = jnp.where(jnp.asarray(mask), jnp.asarray(indices), end)
    last = {int(i): j for j, (i, m) in enumerate(zip(indices, mask, strict=True)) if m}
    for pairwise in (64, 0):  # (the default for a small batch, and the marks)
        with unittest.mock.patch.object(_writes, "PAIRWISE", pairwise):
            nodes, written = _writes.last_of_each(tree.nodes, 6, jnp.asarray(indices), target, end)
        written = np.asarray(written)
        kept = written[written != end]
        assert len(set(kept.tolist())) == len(kept)
        assert {j for j, w in enumerate(written) if w != end} == set(last.values())
        assert all(written[j] == i for i, j in last.items())
        # Only the leaves about to be written differ from the tree's (they hold marks).
        changed = np.flatnonzero(np.asarray(nodes) != np.asarray(tree.nodes))
        assert set(changed.tolist()) <= set(last)


@pytest.mark.parametrize("batch", [3, 100])
def test_set_and_write_deduplicate_before_the_value_scatter(batch):
    """In the traced program, `set` and `write` write the values by a scatter declared
    `unique_indices=True`, after the marks' scatter-min for a large batch;
    `write(..., unique_indices=True)` (the buffers' adds, whose indices are distinct by
    construction) has no marks at any size."""
    tree = SumTree(1000)
    indices, values = jnp.arange(batch) % 2, jnp.ones(batch)
    first = [("scatter-min", False), ("scatter", True)] if batch > 64 else [("scatter", True)]
    for fn in (SumTree.set, SumTree.write):
        eqns = scatters(jax.make_jaxpr(fn)(tree, indices, values).jaxpr)
        names = [(e.primitive.name, e.params["unique_indices"]) for e in eqns]
        assert names[: len(first)] == first, names
    promised = jax.make_jaxpr(lambda t, i, v: t.write(i, v, unique_indices=True))
    names = [e.primitive.name for e in scatters(promised(tree, indices, values).jaxpr)]
    assert "scatter-min" not in names


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_priorities_are_never_drawn(layout):
    tree = SumTree(37, *layout)
    values = np.zeros(37, np.float32)
    values[[0, 17, 36]] = [1.0, 1e-6, 5.0]
    tree = _set(tree, jnp.arange(37), jnp.asarray(values))
    draws = np.asarray(_sample(tree, jax.random.key(0), 4096, stratified=False))
    assert set(np.unique(draws).tolist()) <= {0, 17, 36}
    # Setting a leaf back to zero removes it exactly.
    tree = _set(tree, jnp.array([36]), jnp.array([0.0]))
    assert float(tree.total()) == pytest.approx(1.0 + 1e-6)
    draws = np.asarray(_sample(tree, jax.random.key(1), 4096))
    assert set(np.unique(draws).tolist()) <= {0, 17}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stratified", [True, False])
def test_sampling_frequencies_chi_square(layout, stratified):
    capacity = 23  # not a power of two, nor a multiple of any fanout tried
    rng = np.random.default_rng(0)
    values = rng.gamma(1.0, size=capacity).astype(np.float32)
    values[[4, 9]] = 0.0
    tree = SumTree(capacity, *layout).set(jnp.arange(capacity), jnp.asarray(values))
    keys = jax.random.split(jax.random.key(3), 40)
    draws = jax.jit(jax.vmap(lambda k: tree.sample(k, 512, stratified=stratified)))(keys)
    counts = np.bincount(np.asarray(draws).ravel(), minlength=capacity)
    assert chi_square_pvalue(counts, values) > 1e-3


def test_capacity_one():
    tree = SumTree(1)
    assert float(tree.total()) == 0.0
    tree = tree.set(jnp.array([0, 0]), jnp.array([2.0, 3.0]))
    assert float(tree.total()) in (2.0, 3.0)
    np.testing.assert_array_equal(np.asarray(tree.sample(jax.random.key(0), 5)), np.zeros(5))
    np.testing.assert_array_equal(
        np.asarray(SumTree(1, 2).set(jnp.array([0]), jnp.array([1.0])).values()), [1.0]
    )


def test_large_batch_takes_the_dense_rebuild_path():
    # A batch as large as the tree rebuilds every level in one pass; same result.
    rng = np.random.default_rng(1)
    indices = rng.integers(0, 50, size=200).astype(np.int32)
    values = rng.random(200).astype(np.float32)
    ref = np.zeros(50, np.float32)
    for fanout in (2, 4):
        tree = SumTree(50, fanout, 1).set(jnp.asarray(indices), jnp.asarray(values))
        _assign(ref, indices, values)
        _check_against(tree, ref)


def test_no_error_accumulates_over_many_updates():
    """10^5 batched updates (16 leaves each) on 10^6 leaves: the root still matches a float64
    sum of the leaves to 1e-5, because every node is recomputed from its children."""
    capacity, steps, batch = 10**6, 10**5, 16
    tree = SumTree(capacity)
    assert tree.fanout > 2 and len(tree.levels) >= 3

    @jax.jit
    def run(tree, key):
        def body(tree, key):
            k1, k2 = jax.random.split(key)
            indices = jax.random.randint(k1, (batch,), 0, capacity)
            values = jax.random.uniform(k2, (batch,), jnp.float32) * 1e3
            return tree.set(indices, values), None

        return jax.lax.scan(body, tree, jax.random.split(key, steps))[0]

    tree = run(tree, jax.random.key(0))
    leaves = np.asarray(tree.values(), np.float64)
    assert np.count_nonzero(leaves) > 10**5
    np.testing.assert_allclose(float(tree.total()), leaves.sum(), rtol=1e-5)


@pytest.mark.parametrize(
    "values, message",
    [
        ([1.0, -1.0], "non-negative and finite"),
        ([np.nan, 1.0], "non-negative and finite"),
        ([np.inf, 1.0], "non-negative and finite"),
    ],
)
def test_bad_values_raise_inside_jit(values, message):
    set_ = eqx.filter_jit(SumTree.set)
    with pytest.raises(Exception, match=message):
        set_(SumTree(4), jnp.array([0, 1]), jnp.array(values, jnp.float32))


def test_out_of_range_index_raises_inside_jit():
    with pytest.raises(Exception, match=r"\[0, capacity=4\)"):
        eqx.filter_jit(SumTree.set)(SumTree(4), jnp.array([4]), jnp.array([1.0]))
    with pytest.raises(Exception, match=r"\[0, capacity=4\)"):
        eqx.filter_jit(SumTree.get)(SumTree(4), jnp.array([-1]))


def test_construction_and_shape_errors():
    with pytest.raises(ValueError, match="`capacity` must be at least 1"):
        SumTree(0)
    with pytest.raises(ValueError, match="`fanout` must be at least 2"):
        SumTree(8, 1)
    # (Caught by jaxtyping's runtime check in tests, by the method's own check otherwise.)
    with pytest.raises(Exception, match="values"):
        SumTree(8).set(jnp.array([0, 1]), jnp.array([1.0]))
    with pytest.raises(Exception, match="indices"):
        SumTree(8).get(jnp.array([0.0]))
    with pytest.raises(ValueError, match="3 values for a tree of capacity 2"):
        SumTree(2).write_block(jnp.int32(0), jnp.ones(3))


def test_jit_does_not_retrace_and_vmaps():
    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(tree, key):
        k1, k2 = jax.random.split(key)
        tree = tree.set(jax.random.randint(k1, (8,), 0, 100), jnp.ones(8))
        return tree, tree.sample(k2, 4)

    tree = SumTree(100)
    for i in range(5):
        tree, _ = step(tree, jax.random.key(i))
    assert 0 < float(tree.total()) <= 40.0
    # A batch of trees (e.g. one per seed) under vmap.
    trees = jax.vmap(lambda v: SumTree(6).set(jnp.arange(6), v))(jnp.eye(6))
    draws = jax.vmap(lambda t, k: t.sample(k, 3))(trees, jax.random.split(jax.random.key(0), 6))
    np.testing.assert_array_equal(np.asarray(draws), np.repeat(np.arange(6)[:, None], 3, 1))


# ------------------------------------------------------------------------------ SumTrees
# Several trees of one layout in one array (the clustered buffers' trees): each tree must
# behave as a `SumTree` of its own, whatever the other trees hold.


@st.composite
def _tree_writes(draw):
    """A number of trees, their capacity and layout, and batches of masked writes addressed
    by `(tree, leaf)`, with few distinct pairs (so that most batches repeat some)."""
    capacity, layout, batches = draw(_masked_writes())
    count = draw(st.integers(1, 4))
    trees = [
        np.array(draw(st.lists(st.integers(0, count - 1), min_size=BATCH, max_size=BATCH)))
        for _ in batches
    ]
    return count, capacity, layout, [(t, *b) for t, b in zip(trees, batches, strict=True)]


def _check_trees(trees: SumTrees, ref: np.ndarray) -> None:
    """Every tree's row against its NumPy leaves (as a `SumTree`), and the batched reads."""
    for t in range(ref.shape[0]):
        _check_against(trees.tree(t), ref[t])
    np.testing.assert_array_equal(np.asarray(trees.values()), ref)
    roots = [float(trees.tree(t).total()) for t in range(ref.shape[0])]
    np.testing.assert_array_equal(np.asarray(trees.totals()), roots)


_trees_write = eqx.filter_jit(SumTrees.write)


@settings(max_examples=budget(25), deadline=None)
@given(_tree_writes())
def test_sum_trees_write_matches_numpy(case):
    """`SumTrees.write`: for every `(tree, leaf)` the last entry not skipped wins, one entry
    after the other (jitted), by scatters after the pairwise comparison and after the marks
    (eagerly), and every tree's nodes are the sums of their children; no write touches
    another tree."""
    count, capacity, layout, batches = case
    for write, in_turn, pairwise in _ways(_trees_write, SumTrees.write):
        trees = SumTrees(count, capacity, *layout)
        ref = np.zeros((count, capacity), np.float32)
        with _patched(in_turn, pairwise):
            for tree, leaf, values, mask in batches:
                at = (jnp.asarray(tree, jnp.int32), jnp.asarray(leaf))
                trees = write(trees, at, jnp.asarray(values), mask=jnp.asarray(mask))
                for t in range(count):
                    mine = tree == t
                    _assign(ref[t], leaf[mine], values[mine], mask[mine])
                _check_trees(trees, ref)
                trees = write(trees, at, jnp.asarray(values[::-1]))  # no mask
                for t in range(count):
                    _assign(ref[t], leaf[tree == t], values[::-1][tree == t])
                _check_trees(trees, ref)


@pytest.mark.parametrize("batch", [3, 30, 100])
def test_sum_trees_write_deduplicates_before_the_value_scatter(batch):
    """As `SumTree.write`: the values are written by a scatter declared
    `unique_indices=True`, after the marks' scatter-min for a large batch; with
    `unique_indices=True` (the adds) there are no marks. Entries of one leaf in different
    trees are different entries."""
    trees = SumTrees(3, 1000)
    at = (jnp.arange(batch) % 3, jnp.arange(batch) % 2)
    values = jnp.arange(1.0, batch + 1.0)
    first = [("scatter-min", False), ("scatter", True)] if batch > 64 else [("scatter", True)]
    eqns = scatters(jax.make_jaxpr(lambda t, i, v: t.write(i, v))(trees, at, values).jaxpr)
    names = [(e.primitive.name, e.params["unique_indices"]) for e in eqns]
    assert names[: len(first)] == first, names
    promised = jax.make_jaxpr(lambda t, i, v: t.write(i, v, unique_indices=True))
    names = [e.primitive.name for e in scatters(promised(trees, at, values).jaxpr)]
    assert "scatter-min" not in names
    written = trees.write(at, values)
    for t in range(3):  # the last value of each (tree, leaf)
        last = {int(leaf): float(v) for tr, leaf, v in zip(*at, values, strict=True) if tr == t}
        got = np.asarray(written.tree(t).values())
        assert {i: float(got[i]) for i in last} == last and float(got[2:].sum()) == 0


def _filled_trees(count: int, capacity: int, layout, seed: int) -> tuple[SumTrees, np.ndarray]:
    """`count` trees of random leaves, about half of them 0 (tree 0 all 0)."""
    rng = np.random.default_rng(seed)
    ref = (rng.random((count, capacity)) * (rng.random((count, capacity)) < 0.5)).astype(np.float32)
    ref[0] = 0.0
    tree, leaf = np.divmod(np.arange(count * capacity), capacity)
    trees = SumTrees(count, capacity, *layout)
    at = (jnp.asarray(tree, jnp.int32), jnp.asarray(leaf, jnp.int32))
    return trees.write(at, jnp.asarray(ref.reshape(-1)), unique_indices=True), ref


# The quick session: the default layout; every layout in `tests-all` (each 3 to 8 s here).
@pytest.mark.parametrize(
    "layout", [LAYOUTS[0], *(pytest.param(x, marks=pytest.mark.thorough) for x in LAYOUTS[1:])]
)
def test_sum_trees_search_each_query_in_its_own_tree(layout):
    """Each query descends its own tree: the leaf and value that `SumTree.search` of that
    tree finds, bit for bit, for prefixes inside, at and past the tree's total (a positive
    leaf of that tree, never one of another tree)."""
    count, capacity = 4, 300
    trees, ref = _filled_trees(count, capacity, layout, seed=1)
    rng = np.random.default_rng(2)
    tree = rng.integers(1, count, 200).astype(np.int32)  # (tree 0 has nothing to draw)
    totals = np.asarray(trees.totals())[tree]
    prefix = (rng.random(200) * totals).astype(np.float32)
    prefix[:20] = totals[:20]
    prefix[20:40] = np.nextafter(totals[20:40], np.float32(np.inf))
    leaves, values = (np.asarray(x) for x in trees.search(jnp.asarray(tree), jnp.asarray(prefix)))
    for t in range(1, count):
        mine = tree == t
        want_leaves, want_values = trees.tree(t).search(jnp.asarray(prefix[mine]))
        np.testing.assert_array_equal(leaves[mine], np.asarray(want_leaves))
        np.testing.assert_array_equal(values[mine], np.asarray(want_values))
        assert (ref[t, leaves[mine]] > 0).all()
    np.testing.assert_array_equal(values, ref[tree, leaves])


# The quick session: 2 blocks of the default layout and of a deep binary tree; the other
# blocks and layouts in `tests-all` (each 2 to 7 s here).
@pytest.mark.parametrize(
    "blocks,layout",
    [
        (blocks, layout) if blocks == 2 and layout in LAYOUTS[:2] else
        pytest.param(blocks, layout, marks=pytest.mark.thorough)
        for layout in LAYOUTS
        for blocks in (2, 3, 5)
    ],
)  # fmt: skip
def test_sum_trees_blocks_match_each_tree(layout, blocks):
    """`block_totals` and `search_blocks` of every tree as `SumTree`'s of that tree (the same
    leaves and values, bit for bit, each query inside its block of its own tree)."""
    count, capacity, per = 3, 120, 16
    trees, _ = _filled_trees(count, capacity, layout, seed=blocks)
    trees = trees.write(  # (tree 0 positive too, in every block)
        (jnp.zeros(blocks, jnp.int32), jnp.arange(blocks, dtype=jnp.int32) * (capacity // blocks)),
        jnp.ones(blocks),
    )
    totals = np.asarray(trees.block_totals(blocks))
    for t in range(count):
        np.testing.assert_array_equal(totals[t], np.asarray(trees.tree(t).block_totals(blocks)))
    rng = np.random.default_rng(blocks)
    tree = rng.integers(0, count, (blocks, per)).astype(np.int32)
    limit = np.take_along_axis(totals.T, tree, axis=1)
    prefix = (rng.random((blocks, per)) * limit).astype(np.float32)
    prefix[:, 0] = limit[:, 0]  # at the block's total: its last positive leaf
    leaves, values = (
        np.asarray(x) for x in trees.search_blocks(jnp.asarray(tree), jnp.asarray(prefix))
    )
    for t in range(count):
        mine = tree == t
        want_leaves, want_values = trees.tree(t).search_blocks(jnp.asarray(prefix))
        np.testing.assert_array_equal(leaves[mine], np.asarray(want_leaves)[mine])
        np.testing.assert_array_equal(values[mine], np.asarray(want_values)[mine])
    width = capacity // blocks
    assert ((leaves // width) == np.arange(blocks)[:, None]).all()


def test_sum_trees_construction_errors():
    with pytest.raises(ValueError, match="`trees` must be at least 1"):
        SumTrees(0, 8)
    with pytest.raises(ValueError, match="`capacity` must be at least 1"):
        SumTrees(2, 0)
    with pytest.raises(ValueError, match="more nodes than int32"):
        SumTrees(2**12, 2**20)
    trees = SumTrees(3, 5, 2, 1)
    assert trees.trees == 3 and trees.nodes.shape == (3 * SumTree(5, 2, 1).nodes.shape[0],)
    assert trees.tree(2).capacity == 5 and trees.tree(2).fanout == 2
