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


@eqx.filter_jit
def _reads(tree: SumTree) -> tuple:
    """`tree.values()`, `tree.total()` and `tree.levels`, in one compiled call per tree
    layout (eagerly, each slice was a program of its own, compiled for each layout)."""
    return tree.values(), tree.total(), tree.levels


def _check_against(tree: SumTree, ref: np.ndarray, reads: tuple | None = None) -> None:
    """`tree` against its NumPy leaves `ref` (`reads`: the tree's `_reads`, when read in a
    compiled call of its own)."""
    values, total, levels = _reads(tree) if reads is None else reads
    np.testing.assert_array_equal(np.asarray(values), ref.astype(np.float32))
    np.testing.assert_allclose(float(total), ref.astype(np.float64).sum(), rtol=1e-5)
    # Every internal node is the sum of its children, the root the sum of the top level;
    # padding stays zero.
    k = tree.fanout
    levels = [np.asarray(level, np.float64) for level in levels]
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


@eqx.filter_jit
def _set_and_read(tree, indices, values, probe):
    """`set`, then what the test reads of the new tree (`_reads`, `get` and `read` of
    `probe`): one compiled call per batch."""
    tree = tree.set(indices, values)
    return tree, _reads(tree), tree.get(probe), tree.read(probe)


@settings(max_examples=budget(25), deadline=None)
@given(_updates())
def test_set_get_total_match_numpy(case):
    capacity, layout, batches = case
    tree = SumTree(capacity, *layout)
    ref = np.zeros(capacity, np.float32)
    for indices, values in batches:
        probe = np.arange(capacity, dtype=np.int32)
        tree, reads, got, read = _set_and_read(
            tree, jnp.asarray(indices), jnp.asarray(values), jnp.asarray(probe)
        )
        _assign(ref, indices, values)
        _check_against(tree, ref, reads)
        np.testing.assert_array_equal(np.asarray(got), ref[probe])
        np.testing.assert_array_equal(np.asarray(read), ref[probe])


def _built(case) -> tuple[SumTree, np.ndarray]:
    """The tree after a drawn sequence of batched sets, and its NumPy reference leaves."""
    capacity, layout, batches = case
    tree = SumTree(capacity, *layout)
    ref = np.zeros(capacity, np.float32)
    for indices, values in batches:
        tree = _set(tree, jnp.asarray(indices), jnp.asarray(values))
        _assign(ref, indices, values)
    return tree, ref


