"""Restoring and loading every kind of buffer from its archive (`Archive.restore`, `load`, and
the buffers' `with_storage` they use): a restored buffer is a working buffer of its kind, every
piece of rule state rebuilt from the stored steps, priorities by the documented policy.

The fast tests build their archives in memory from a buffer of each kind (with `add`, which
leaves the ring `ring_holding` builds in the writer process: see
`test_ring_holding_matches_a_ring_that_saw_every_step`) and compare the restored buffer, leaf
for leaf, with that buffer; the slow one restores each kind from an
archive whose writer process was killed mid-write and checks the sampling law (chi-square)
against the NumPy reference model."""

import uuid
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zarr.storage

import equibuffer as eb
from equibuffer._archive import Archive
from equibuffer._archive._format import storage_of
from equibuffer.testing import BufferReference, flat_index

from .archive_writer import example, MAX_LENGTH, ROWS, values
from .helpers import chi_square_pvalue, spread_kept
from .test_archive import assert_tree_equal, crash_writer_many_times, expected


ALPHA = 1.0  # leaves are the priorities themselves: read back exactly


def episode_end(step: Any) -> Any:
    """Episodes end at the steps whose `flag` (step % 7) is 0. True on an unwritten (zero)
    slot too: a restored buffer must not take those for episode ends."""
    return step["flag"] == 0


def _kinds() -> dict[str, Callable[[], Any]]:
    ex = example()
    sizes: dict[str, Any] = dict(add_batch_size=ROWS, max_length_time_axis=MAX_LENGTH)
    episodes: dict[str, Any] = dict(sizes, sequence_length=3, episode_end=episode_end)
    return {
        "trajectory": lambda: eb.TrajectoryBuffer(ex, sequence_length=3, period=2, **sizes),
        "transition": lambda: eb.TransitionBuffer(ex, **sizes),
        "transition-episodes": lambda: eb.TransitionBuffer(ex, episode_end=episode_end, **sizes),
        "item": lambda: eb.ItemBuffer(ex, **sizes),
        "episodes": lambda: eb.EpisodeTrajectoryBuffer(ex, **episodes),
        "episodes-pad": lambda: eb.EpisodeTrajectoryBuffer(ex, mode="pad", **episodes),
        "prioritised-trajectory": lambda: eb.PrioritisedTrajectoryBuffer(
            ex, sequence_length=3, alpha=ALPHA, **sizes
        ),
        "prioritised-transition": lambda: eb.PrioritisedTransitionBuffer(ex, alpha=ALPHA, **sizes),
        "prioritised-item": lambda: eb.PrioritisedItemBuffer(ex, alpha=ALPHA, **sizes),
        "prioritised-episodes": lambda: eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, alpha=ALPHA, **episodes
        ),
        "prioritised-episodes-pad": lambda: eb.PrioritisedEpisodeTrajectoryBuffer(
            ex, alpha=ALPHA, mode="pad", **episodes
        ),
        "queue": lambda: eb.Queue(ex, sequence_length=4, **sizes),
    }


KINDS = _kinds()
PRIORITISED = [k for k in KINDS if k.startswith("prioritised")]


def arrays_equal(got: Any, want: Any) -> None:
    """The same pytree structure, and every array leaf equal."""
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# Each add jitted, as a training step runs it (compiled whole, not op by op).
_add = eqx.filter_jit(lambda buffer, batch: buffer.add(batch))


def written(kind: str, adds: tuple[int, ...]) -> tuple[zarr.storage.MemoryStore, Any]:
    """An archive (in memory) of a buffer of `kind` that received `adds` steps per row, one
    add and one write each; and that buffer."""
    store = zarr.storage.MemoryStore()
    buffer = KINDS[kind]()
    with Archive(store, buffer, progress=False, chunk_steps=4, shard_steps=8) as archive:
        total = 0
        for count in adds:
            if isinstance(buffer, eb.Queue):  # (a queue refuses to overwrite unread steps)
                buffer = buffer.with_storage(buffer.storage)  # every step read
            buffer = _add(buffer, values(ROWS, total, count))
            total += count
            assert archive.write(buffer) == count
    return store, buffer


def carry_on(archive: Archive, buffer: Any, total: int, getkey: Callable) -> Any:
    """The run goes on after a restore: an add, a write of exactly the new steps (none
    twice), a sample, and for a prioritised buffer `set_priorities` and another sample."""
    buffer = _add(buffer, values(ROWS, total, 5))
    assert archive.write(buffer) == 5
    assert_tree_equal(archive.read(), expected(0, total + 5))
    if isinstance(buffer, eb.Queue):
        buffer, sample = buffer.sample()
        want = values(ROWS, total, 4)  # the oldest 4 unread: only the 5 added are unread
        assert_tree_equal(jax.tree.map(np.asarray, sample.experience), want)
        return buffer
    sample = buffer.sample(getkey(), batch_size=8)
    if isinstance(buffer, eb.AbstractPrioritisedBuffer):
        buffer = buffer.set_priorities(sample, jnp.arange(1.0, 9.0))
        assert float(buffer.max_priority) > 1.0
        buffer.sample(getkey(), batch_size=8)
    return buffer


