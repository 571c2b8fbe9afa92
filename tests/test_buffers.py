import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings
from hypothesis.stateful import initialize, invariant, rule

import equibuffer as eb
from equibuffer.testing import batches, buffer_configs, BufferReference, filled_buffers

from .helpers import budget, chi_square_pvalue, CountedMachine, stateful_settings
from .reference import tags


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


def _make(kind, rows, length, seq, period):
    if kind == "trajectory":
        return eb.TrajectoryBuffer(
            _example(), add_batch_size=rows, capacity=rows * length, sequence_length=seq,
            period=period,
        )  # fmt: skip
    if kind == "transition":
        return eb.TransitionBuffer(_example(), add_batch_size=rows, capacity=rows * length)
    return eb.ItemBuffer(_example(), add_batch_size=rows, capacity=rows * length)


def _contiguous(sample: eb.AbstractSample) -> None:
    """Each sampled window is consecutive steps of one row (`t` counts the steps)."""
    exp = sample.experience
    if isinstance(exp, eb.Transition):
        np.testing.assert_array_equal(np.asarray(exp.second["t"]), np.asarray(exp.first["t"]) + 1)
    elif np.ndim(exp["t"]) == 2:
        assert np.all(np.diff(np.asarray(exp["t"]), axis=1) == 1)


UNIFORM = [eb.TrajectoryBuffer, eb.TransitionBuffer, eb.ItemBuffer]


class BufferMachine(CountedMachine):
    """Random configurations (`equibuffer.testing.buffer_configs`), random adds (one step,
    several, a full ring, more than the ring; `batches`) and samples, each compared with the
    NumPy reference (`BufferReference.check_sample`)."""

    @initialize(
        config=buffer_configs(UNIFORM, example=_example(), n_step=None, episodes=False),
        seed=st.integers(0, 2**31 - 1),
    )
    def setup(self, config, seed):
        self.buffer = config.build()
        self.ref = BufferReference.from_buffer(self.buffer)
        self.key = jax.random.key(seed)

    @rule(t=st.one_of(st.none(), st.integers(1, 3), st.integers(6, 16)), data=st.data())
    def add(self, t, data):
        batch = data.draw(batches(self.buffer, steps=st.just(t)), label="batch")
        # `t` unique per (row, absolute step), so that data in the wrong place shows
        tag = tags(self.buffer.add_batch_size, self.ref.history.total, 1 if t is None else t)
        batch["t"] = jnp.asarray(tag[:, 0] if t is None else tag)
        self.buffer = self.buffer.add(batch)
        self.ref.add(batch)

    @rule(batch_size=st.integers(1, 9))
    def sample(self, batch_size):
        if not self.ref.ready():
            return
        self.key, key = jax.random.split(self.key)
        sample = self.buffer.sample(key, batch_size)
        self.ref.check_sample(sample)
        _contiguous(sample)

    @invariant()
    def counters_match(self):
        if not hasattr(self, "ref"):
            return
        b, ref = self.buffer, self.ref
        assert b.storage.steps_added() == ref.history.total
        assert int(b.storage.fill) == ref.history.fill
        assert int(b.size()) == ref.size()
        assert int(b.num_windows()) == ref.num_windows()
        assert bool(b.can_sample()) == ref.ready()


BufferMachine.TestCase.settings = stateful_settings(max_examples=15, stateful_step_count=10)
TestBufferMachine = pytest.mark.stateful(BufferMachine.TestCase)


@settings(max_examples=budget(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filled_buffers(buffer_configs(UNIFORM, n_step=None, episodes=False), reference=True))
def test_filled_uniform_buffers_match_the_reference(filled):
    """Any example structure and dtypes, any configuration, filled to any point."""
    buffer, ref = filled
    assert int(buffer.size()) == ref.size() and bool(buffer.can_sample()) == ref.ready()
    if ref.ready():
        ref.check_sample(eqx.filter_jit(lambda b: b.sample(jax.random.key(0), 32))(buffer))


@pytest.mark.parametrize("kind", ["trajectory", "transition", "item"])
def test_sample_under_jit_matches_reference(kind):
    rows, length = 3, 6
    buffer = _make(kind, rows, length, 3, 2)
    ref = BufferReference.from_buffer(buffer)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 64))
    for i, t in enumerate([2, 5, None, 9]):
        batch = _batch(rows, ref.history.total, t)
        buffer = add(buffer, batch)
        ref.add(batch)
        assert bool(buffer.can_sample()) == ref.ready() == bool(ref.valid())
        if ref.ready():
            drawn = sample(buffer, jax.random.key(i))
            ref.check_sample(drawn)
            _contiguous(drawn)


def _frequencies(buffer, ref, n=30_000, seed=0):
    sample = eqx.filter_jit(lambda b, k: b.sample(k, n))(buffer, jax.random.key(seed))
    cells = {w: i for i, w in enumerate(sorted(ref.valid()))}
    counts = np.zeros(len(cells))
    for window in ref.windows(sample):
        counts[cells[window]] += 1
    return counts


@pytest.mark.parametrize(
    "kind,seq,period",
    [("trajectory", 3, 2), ("trajectory", 4, 1), ("transition", 2, 1), ("item", 1, 1)],
)
def test_sampling_is_uniform_over_valid_windows(kind, seq, period):
    rows, length = 3, 11
    buffer = _make(kind, rows, length, seq, period)
    ref = BufferReference.from_buffer(buffer)
    for t in [7, 9]:  # 16 steps: the ring has wrapped
        batch = _batch(rows, ref.history.total, t)
        buffer, _ = buffer.add(batch), ref.add(batch)
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
