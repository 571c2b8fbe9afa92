import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, rule

import equibuffer as eb

from .helpers import chi_square_pvalue, CountedMachine, ReferenceRing, stateful_settings


def _example():
    return {"obs": jnp.zeros(2, jnp.float32), "t": jnp.int32(0)}


def _batch(rows: int, start: int, t: int | None):
    """Steps `start .. start+T-1` of every row; values unique per (row, absolute step)."""
    n = 1 if t is None else t
    time = np.arange(start, start + n)
    tag = np.arange(rows)[:, None] * 100_000 + time[None, :]  # (rows, n)
    obs = np.stack([tag, -tag], axis=-1).astype(np.float32)
    batch = {"obs": obs, "t": tag.astype(np.int32)}
    if t is None:
        batch = {k: v[:, 0] for k, v in batch.items()}
    return jax.tree.map(jnp.asarray, batch)


def _check_sample(buffer, ref: ReferenceRing, sample: eb.Sample, sequence: bool):
    exp = sample.experience
    if isinstance(exp, eb.Transition):
        tags = np.stack([np.asarray(exp.first["t"]), np.asarray(exp.second["t"])], axis=1)
        obs = np.stack([np.asarray(exp.first["obs"]), np.asarray(exp.second["obs"])], axis=1)
    elif sequence:
        tags, obs = np.asarray(exp["t"]), np.asarray(exp["obs"])
    else:
        tags, obs = np.asarray(exp["t"])[:, None], np.asarray(exp["obs"])[:, None]
    valid = set(ref.valid_starts())
    pairs = zip(np.asarray(sample.indices), np.asarray(sample.steps), strict=True)
    for i, (index, step) in enumerate(pairs):
        row, slot = divmod(int(index), ref.length)
        start = int(step)
        assert start in valid, (start, sorted(valid))
        assert slot == start % ref.length
        window = ref.window(row, start)
        np.testing.assert_array_equal(tags[i], window)
        np.testing.assert_array_equal(obs[i], np.stack([window, -window], -1).astype(np.float32))
    # Contiguity in time of one row, stated directly.
    assert np.all(np.diff(tags, axis=1) == 1)


def _make(kind, rows, length, seq, period):
    if kind == "trajectory":
        return eb.TrajectoryBuffer(
            _example(),
            add_batch_size=rows,
            max_length_time_axis=length,
            sequence_length=seq,
            period=period,
        )
    if kind == "transition":
        return eb.TransitionBuffer(_example(), add_batch_size=rows, max_length_time_axis=length)
    return eb.ItemBuffer(_example(), add_batch_size=rows, max_length_time_axis=length)


class BufferMachine(CountedMachine):
    """Random adds (one step, several, a full ring, more than the ring) and samples, each
    compared with the NumPy reference at the returned indices."""

    @initialize(
        kind=st.sampled_from(["trajectory", "transition", "item"]),
        rows=st.integers(1, 3),
        length=st.integers(2, 7),
        data=st.data(),
    )
    def setup(self, kind, rows, length, data):
        if kind == "trajectory":
            seq = data.draw(st.integers(1, length))
            period = data.draw(st.integers(1, 4))
        else:
            seq, period = {"transition": 2, "item": 1}[kind], 1
        self.kind = kind
        self.buffer = _make(kind, rows, length, seq, period)
        self.ref = ReferenceRing(rows, length, seq, period)
        self.key = jax.random.key(data.draw(st.integers(0, 2**31 - 1)))

    @rule(t=st.one_of(st.none(), st.integers(1, 3), st.integers(6, 16)))
    def add(self, t):
        batch = _batch(self.ref.rows, self.ref.total, t)
        self.buffer = self.buffer.add(batch)
        self.ref.add(np.asarray(batch["t"])[:, None] if t is None else np.asarray(batch["t"]))

    @rule(batch_size=st.integers(1, 9))
    def sample(self, batch_size):
        if not self.buffer.can_sample():
            return
        self.key, key = jax.random.split(self.key)
        sample = self.buffer.sample(key, batch_size)
        _check_sample(self.buffer, self.ref, sample, sequence=self.kind == "trajectory")

    @invariant()
    def counters_match(self):
        if not hasattr(self, "ref"):
            return
        b, ref = self.buffer, self.ref
        assert b.storage.steps_added() == ref.total
        assert int(b.storage.fill) == ref.fill
        assert int(b.size()) == ref.fill * ref.rows
        assert int(b.num_windows()) == len(ref.valid_starts()) * ref.rows
        assert bool(b.can_sample()) == (
            ref.fill >= b.min_length_time_axis and bool(ref.valid_starts())
        )


