"""A prioritised training step updates its buffer in place: compiled with the buffer donated,
the step every PER user writes (sample; a loss weighted by the sample's importance weights,
or by its probabilities; `set_priorities` from the TD errors; with or without an add
first) holds no copy of a sum tree, of the storage or of any other array of the buffer's
size, for every prioritised kind. A read of the tree that only the weights use (the total
in `leaf / total`) used to make XLA copy the whole tree twice per step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import equibuffer as eb
from equibuffer._checks import BARRIER_EXPANDED
from equibuffer._sumtree import SumTrees

from .helpers import compiled_hlo, copies, spread
from .mesh_kinds import add, batch, cluster_of, EXAMPLE, kinds, prioritised_kinds


BATCH = 16
ROWS = 2
# Every array of the buffer that grows with the capacity (sum trees, storage, episode flags)
# has at least this many elements; everything else in the step (the batch, the parameters,
# the counters) far fewer.
LENGTH = 2048


KINDS = prioritised_kinds(ROWS, LENGTH)


class TrainState(eqx.Module):
    params: jax.Array
    buffer: eb.AbstractSource | eb.RateLimited


def _draw(buffer, key, row_blocks: int):
    kw = {} if row_blocks == 1 else {"row_blocks": row_blocks}
    sample = buffer.sample(key, BATCH, beta=0.4, **kw)
    if isinstance(buffer, eb.RateLimited):
        return sample  # (limited, sample)
    return buffer, sample


def _features(sample) -> jax.Array:
    leaves = jax.tree.leaves(sample.experience)
    return jnp.concatenate([x.reshape(BATCH, -1).astype(jnp.float32) for x in leaves], axis=1)


def _importance(sample, by: str) -> jax.Array:
    """What the loss is weighted by: the sample's weights, weights a user computes from its
    probabilities (beta = 1; a mix's from its sources' samples), or nothing."""
    if by == "weights":
        return sample.weights
    if by == "none":
        return jnp.ones(BATCH)
    if isinstance(sample, eb.MixedSample):
        p = jnp.concatenate([s.probabilities for s in sample.samples])
    else:
        p = sample.probabilities
    return jnp.min(p) / p


def _train_step(by: str, row_blocks: int = 1, adds: bool = False):
    """Sample, a linear Q's loss weighted by the sample, one SGD step, `set_priorities` from
    the TD errors: the step of every PER user (after an add of `batch(0, ROWS)` if
    `adds`)."""

    def step(state: TrainState, key) -> TrainState:
        buffer = state.buffer
        if adds:
            new = batch(0, ROWS)
            buffer = buffer.add(new) if isinstance(buffer, eb.RateLimited) else add(buffer, new)
        buffer, sample = _draw(buffer, key, row_blocks)
        x = _features(sample)
        weight = _importance(sample, by)

        def loss(params):
            return jnp.mean(weight * (x @ params - 1.0) ** 2)

        td = x @ state.params - 1.0
        params = state.params - 1e-3 * jax.grad(loss)(state.params)
        return TrainState(params, buffer.set_priorities(sample, jnp.abs(td) + 1e-3))

    return step


def _state(kind: str, row_blocks: int = 1) -> TrainState:
    buffer = KINDS[kind]()
    _, sample = jax.eval_shape(lambda b: _draw(b, jax.random.key(0), row_blocks), buffer)
    features = jax.eval_shape(_features, sample).shape[1]
    return TrainState(jnp.zeros(features), buffer)


def _assert_in_place(step, state: TrainState) -> None:
    sizes = copies(step, state, jax.random.key(0))
    big = [n for n in sizes if n >= LENGTH]
    assert not big, f"the step copies arrays of {big} elements (the buffer's are >= {LENGTH})"


@pytest.mark.parametrize("kind", spread(sorted(KINDS)))
def test_prioritised_step_updates_in_place(kind):
    _assert_in_place(_train_step("weights"), _state(kind))


@pytest.mark.parametrize("kind", ["item", "clustered", "mixer"])
def test_prioritised_step_weighted_by_probabilities_updates_in_place(kind):
    """Weights a user computes from `sample.probabilities` (which are read from the tree)."""
    _assert_in_place(_train_step("probabilities"), _state(kind))


@pytest.mark.parametrize("kind", spread(sorted(KINDS)))
def test_prioritised_step_with_an_add_updates_in_place(kind):
    """An add first: a prioritised episode rule reads the validity flags it then writes (it
    used to copy them); with jax 0.10 the ring's write of a block used to copy the storage."""
    _assert_in_place(_train_step("weights", adds=True), _state(kind))