# ------------------------------------------------------------------------------ every kind


# The wrapped case of four kinds spread over the list (`spread`), and the partly filled one of
# the trajectory buffer, in the quick session; the other cases under `thorough`.
@pytest.mark.parametrize(
    ("kind", "adds"),
    [
        pytest.param(
            kind,
            adds,
            id=f"{kind}-{name}",
            marks=[pytest.mark.thorough]
            if (name == "partly-filled" and kind != "trajectory")
            or (name == "wrapped" and i not in spread_kept(len(KINDS)))
            else [],
        )
        for name, adds in [("partly-filled", (10,)), ("wrapped", (10, 17, 13))]
        for i, kind in enumerate(KINDS)
    ],
)
def test_a_restored_buffer_is_the_buffer_that_received_the_adds(kind, adds, getkey):
    """Restored into a new buffer, every kind holds what the buffer that received the adds
    holds, rule state included (episode flags, trees, valid windows, the largest priority):
    the same arrays, so the same law. A `Queue`'s steps all count as read. Then the run
    carries on: add, write (nothing twice), sample, `set_priorities`."""
    store, source = written(kind, adds)
    with Archive(store, KINDS[kind](), progress=False) as archive:
        restored = archive.restore(KINDS[kind]())
        if isinstance(restored, eb.Queue):
            arrays_equal(restored.storage, source.storage)
            assert int(restored.unread) == 0 and not bool(restored.can_sample())
        else:
            arrays_equal(restored, source)
        carry_on(archive, restored, sum(adds), getkey)


@pytest.mark.parametrize("kind", PRIORITISED)
def test_restored_windows_enter_at_the_documented_priority(kind):
    """Every valid window of a restored prioritised buffer is at `priority` when given (and
    `max_priority` becomes it), else at the buffer's own `max_priority`; windows not valid
    are at 0, also in a buffer that had priorities set before (`load` into a used buffer)."""
    store, source = written(kind, (10, 17, 13))
    valid = np.asarray(source.tree.values()) > 0
    with Archive(store, source, mode="r", progress=False) as archive:
        for priority, fresh in ((None, 1.0), (2.5, 2.5)):
            restored = archive.restore(KINDS[kind](), priority=priority)
            assert float(restored.max_priority) == fresh
            np.testing.assert_array_equal(np.asarray(restored.tree.values()), valid * fresh)
        # A used buffer: priorities set, its largest raised to 8; loaded with the first
        # 20 steps, whose valid windows are not those of the 40.
        used = source.set_priorities(source.sample(jax.random.key(0), 8), jnp.full(8, 8.0))
        assert float(used.max_priority) == 8.0
        loaded = archive.load(used, 0, 20)
        reference = archive.load(KINDS[kind](), 0, 20, priority=8.0)
        arrays_equal(loaded, reference)
        assert float(loaded.max_priority) == 8.0
        assert set(np.unique(np.asarray(loaded.tree.values())).tolist()) == {0.0, 8.0}


def test_with_storage_in_jit_does_not_retrace_and_matches_eager():
    kind = "prioritised-episodes"
    _, source = written(kind, (10, 17))

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def rebuilt(buffer, storage):
        return buffer.with_storage(storage)

    for _ in range(2):
        arrays_equal(rebuilt(KINDS[kind](), source.storage), source)
    arrays_equal(KINDS[kind]().with_storage(source.storage), source)


def test_update_keeps_priorities_with_storage_sets_them_anew():
    """`update` (the rule recomputed, not restored) keeps the priorities of the windows that
    stay valid; `with_storage` of the same ring sets them all to `max_priority`."""
    _, source = written("prioritised-episodes", (10, 17))
    used = source.set_priorities(source.sample(jax.random.key(0), 8), jnp.full(8, 3.0))
    kept = used.update(lambda step: step)
    arrays_equal(kept.tree, used.tree)
    anew = used.with_storage(used.storage)
    valid = np.asarray(used.tree.values()) > 0
    np.testing.assert_array_equal(np.asarray(anew.tree.values()), valid * 3.0)


# ---------------------------------------------------------------------------------- errors


def test_priority_is_refused_where_there_are_none_and_must_be_positive():
    store, _ = written("trajectory", (10,))
    with Archive(store, mode="r", progress=False) as archive:
        ring = eb.RingStorage(example(), rows=ROWS, length=MAX_LENGTH)
        for buffer, match in (
            (KINDS["trajectory"](), "draws its windows uniformly: drop `priority`"),
            (KINDS["queue"](), "a Queue has no priorities"),
            (ring, "a RingStorage has no priorities"),
        ):
            with pytest.raises(TypeError, match=match):
                archive.restore(buffer, priority=2.0)
        prioritised = KINDS["prioritised-item"]()
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="`priority` must be finite and > 0"):
                archive.load(prioritised, priority=bad)