BufferMachine.TestCase.settings = stateful_settings(max_examples=15, stateful_step_count=10)
TestBufferMachine = pytest.mark.stateful(BufferMachine.TestCase)


@pytest.mark.parametrize("kind", ["trajectory", "transition", "item"])
def test_sample_under_jit_matches_reference(kind):
    rows, length = 3, 6
    buffer, ref = _make(kind, rows, length, 3, 2), ReferenceRing(rows, length, 3, 2)
    if kind != "trajectory":
        ref.sequence_length, ref.period = {"transition": 2, "item": 1}[kind], 1
    add = eqx.filter_jit(lambda b, x: b.add(x))
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 64))
    for i, t in enumerate([2, 5, None, 9]):
        batch = _batch(rows, ref.total, t)
        buffer = add(buffer, batch)
        ref.add(np.asarray(batch["t"])[:, None] if t is None else np.asarray(batch["t"]))
        assert bool(buffer.can_sample()) == bool(ref.valid_starts())
        if ref.valid_starts():
            _check_sample(buffer, ref, sample(buffer, jax.random.key(i)), kind == "trajectory")


def _frequencies(buffer, ref, n=30_000, seed=0):
    sample = eqx.filter_jit(lambda b, k: b.sample(k, n))(buffer, jax.random.key(seed))
    starts = ref.valid_starts()
    cells = {(r, s): i for i, (r, s) in enumerate((r, s) for r in range(ref.rows) for s in starts)}
    counts = np.zeros(len(cells))
    for index, step in zip(np.asarray(sample.indices), np.asarray(sample.steps), strict=True):
        counts[cells[(int(index) // ref.length, int(step))]] += 1
    return counts


@pytest.mark.parametrize(
    "kind,seq,period",
    [("trajectory", 3, 2), ("trajectory", 4, 1), ("transition", 2, 1), ("item", 1, 1)],
)
def test_sampling_is_uniform_over_valid_windows(kind, seq, period):
    rows, length = 3, 11
    buffer, ref = _make(kind, rows, length, seq, period), ReferenceRing(rows, length, seq, period)
    for t in [7, 9]:  # 16 steps: the ring has wrapped
        batch = _batch(rows, ref.total, t)
        buffer, _ = buffer.add(batch), ref.add(np.asarray(batch["t"]))
    counts = _frequencies(buffer, ref)
    assert np.all(counts > 0)
    assert chi_square_pvalue(counts, np.ones_like(counts)) > 1e-3


def test_period_windows_start_at_multiples_of_period():
    buffer = eb.TrajectoryBuffer(
        _example(), add_batch_size=1, max_length_time_axis=10, sequence_length=3, period=4
    )
    buffer = buffer.add(_batch(1, 0, 13))  # holds steps 3..12; starts 4 and 8 are valid
    steps = np.asarray(buffer.sample(jax.random.key(0), 200).steps)
    assert set(steps.tolist()) == {4, 8}


def test_capacity_rounds_up_never_down():
    buffer = eb.TransitionBuffer(_example(), add_batch_size=4, capacity=10)
    assert buffer.max_length_time_axis == 3 and buffer.capacity == 12 >= 10
    exact = eb.ItemBuffer(_example(), add_batch_size=4, max_size=12)
    assert exact.max_length_time_axis == 3 and exact.capacity == 12


def test_storage_is_not_tied_to_number_of_envs():
    few = eb.TransitionBuffer(_example(), add_batch_size=2, capacity=1000)
    many = eb.TransitionBuffer(_example(), add_batch_size=100, capacity=1000)
    assert few.capacity == many.capacity == 1000


def test_structure_shapes_dtypes_never_change():
    buffer = _make("trajectory", 2, 5, 2, 1)
    spec = jax.tree.map(lambda x: (x.shape, x.dtype), buffer)
    structure = jax.tree.structure(buffer)
    buffer = buffer.add(_batch(2, 0, 7))
    buffer.sample(jax.random.key(0), 4)
    assert jax.tree.structure(buffer) == structure
    assert jax.tree.map(lambda x: (x.shape, x.dtype), buffer) == spec


def test_add_returns_new_buffer_and_leaves_original():
    buffer = _make("item", 1, 3, 1, 1)
    new = buffer.add(_batch(1, 0, 2))
    assert int(buffer.size()) == 0 and int(new.size()) == 2
    assert np.all(np.asarray(buffer.storage.data["t"]) == 0)