@pytest.mark.parametrize("kind", ["trajectory", "episodes", "clustered"])
def test_prioritised_step_by_row_blocks_updates_in_place(kind):
    """With `row_blocks` the draw reads each block's total from the tree."""
    _assert_in_place(_train_step("weights", 2), _state(kind, row_blocks=2))


def test_a_weighted_loss_costs_no_copy_against_an_unweighted_one():
    """The check itself: the same step with an unweighted loss has no copy of the tree
    either, and the parse finds a copy where there is one (a tree read after its write)."""

    def copied(state: TrainState, key) -> tuple:
        tree = state.buffer.tree
        return tree.write(jnp.arange(4), jnp.ones(4)), tree.total()

    state = _state("item")
    assert max(copies(copied, state, jax.random.key(0))) >= LENGTH
    _assert_in_place(_train_step("none"), state)


@pytest.mark.parametrize("kind", spread(sorted(kinds(ROWS, LENGTH))))
def test_an_add_of_a_block_updates_in_place(kind):
    """Every kind's add of several steps per row, donated: no copy of the storage (on the CPU
    a block that fits is one `dynamic_update_slice`, chosen by a `cond` with jax >= 0.11,
    whose XLA keeps the branches in place; with jax 0.10 the scatter alone)."""
    buffer = kinds(ROWS, LENGTH)[kind]()
    sizes = copies(lambda b, new: add(b, new), buffer, batch(0, ROWS))
    big = [n for n in sizes if n >= LENGTH]
    assert not big, f"the add copies arrays of {big} elements (the buffer's are >= {LENGTH})"


@pytest.mark.parametrize("clusters", [1, 2, 3])
def test_clustered_trees_update_in_place(clusters):
    """A clustered buffer's trees are one flat array (`SumTrees`): the step with an add
    writes it in place with one cluster (`SumTree`'s program) and with several (its dense
    levels and roots are scatters to flat indices: as `dynamic_update_slice`s of a
    `(clusters, nodes)` view, XLA copied the array)."""
    buffer = eb.PrioritisedClusteredBuffer(
        EXAMPLE,
        add_batch_size=ROWS,
        num_clusters=clusters,
        cluster_capacity=LENGTH,
        cluster_fn=lambda item: cluster_of(item) % clusters,
    )
    _, sample = jax.eval_shape(lambda b: _draw(b, jax.random.key(0), 1), buffer)
    state = TrainState(jnp.zeros(jax.eval_shape(_features, sample).shape[1]), buffer)
    _assert_in_place(_train_step("weights", adds=True), state)


@pytest.mark.parametrize("kind", ["trajectory", "transition", "n_step_episodes", "episodes"])
def test_a_one_row_prioritised_add_updates_in_place(kind):
    """One environment (`add_batch_size=1`) on a tree of 8**4 leaves: its adds used to write
    the new leaves and their nodes as contiguous slices (`SumTree.write_block`), and XLA
    copied the whole tree twice per add (167 against 11 us at 10**6 leaves)."""
    buffer = prioritised_kinds(1, 2 * LENGTH)[kind]()
    for t in (1, 4):
        sizes = copies(lambda b, new: add(b, new), buffer, batch(0, 1, t))
        big = [n for n in sizes if n >= LENGTH]
        assert not big, f"an add of {t} steps copies arrays of {big} elements"