@eqx.filter_jit
def _searched(tree, middles, key):
    """`search(middles)`, and `sample` and `sample_values` of 64 draws with `key`
    (stratified, then not): one compiled call."""
    draws = [
        (tree.sample(key, 64, stratified=s), tree.sample_values(key, 64, stratified=s))
        for s in (True, False)
    ]
    return tree.search(middles), draws


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
    searched, sampled = _searched(tree, jnp.asarray(middles), jax.random.key(seed))
    # `search` finds the same leaves and gives their exact values.
    leaves, values = (np.asarray(x) for x in searched)
    np.testing.assert_array_equal(leaves[: clear.size], clear)
    np.testing.assert_array_equal(values, ref[leaves])
    # Draws (stratified or not) only ever land on leaves of positive priority, including for
    # prefixes at and past the total; `sample_values` draws the same leaves as `sample` and
    # gives their exact values.
    for draws, (same, values) in sampled:
        assert (ref[np.asarray(draws)] > 0).all()
        np.testing.assert_array_equal(np.asarray(same), np.asarray(draws))
        np.testing.assert_array_equal(np.asarray(values), ref[np.asarray(draws)])
    total = np.float32(_reads(tree)[1])
    edge = np.array([total, np.nextafter(total, np.float32(np.inf))] * (capacity // 2 + 1))
    assert (ref[np.asarray(_find(tree, jnp.asarray(edge[:capacity], jnp.float32)))] > 0).all()


@eqx.filter_jit
def _block_and_scattered(tree, start, values, leaves):
    """`write_block(start, values)` and `write(leaves, values)`: one compiled call."""
    return tree.write_block(start, values), tree.write(leaves, values)


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
    leaves = (start + np.arange(m)) % capacity
    block, scattered = _block_and_scattered(
        tree, jnp.int32(start), jnp.asarray(values, np.float32), jnp.asarray(leaves)
    )
    ref[leaves] = _flushed(values)
    _check_against(block, ref)
    np.testing.assert_allclose(np.asarray(block.nodes), np.asarray(scattered.nodes), rtol=1e-6)


def _flushed(values: np.ndarray) -> np.ndarray:
    """The leaves a write stores: float32, subnormal values as 0 (documented)."""
    values = np.asarray(values, np.float32)
    return np.where(values < np.finfo(np.float32).tiny, np.float32(0), values)


@eqx.filter_jit
def _subnormal_writes(tree, indices, values, start):
    """The three writes of `values` (`set`, `write`, `write_block` at `start`), each with its
    `_reads`, and the total and leaves after `set` of leaf 4 to 5e-42 alone: one compiled
    call."""
    ways = [
        tree.set(indices, values),
        tree.write(indices, values),
        tree.write_block(start, values),
    ]
    alone = tree.set(jnp.array([4]), jnp.array([5e-42], jnp.float32))
    return [(w, _reads(w)) for w in ways], (alone.total(), alone.values())


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
    ways, alone = _subnormal_writes(tree, indices, jnp.asarray(values), jnp.int32(0))
    for written, reads in ways:
        np.testing.assert_array_equal(np.asarray(reads[0])[:6], expect)
        _check_against(written, np.pad(expect, (0, 5)), reads)
    total, leaves = alone
    assert float(total) == 0.0 and not np.asarray(leaves).any()


@pytest.mark.parametrize("layout", [(2, 1), (16, 2048)])
def test_duplicate_indices_the_last_wins(layout):
    """Documented: the last value given for a repeated index is written, as in NumPy, and
    the nodes above agree with it."""
    indices = jnp.array([3, 5, 3, 3, 5, 9])
    values = jnp.array([1.0, 2.0, 7.0, 4.0, 0.0, 0.5])
    for set_ in (SumTree.set, _set):
        tree = set_(SumTree(10, *layout), indices, values)
        assert np.asarray(_get(tree, jnp.array([3, 5, 9]))).tolist() == [4.0, 0.0, 0.5]
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


def _patched(in_turn: int, pairwise: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(unittest.mock.patch.object(_writes, "IN_TURN", in_turn))
    stack.enter_context(unittest.mock.patch.object(_writes, "PAIRWISE", pairwise))
    return stack


def _way(fn, in_turn: int, pairwise: int):
    """`fn` jitted, traced with `_writes.IN_TURN` and `_writes.PAIRWISE` patched to
    `in_turn` and `pairwise`: a jitted function of its own (a new closure, so that no
    compiled program of another way, or of `fn` jitted elsewhere, is reused)."""

    def way(*args, **kwargs):
        with _patched(in_turn, pairwise):
            return fn(*args, **kwargs)

    return eqx.filter_jit(way)


def _ways(write, reads) -> list:
    """`write` with a mask, then without one, and the `reads` of the tree after each (one
    compiled call), in the three ways a write of a small batch can go on the CPU: one entry
    after the other (the default there), and by one scatter per level (elsewhere's way)
    after the pairwise comparison or after the marks; each jitted by a function of its own
    (`_way`)."""

    def masked_then_not(tree, indices, values, mask, back_indices, back_values):
        masked = write(tree, indices, values, mask=mask)
        unmasked = write(masked, back_indices, back_values)
        return masked, reads(masked), unmasked, reads(unmasked)

    ways = [(_writes.IN_TURN, _writes.PAIRWISE), (0, 64), (0, 0)]
    return [_way(masked_then_not, in_turn, pairwise) for in_turn, pairwise in ways]


_WRITE_WAYS = _ways(SumTree.write, _reads)


@settings(max_examples=budget(25), deadline=None)
@given(_masked_writes())
def test_write_with_repeated_indices_matches_numpy(case):
    """`write` with and without a mask: the last entry not skipped wins for every leaf, one
    entry after the other (a small batch on the CPU), and by scatters after the pairwise
    comparison or the marks (each way jitted by a function of its own, so that no compiled
    program of another way is reused)."""
    capacity, layout, batches = case
    for write in _WRITE_WAYS:
        tree = SumTree(capacity, *layout)
        ref = np.zeros(capacity, np.float32)
        for indices, values, mask in batches:
            masked, reads, tree, back_reads = write(  # then `indices[::-1]`, no mask
                tree, *(jnp.asarray(x) for x in (indices, values, mask, indices[::-1], values))
            )
            _assign(ref, indices, values, mask)
            _check_against(masked, ref, reads)
            _assign(ref, indices[::-1], values)
            _check_against(tree, ref, back_reads)


# `_writes.last_of_each` by the pairwise comparison (the default for a small batch) and by the
# marks, each jitted by a function of its own (`_way`).
_LAST_OF_EACH = [_way(_writes.last_of_each, _writes.IN_TURN, pairwise) for pairwise in (64, 0)]


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
    tree = _set(SumTree(6), jnp.arange(6), jnp.full(6, 0.5))
    target = jnp.asarray(np.where(mask, indices, end).astype(np.int32))
    last = {int(i): j for j, (i, m) in enumerate(zip(indices, mask, strict=True)) if m}
    for last_of_each in _LAST_OF_EACH:
        nodes, written = last_of_each(tree.nodes, 6, jnp.asarray(indices), target, end)
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


@eqx.filter_jit
def _draws_before_and_after_zero(tree, values, keys):
    """4096 independent draws after `set` of every leaf to `values`; then, after `set` of
    leaf 36 to 0, the total and 4096 stratified draws: one compiled call."""
    tree = tree.set(jnp.arange(values.shape[0]), values)
    before = tree.sample(keys[0], 4096, stratified=False)
    tree = tree.set(jnp.array([36]), jnp.array([0.0]))
    return before, tree.total(), tree.sample(keys[1], 4096)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_priorities_are_never_drawn(layout):
    tree = SumTree(37, *layout)
    values = np.zeros(37, np.float32)
    values[[0, 17, 36]] = [1.0, 1e-6, 5.0]
    keys = (jax.random.key(0), jax.random.key(1))
    before, total, after = _draws_before_and_after_zero(tree, jnp.asarray(values), keys)
    draws = np.asarray(before)
    assert set(np.unique(draws).tolist()) <= {0, 17, 36}
    # Setting a leaf back to zero removes it exactly.
    assert float(total) == pytest.approx(1.0 + 1e-6)
    draws = np.asarray(after)
    assert set(np.unique(draws).tolist()) <= {0, 17}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stratified", [True, False])
def test_sampling_frequencies_chi_square(layout, stratified):
    capacity = 23  # not a power of two, nor a multiple of any fanout tried
    rng = np.random.default_rng(0)
    values = rng.gamma(1.0, size=capacity).astype(np.float32)
    values[[4, 9]] = 0.0
    tree = _set(SumTree(capacity, *layout), jnp.arange(capacity), jnp.asarray(values))
    keys = jax.random.split(jax.random.key(3), 40)
    draws = jax.jit(jax.vmap(lambda k: tree.sample(k, 512, stratified=stratified)))(keys)
    counts = np.bincount(np.asarray(draws).ravel(), minlength=capacity)
    assert chi_square_pvalue(counts, values) > 1e-3


@eqx.filter_jit
def _capacity_one(tree, binary, key):
    """`tree` (of capacity 1)'s total; after `set` of leaf 0 twice, its total and 5 draws;
    the leaves of `binary` (of capacity 1) after `set` of leaf 0: one compiled call."""
    empty = tree.total()
    tree = tree.set(jnp.array([0, 0]), jnp.array([2.0, 3.0]))
    binary = binary.set(jnp.array([0]), jnp.array([1.0]))
    return empty, tree.total(), tree.sample(key, 5), binary.values()


def test_capacity_one():
    empty, total, draws, leaves = _capacity_one(SumTree(1), SumTree(1, 2), jax.random.key(0))
    assert float(empty) == 0.0
    assert float(total) in (2.0, 3.0)
    np.testing.assert_array_equal(np.asarray(draws), np.zeros(5))
    np.testing.assert_array_equal(np.asarray(leaves), [1.0])


def test_large_batch_takes_the_dense_rebuild_path():
    # A batch as large as the tree rebuilds every level in one pass; same result.
    rng = np.random.default_rng(1)
    indices = rng.integers(0, 50, size=200).astype(np.int32)
    values = rng.random(200).astype(np.float32)
    ref = np.zeros(50, np.float32)
    for fanout in (2, 4):
        tree = _set(SumTree(50, fanout, 1), jnp.asarray(indices), jnp.asarray(values))
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
    trees = jax.jit(jax.vmap(lambda v: SumTree(6).set(jnp.arange(6), v)))(jnp.eye(6))
    sample = jax.jit(jax.vmap(lambda t, k: t.sample(k, 3)))
    draws = sample(trees, jax.random.split(jax.random.key(0), 6))
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


@eqx.filter_jit
def _trees_reads(trees: SumTrees) -> tuple:
    """Every tree as a `SumTree` with its `_reads`, `values()` and `totals()`: one compiled
    call per layout."""
    each = [trees.tree(t) for t in range(trees.trees)]
    return [(tree, _reads(tree)) for tree in each], trees.values(), trees.totals()


def _check_trees(reads: tuple, ref: np.ndarray) -> None:
    """Every tree's row against its NumPy leaves (as a `SumTree`), and the batched reads
    (`reads`: the trees' `_trees_reads`)."""
    each, values, totals = reads
    assert len(each) == ref.shape[0]
    for t, (tree, reads) in enumerate(each):
        _check_against(tree, ref[t], reads)
    np.testing.assert_array_equal(np.asarray(values), ref)
    roots = [float(reads[1]) for _, reads in each]  # each tree's `total()`
    np.testing.assert_array_equal(np.asarray(totals), roots)


_trees_write = eqx.filter_jit(SumTrees.write)
_TREES_WRITE_WAYS = _ways(SumTrees.write, _trees_reads)


@settings(max_examples=budget(25), deadline=None)
@given(_tree_writes())
def test_sum_trees_write_matches_numpy(case):
    """`SumTrees.write`: for every `(tree, leaf)` the last entry not skipped wins, one entry
    after the other, by scatters after the pairwise comparison and after the marks (each way
    jitted by a function of its own), and every tree's nodes are the sums of their children;
    no write touches another tree."""
    count, capacity, layout, batches = case
    for write in _TREES_WRITE_WAYS:
        trees = SumTrees(count, capacity, *layout)
        ref = np.zeros((count, capacity), np.float32)
        for tree, leaf, values, mask in batches:
            at = (jnp.asarray(tree, jnp.int32), jnp.asarray(leaf))
            _, reads, trees, back_reads = write(  # then `values[::-1]`, no mask
                trees, at, jnp.asarray(values), jnp.asarray(mask), at, jnp.asarray(values[::-1])
            )
            for t in range(count):
                mine = tree == t
                _assign(ref[t], leaf[mine], values[mine], mask[mine])
            _check_trees(reads, ref)
            for t in range(count):
                _assign(ref[t], leaf[tree == t], values[::-1][tree == t])
            _check_trees(back_reads, ref)


@eqx.filter_jit
def _written_values(trees, at, values):
    """The leaves of every tree (`tree(t).values()`) after `write(at, values)`."""
    written = trees.write(at, values)
    return [written.tree(t).values() for t in range(written.trees)]


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
    written = _written_values(trees, at, values)
    entries = [np.asarray(x) for x in (*at, values)]  # (read once, not element by element)
    for t in range(3):  # the last value of each (tree, leaf)
        last = {int(leaf): float(v) for tr, leaf, v in zip(*entries, strict=True) if tr == t}
        got = np.asarray(written[t])
        assert {i: float(got[i]) for i in last} == last and float(got[2:].sum()) == 0


def _filled_trees(count: int, capacity: int, layout, seed: int) -> tuple[SumTrees, np.ndarray]:
    """`count` trees of random leaves, about half of them 0 (tree 0 all 0)."""
    rng = np.random.default_rng(seed)
    ref = (rng.random((count, capacity)) * (rng.random((count, capacity)) < 0.5)).astype(np.float32)
    ref[0] = 0.0
    tree, leaf = np.divmod(np.arange(count * capacity), capacity)
    trees = SumTrees(count, capacity, *layout)
    at = (jnp.asarray(tree, jnp.int32), jnp.asarray(leaf, jnp.int32))
    return _trees_write(trees, at, jnp.asarray(ref.reshape(-1)), unique_indices=True), ref


def _subsets(prefix: np.ndarray, masks: dict) -> dict:
    """`{t: prefix[masks[t]]}`, as JAX arrays."""
    return {t: jnp.asarray(prefix[mask]) for t, mask in masks.items()}


@eqx.filter_jit
def _each_search(trees, each):
    """`trees.tree(t).search(each[t])` for every `t` of `each`: one compiled call. (Not
    `trees.search` of a wide top level: XLA takes about 10 s to compile that search, which
    eagerly runs in under 1 s.)"""
    return {t: trees.tree(t).search(p) for t, p in each.items()}


# The quick session: the default layout; every layout in `tests-all`.
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
    totals = np.asarray(_trees_reads(trees)[2])[tree]
    prefix = (rng.random(200) * totals).astype(np.float32)
    prefix[:20] = totals[:20]
    prefix[20:40] = np.nextafter(totals[20:40], np.float32(np.inf))
    mine = {t: tree == t for t in range(1, count)}
    leaves, values = (np.asarray(x) for x in trees.search(jnp.asarray(tree), jnp.asarray(prefix)))
    each = _each_search(trees, _subsets(prefix, mine))
    for t in range(1, count):
        mine = tree == t
        want_leaves, want_values = each[t]
        np.testing.assert_array_equal(leaves[mine], np.asarray(want_leaves))
        np.testing.assert_array_equal(values[mine], np.asarray(want_values))
        assert (ref[t, leaves[mine]] > 0).all()
    np.testing.assert_array_equal(values, ref[tree, leaves])


@eqx.filter_jit
def _block_totals(trees, blocks):
    """`trees.block_totals(blocks)`, and every `trees.tree(t).block_totals(blocks)`."""
    return trees.block_totals(blocks), [
        trees.tree(t).block_totals(blocks) for t in range(trees.trees)
    ]


@eqx.filter_jit
def _block_searches(trees, tree, prefix):
    """`trees.search_blocks(tree, prefix)`, and every `trees.tree(t).search_blocks(prefix)`."""
    each = [trees.tree(t).search_blocks(prefix) for t in range(trees.trees)]
    return trees.search_blocks(tree, prefix), each


# The quick session: 2 blocks of the default layout and of a deep binary tree; the other
# blocks and layouts in `tests-all`.
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
    trees = _trees_write(  # (tree 0 positive too, in every block)
        trees,
        (jnp.zeros(blocks, jnp.int32), jnp.arange(blocks, dtype=jnp.int32) * (capacity // blocks)),
        jnp.ones(blocks),
    )
    totals, each_totals = _block_totals(trees, blocks)
    totals = np.asarray(totals)
    for t in range(count):
        np.testing.assert_array_equal(totals[t], np.asarray(each_totals[t]))
    rng = np.random.default_rng(blocks)
    tree = rng.integers(0, count, (blocks, per)).astype(np.int32)
    limit = np.take_along_axis(totals.T, tree, axis=1)
    prefix = (rng.random((blocks, per)) * limit).astype(np.float32)
    prefix[:, 0] = limit[:, 0]  # at the block's total: its last positive leaf
    found, each = _block_searches(trees, jnp.asarray(tree), jnp.asarray(prefix))
    leaves, values = (np.asarray(x) for x in found)
    for t in range(count):
        mine = tree == t
        want_leaves, want_values = each[t]
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