def test_with_storage_refuses_a_ring_of_other_sizes_or_leaves():
    buffer = KINDS["episodes"]()
    other = eb.RingStorage(example(), rows=ROWS + 1, length=MAX_LENGTH)
    with pytest.raises(ValueError, match=r"rows=3 and length=24, the buffer add_batch_size=2"):
        buffer.with_storage(other)
    leaves = dict(example(), obs=jnp.zeros(5, jnp.float32))
    with pytest.raises(ValueError, match=r"leaf \['obs'\] of the storage has shape \(2, 24, 5\)"):
        buffer.with_storage(eb.RingStorage(leaves, rows=ROWS, length=MAX_LENGTH))
    with pytest.raises(ValueError, match="missing leaves"):
        buffer.with_storage(eb.RingStorage({"obs": jnp.zeros(4)}, rows=ROWS, length=MAX_LENGTH))


def test_kinds_an_archive_cannot_hold_are_refused_with_what_to_do():
    """A `RateLimited`, a `Mixer` and the clustered buffers are refused by `Archive()`,
    `write`, `restore` and `load` (`storage_of`, which each calls first: under the tests'
    runtime type checks the annotations refuse them before it), each error saying why and
    what to archive instead; so is a module that holds a ring but cannot rebuild the rest of
    its state."""
    ex = example()
    item = KINDS["item"]()
    cluster_fn = lambda step: (step["flag"] > 3).astype(jnp.int32)  # noqa: E731
    refused = {
        r"a RateLimited is not archived itself: give the archive the buffer it wraps, "
        r"`limited.buffer`": eb.RateLimited(item, samples_per_insert=1.0, tolerance=8.0),
        r"a Mixer draws from several buffers.*archive_i.restore\(mixer.buffers\[i\]\)": (
            eb.Mixer((item, KINDS["item"]()), proportions=(0.5, 0.5))
        ),
        "a ClusteredBuffer routes every item to one cluster's own ring": eb.ClusteredBuffer(
            ex, add_batch_size=ROWS, num_clusters=2, cluster_capacity=8, cluster_fn=cluster_fn
        ),
        "a PrioritisedClusteredBuffer routes": eb.PrioritisedClusteredBuffer(
            ex, add_batch_size=ROWS, num_clusters=2, cluster_capacity=8, cluster_fn=cluster_fn
        ),
        "expected a buffer \\(e.g. eb.TrajectoryBuffer\\) or an eb.RingStorage, got dict": {},
    }
    for match, buffer in refused.items():
        with pytest.raises(TypeError, match="^Archive.restore\\(\\): " + match):
            storage_of(buffer, "Archive.restore()")

    class Holder(eqx.Module):
        storage: eb.RingStorage

    store, _ = written("item", (4,))
    with Archive(store, mode="r", progress=False) as archive:
        with pytest.raises(TypeError, match="has no `with_storage\\(storage\\)` to rebuild"):
            archive.restore(Holder(item.storage))


# --------------------------------------------------------------------- a killed writer


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_resumes_from_the_archive_of_a_killed_writer(kind, tmp_path, getkey):
    """The issue's recipe: a writer process writes and is killed mid-write; in this process
    a new buffer of `kind` is restored from the archive and sampled. Uniform and
    episode-aware kinds draw by the law of a buffer that received every step (the NumPy
    reference: each sample checked, frequencies by chi-square); prioritised kinds hold every
    valid window at the priority given and draw them uniformly; then the run carries on
    (add, write with nothing written twice, sample, `set_priorities`)."""
    store = str(tmp_path / f"resume-{uuid.uuid4().hex}.zarr")
    crash_writer_many_times(store, None, 1, seed=7)
    fresh = KINDS[kind]()
    priority = 3.0 if kind in PRIORITISED else None
    with Archive(store, fresh, progress=False) as archive:
        total = len(archive)
        restored = archive.restore(fresh, priority=priority)
        assert restored.storage.steps_added() == total
        if isinstance(restored, eb.Queue):
            assert int(restored.unread) == 0
            carry_on(archive, restored, total, getkey)
            return
        reference = BufferReference.from_buffer(fresh)
        reference.add(values(ROWS, 0, total))
        reference.restore(priority=priority)
        valid = reference.valid()
        if priority is not None:
            leaves = np.asarray(restored.tree.values())
            at = [flat_index(w, MAX_LENGTH) for w in valid]
            assert float(restored.max_priority) == priority
            assert (leaves[at] == priority**ALPHA).all()
            assert leaves.sum() == len(valid) * priority**ALPHA
        reference.check_sample(restored.sample(getkey(), batch_size=64))
        draws = np.concatenate(
            [np.asarray(restored.sample(getkey(), batch_size=2000).indices) for _ in range(4)]
        )
        probs = np.zeros(ROWS * MAX_LENGTH)
        for w in valid:
            probs[flat_index(w, MAX_LENGTH)] = 1 / len(valid)
        counts = np.bincount(draws, minlength=probs.size)
        assert chi_square_pvalue(counts, probs) > 1e-3
        restored = carry_on(archive, restored, total, getkey)
        # And again, with nothing written twice.
        restored = restored.add(values(ROWS, total + 5, 3))
        assert archive.write(restored) == 3
        assert_tree_equal(archive.read(), expected(0, total + 8))