@pytest.mark.parametrize("leaves", [8**4, 8**5, 100_000])
@pytest.mark.parametrize("size", [2, 16, 64, 256])
def test_a_tree_write_of_any_batch_updates_in_place(leaves, size):
    """`SumTree.write` (sparse and dense levels), `write_block` and the clustered buffers'
    `SumTrees.write`, donated, for batches on both sides of where the levels turn dense:
    no copy of the tree. (The dense levels used to be written as a `dynamic_update_slice`
    of their sums: with 8**n leaves and a batch of 64 or more, XLA copied the tree twice.)"""
    indices, values = jnp.arange(size, dtype=jnp.int32) * 7 % leaves, jnp.ones(size)
    writes = {
        "write": (lambda t, i, v: t.write(i, v), eb.SumTree(leaves)),
        "write_block": (lambda t, i, v: t.write_block(i[0], v), eb.SumTree(leaves)),
        "trees": (lambda t, i, v: t.write((i % 3, i), v), SumTrees(3, leaves)),
    }
    for name, (write, tree) in writes.items():
        big = [n for n in copies(write, tree, indices, values) if n >= leaves]
        assert not big, f"{name} of {size} leaves copies arrays of {big} elements"


@pytest.mark.parametrize("size", [1, 2, 32])
def test_a_small_tree_write_on_the_cpu_goes_entry_by_entry(size):
    """A write of at most 32 leaves on the CPU (a one-step `add`, a small `set_priorities`)
    goes one entry after the other, its leaf and path one-element updates in place: no
    scatter into the tree and nothing split across threads. (XLA:CPU split a scatter of 2
    entries into a tree of 10**6 leaves across two threads by the size of the array it
    updates: 6.3 us per one-step add, 0.06 us now.) Elsewhere the write keeps its scatters
    (lowered for a GPU), where a loop over the entries would run each level as a kernel;
    before jax 0.11 (whose XLA drops the barrier that way needs) the CPU keeps them too."""
    leaves = 8**5
    indices, values = jnp.arange(size, dtype=jnp.int32) * 7 % leaves, jnp.ones(size)
    writes = {
        "write": (lambda t, i, v: t.write(i, v), eb.SumTree(leaves)),
        "trees": (lambda t, i, v: t.write((i % 3, i), v), SumTrees(3, leaves)),
    }
    for name, (write, tree) in writes.items():
        hlo = compiled_hlo(write, tree, indices, values, donate=True)
        if not BARRIER_EXPANDED:
            assert "scatter(" not in hlo and "dynamic-update-slice(" in hlo, name
            assert "outer_dimension_partitions" not in hlo, name
        # (Everywhere: no copy of the tree.)
        assert not [n for n in copies(write, tree, indices, values) if n >= leaves], name
        lowered = jax.jit(write).trace(tree, indices, values).lower(lowering_platforms=("cuda",))
        assert "stablehlo.scatter" in lowered.as_text(), name


@pytest.mark.parametrize("size", [33, 256, 1024])
def test_a_tree_write_into_a_split_size_array_on_the_cpu_goes_entry_by_entry(size):
    """Up to 1024 entries into a node array of 512 KiB or more (8**6 leaves: 1.2 MB), which
    XLA:CPU would split across two threads for a scatter, the write goes one entry after the
    other too: nothing split (a jitted `set_priorities` of 256 at 5 * 10**5 windows waited
    ~40 us per call for the second thread), no copy of the tree. A smaller array keeps its
    scatters from 33 entries (they are faster there inside a scan)."""
    leaves = 8**6
    indices, values = jnp.arange(size, dtype=jnp.int32) * 7 % leaves, jnp.ones(size)
    write = lambda t, i, v: t.write(i, v)  # noqa: E731
    hlo = compiled_hlo(write, eb.SumTree(leaves), indices, values, donate=True)
    if not BARRIER_EXPANDED:
        assert "scatter(" not in hlo and "outer_dimension_partitions" not in hlo
    assert not [n for n in copies(write, eb.SumTree(leaves), indices, values) if n >= leaves]
    small = compiled_hlo(write, eb.SumTree(8**5), indices, values, donate=True)
    assert "scatter(" in small
