import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, precondition, rule

import equibuffer as eb
from equibuffer._buffers._prioritised import (
    PrioritisedItemBuffer,
    PrioritisedSample,
    PrioritisedTrajectoryBuffer,
    PrioritisedTransitionBuffer,
)

from .helpers import chi_square_pvalue, CountedMachine, ReferenceRing, stateful_settings


def _example():
    return {"obs": jnp.zeros(2, jnp.float32), "t": jnp.int32(0)}


def _batch(rows: int, start: int, t: int | None):
    """Steps `start .. start+T-1` of every row; values unique per (row, absolute step)."""
    n = 1 if t is None else t
    tag = np.arange(rows)[:, None] * 100_000 + np.arange(start, start + n)[None, :]
    batch = {"obs": np.stack([tag, -tag], axis=-1).astype(np.float32), "t": tag.astype(np.int32)}
    if t is None:
        batch = {k: v[:, 0] for k, v in batch.items()}
    return jax.tree.map(jnp.asarray, batch)


def _make(kind, rows, length, seq=1, period=1, alpha=0.6):
    if kind == "trajectory":
        return PrioritisedTrajectoryBuffer(
            _example(),
            add_batch_size=rows,
            max_length_time_axis=length,
            sequence_length=seq,
            period=period,
            alpha=alpha,
        )
    cls = {"transition": PrioritisedTransitionBuffer, "item": PrioritisedItemBuffer}[kind]
    return cls(_example(), add_batch_size=rows, max_length_time_axis=length, alpha=alpha)


def _tags(sample, kind):
    exp = sample.experience
    if kind == "transition":
        return np.stack([np.asarray(exp.first["t"]), np.asarray(exp.second["t"])], axis=1)
    if kind == "trajectory":
        return np.asarray(exp["t"])
    return np.asarray(exp["t"])[:, None]


class PrioritisedReference(ReferenceRing):
    """The ring reference plus a priority per valid window `(row, absolute start)`."""

    def __init__(self, rows, length, sequence_length, period, alpha):
        super().__init__(rows, length, sequence_length, period)
        self.alpha = alpha
        self.max_priority = np.float32(1.0)
        self.priority: dict[tuple[int, int], np.float32] = {}

    def add(self, batch):
        super().add(batch)
        valid = {(r, s) for r in range(self.rows) for s in self.valid_starts()}
        self.priority = {w: self.priority.get(w, self.max_priority) for w in valid}

    def set(self, indices, steps, priorities):
        for index, step, p in zip(indices, steps, priorities, strict=True):
            row, slot = divmod(int(index), self.length)
            window = (row, int(step))
            if window in self.priority and int(step) % self.length == slot:
                self.priority[window] = np.float32(p)
                self.max_priority = max(self.max_priority, np.float32(p))

    def leaf(self, p) -> float:
        return float(np.float64(p) ** self.alpha) if p > 0 else 0.0

    def leaves(self) -> np.ndarray:
        out = np.zeros((self.rows, self.length))
        for (row, start), p in self.priority.items():
            out[row, start % self.length] = self.leaf(p)
        return out


_add = eb.filter_jit(lambda b, x: b.add(x))
_sample = eb.filter_jit(lambda b, k, n, beta: b.sample(k, n, beta=beta))
_set = eb.filter_jit(lambda b, s, p: b.set_priorities(s, p))


class PrioritisedMachine(CountedMachine):
    """Random adds, samples and priority updates (some stale, some duplicated, some zero),
    every result compared with the NumPy reference."""

    @initialize(
        kind=st.sampled_from(["trajectory", "transition", "item"]),
        rows=st.integers(1, 2),
        length=st.integers(2, 6),
        alpha=st.sampled_from([0.0, 0.5, 1.0]),
        data=st.data(),
    )
    def setup(self, kind, rows, length, alpha, data):
        seq, period = {"transition": (2, 1), "item": (1, 1)}.get(kind, (0, 0))
        if kind == "trajectory":
            seq = data.draw(st.integers(1, length))
            period = data.draw(st.integers(1, 3))
        self.kind = kind
        self.buffer = _make(kind, rows, length, seq, period, alpha)
        self.ref = PrioritisedReference(rows, length, seq, period, alpha)
        self.key = jax.random.key(data.draw(st.integers(0, 2**31 - 1)))
        self.last: PrioritisedSample | None = None

    @rule(t=st.one_of(st.none(), st.integers(1, 3), st.just(8)))
    def add(self, t):
        batch = _batch(self.ref.rows, self.ref.total, t)
        self.buffer = _add(self.buffer, batch)
        self.ref.add(np.asarray(batch["t"])[:, None] if t is None else np.asarray(batch["t"]))

    @rule()
    def sample(self):
        if not bool(self.buffer.can_sample()):
            return
        self.key, key = jax.random.split(self.key)
        if sum(self.ref.leaves().ravel()) == 0:
            with pytest.raises(Exception, match="every valid window has priority 0"):
                _sample(self.buffer, key, 6, 0.5)
            return
        sample = _sample(self.buffer, key, 6, 0.5)
        leaves = self.ref.leaves()
        tags = _tags(sample, self.kind)
        for i, (index, step) in enumerate(
            zip(np.asarray(sample.indices), np.asarray(sample.steps), strict=True)
        ):
            row, slot = divmod(int(index), self.ref.length)
            assert (row, int(step)) in self.ref.priority and int(step) % self.ref.length == slot
            assert leaves[row, slot] > 0, "a window of zero priority was sampled"
            np.testing.assert_array_equal(tags[i], self.ref.window(row, int(step)))
        expected = leaves.ravel()[np.asarray(sample.indices)] / leaves.sum()
        np.testing.assert_allclose(np.asarray(sample.probabilities), expected, rtol=1e-5)
        raw = (len(self.ref.priority) * expected) ** -0.5
        np.testing.assert_allclose(np.asarray(sample.weights), raw / raw.max(), rtol=1e-4)
        self.last = sample

    @precondition(lambda self: getattr(self, "last", None) is not None)
    @rule(data=st.data())
    def set_priorities(self, data):
        assert self.last is not None
        # One priority per row: a window sampled twice may get two, and the last one wins,
        # as the reference applies them (in order).
        n = self.last.indices.shape[0]
        values = data.draw(
            st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=n, max_size=n)
        )
        priorities = np.array(values, np.float32)
        self.buffer = _set(self.buffer, self.last, jnp.asarray(priorities))
        self.ref.set(np.asarray(self.last.indices), np.asarray(self.last.steps), priorities)

    @invariant()
    def tree_matches_reference(self):
        if not hasattr(self, "ref"):
            return
        leaves = np.asarray(self.buffer.tree.values()).reshape(self.ref.rows, self.ref.length)
        np.testing.assert_allclose(leaves, self.ref.leaves(), rtol=1e-6)
        assert float(self.buffer.max_priority) == self.ref.max_priority
        assert int(self.buffer.num_windows()) == len(self.ref.priority)
        np.testing.assert_allclose(float(self.buffer.tree.total()), leaves.sum(), rtol=1e-5)


PrioritisedMachine.TestCase.settings = stateful_settings(max_examples=15, stateful_step_count=12)
TestPrioritisedMachine = pytest.mark.stateful(PrioritisedMachine.TestCase)


def _all_windows(buffer, ref: ReferenceRing):
    """Indices and steps of every valid window, as `set_priorities` takes them."""
    starts = ref.valid_starts()
    indices = [row * ref.length + s % ref.length for row in range(ref.rows) for s in starts]
    steps = [s for _ in range(ref.rows) for s in starts]
    return jnp.array(indices, jnp.int32), jnp.array(steps, jnp.uint32)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_sampling_frequencies_match_priorities(alpha):
    rows, length, seq, period = 2, 12, 3, 2
    buffer = _make("trajectory", rows, length, seq, period, alpha)
    ref = ReferenceRing(rows, length, seq, period)
    batch = _batch(rows, 0, 17)  # wrapped: held steps 5..16, valid starts 6, 8, ..., 14
    buffer, _ = buffer.add(batch), ref.add(np.asarray(batch["t"]))
    indices, steps = _all_windows(buffer, ref)
    rng = np.random.default_rng(0)
    priorities = rng.uniform(0.2, 3.0, size=indices.shape[0]).astype(np.float32)
    priorities[[1, 6]] = 0.0
    buffer = buffer.set_priorities(indices, jnp.asarray(priorities), steps=steps)
    keys = jax.random.split(jax.random.key(0), 64)
    draws = jax.jit(jax.vmap(lambda k: buffer.sample(k, 256).indices))(keys)
    counts = np.bincount(np.asarray(draws).ravel(), minlength=rows * length)
    target = np.zeros(rows * length)
    target[np.asarray(indices)] = np.where(
        priorities > 0, priorities.astype(np.float64) ** alpha, 0
    )
    # Zero-priority windows and invalid windows (spanning the head, not a multiple of the
    # period, overwritten) have zero target: `chi_square_pvalue` checks they were never drawn.
    assert chi_square_pvalue(counts, target) > 1e-3


def test_probabilities_and_weights_follow_the_formulas():
    buffer = _make("item", 1, 8, alpha=0.7)
    buffer = buffer.add(_batch(1, 0, 8))
    priorities = jnp.arange(1.0, 9.0)
    indices, steps = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, dtype=jnp.uint32)
    buffer = buffer.set_priorities(indices, priorities, steps=steps)
    for beta in (0.0, 0.4, 1.0):
        sample = buffer.sample(jax.random.key(1), 32, beta=beta)
        p = np.arange(1.0, 9.0) ** 0.7
        expected = p[np.asarray(sample.indices)] / p.sum()
        np.testing.assert_allclose(np.asarray(sample.probabilities), expected, rtol=1e-5)
        w = (8 * expected) ** -beta
        np.testing.assert_allclose(np.asarray(sample.weights), w / w.max(), rtol=1e-5)
        assert float(jnp.max(sample.weights)) == 1.0
    # beta may be an array (annealed without retracing).
    sample = eb.filter_jit(lambda b, k, beta: b.sample(k, 4, beta=beta))(
        buffer, jax.random.key(2), jnp.float32(0.5)
    )
    assert sample.weights.shape == (4,)


def test_new_windows_enter_at_the_max_priority_seen():
    buffer = _make("item", 1, 6, alpha=0.5).add(_batch(1, 0, 2))
    np.testing.assert_allclose(np.asarray(buffer.tree.values())[:2], [1.0, 1.0])
    buffer = buffer.set_priorities(
        jnp.array([0, 1], jnp.int32), jnp.array([9.0, 0.25]), steps=jnp.array([0, 1], jnp.uint32)
    )
    buffer = buffer.add(_batch(1, 2, None))
    np.testing.assert_allclose(np.asarray(buffer.tree.values())[:3], [3.0, 0.5, 3.0])
    assert float(buffer.max_priority) == 9.0


def test_stale_updates_are_dropped():
    buffer = _make("trajectory", 2, 5, seq=2, alpha=1.0).add(_batch(2, 0, 5))
    sample = buffer.sample(jax.random.key(0), 16)
    # Overwrite the two oldest steps of every row: windows starting there are now other data,
    # and the window starting at step 2... is intact.
    buffer = buffer.add(_batch(2, 5, 2))
    before = np.asarray(buffer.tree.values())
    updated = buffer.set_priorities(sample, jnp.full(16, 7.0))
    after = np.asarray(updated.tree.values())
    starts = np.asarray(sample.steps)
    fresh = starts >= 2  # held steps are now 2..6, so windows starting at 0 and 1 are stale
    assert fresh.any() and (~fresh).any()
    touched = np.zeros(10, bool)
    touched[np.asarray(sample.indices)[fresh]] = True
    np.testing.assert_array_equal(after[touched], 7.0)
    np.testing.assert_array_equal(after[~touched], before[~touched])
    # An update after everything was overwritten changes nothing, max priority included.
    buffer = updated.add(_batch(2, 7, 5))
    again = buffer.set_priorities(sample, jnp.full(16, 100.0))
    np.testing.assert_array_equal(np.asarray(again.tree.values()), np.asarray(buffer.tree.values()))
    assert float(again.max_priority) == 7.0


def test_duplicate_updates_the_last_is_applied():
    """Documented: when a window appears several times in one update, the last priority
    given for it is applied, as in NumPy; a dropped update (here for step 8, which slot 2
    held after an overwrite only) does not override an earlier one. The tree stays
    consistent, and every applied priority counts for the largest."""
    buffer = _make("item", 1, 6, alpha=1.0).add(_batch(1, 0, 6))
    indices = jnp.array([2, 4, 2, 2, 2], jnp.int32)
    steps = jnp.array([2, 4, 2, 2, 8], jnp.uint32)
    update = eb.filter_jit(lambda b, i, st, p: b.set_priorities(i, p, steps=st))
    buffer = update(buffer, indices, steps, jnp.array([5.0, 3.0, 7.0, 0.5, 9.0]))
    leaves = np.asarray(buffer.tree.values())
    assert leaves[2] == 0.5 and leaves[4] == 3.0
    np.testing.assert_array_equal(leaves[[0, 1, 3, 5]], 1.0)
    assert float(buffer.tree.total()) == pytest.approx(leaves.sum())
    assert float(buffer.max_priority) == 7.0


def test_all_priorities_zero_makes_sample_raise_not_can_sample():
    buffer = _make("item", 2, 4).add(_batch(2, 0, 3))
    indices, steps = _all_windows(buffer, _ref_for(buffer, 3))
    buffer = buffer.set_priorities(indices, jnp.zeros(indices.shape[0]), steps=steps)
    assert bool(buffer.can_sample())  # counters only
    with pytest.raises(Exception, match="every valid window has priority 0"):
        eb.filter_jit(lambda b, k: b.sample(k, 4))(buffer, jax.random.key(0))
    # New data enters at the max priority seen (1.0 here) and makes it sampleable again.
    sample = buffer.add(_batch(2, 3, None)).sample(jax.random.key(0), 8)
    np.testing.assert_array_equal(np.asarray(sample.experience["t"]) % 100_000, 3)


def _ref_for(buffer, steps):
    ref = ReferenceRing(
        buffer.add_batch_size, buffer.max_length_time_axis, buffer.sequence_length, 1
    )
    ref.add(np.zeros((buffer.add_batch_size, steps)))
    return ref


def test_sampling_an_empty_buffer_raises():
    buffer = _make("transition", 1, 4).add(_batch(1, 0, None))
    assert not bool(buffer.can_sample())
    with pytest.raises(Exception, match="cannot be sampled yet"):
        eb.filter_jit(lambda b, k: b.sample(k, 4))(buffer, jax.random.key(0))


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_bad_priorities_raise_inside_jit(bad):
    buffer = _make("item", 1, 4).add(_batch(1, 0, 4))
    sample = buffer.sample(jax.random.key(0), 2)
    with pytest.raises(Exception, match="non-negative and finite"):
        _set(buffer, sample, jnp.array([1.0, bad], jnp.float32))


def test_argument_errors():
    buffer = _make("item", 1, 4).add(_batch(1, 0, 4))
    sample = buffer.sample(jax.random.key(0), 2)
    with pytest.raises(TypeError, match="steps=sample.steps"):
        buffer.set_priorities(sample.indices, jnp.ones(2))
    with pytest.raises(ValueError, match="`beta` must be finite and >= 0"):
        buffer.sample(jax.random.key(0), 2, beta=-0.5)
    with pytest.raises(Exception, match=r"add_batch_size \* max_length_time_axis=4"):
        buffer.set_priorities(jnp.array([4, 0]), jnp.ones(2), steps=sample.steps)
    for alpha, error in ((-1.0, ValueError), (float("nan"), ValueError), (True, TypeError)):
        with pytest.raises(error, match="alpha"):
            _make("item", 1, 4, alpha=alpha)
    with pytest.raises(ValueError, match="sequence_length=5 is larger"):
        _make("trajectory", 1, 4, seq=5)


@pytest.mark.parametrize("kind", ["trajectory", "transition", "item"])
def test_jitted_donated_loop_never_retraces(kind):
    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        sample = buffer.sample(key, 8, beta=0.4)
        return buffer.set_priorities(sample, sample.probabilities + 0.1), sample

    buffer = _make(kind, 2, 8, seq=3, period=1).add(_batch(2, 0, 3))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), buffer)
    sample = None
    for i in range(12):
        buffer, sample = step(buffer, _batch(2, 3 + i, None), jax.random.key(i))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), buffer) == shapes
    assert isinstance(sample, PrioritisedSample) and sample.weights.shape == (8,)


def test_vmapped_training_run_with_cond_on_can_sample():
    """The whole run vmapped over seeds, with `lax.cond(buffer.can_sample(), learn, skip)`:
    `can_sample` stays unbatched (counters only), so the empty buffer is never sampled."""

    def train(seed):
        buffer = PrioritisedTransitionBuffer(_example(), add_batch_size=2, max_length_time_axis=16)

        def step(carry, t):
            buffer, key = carry
            key, sub = jax.random.split(key)
            obs = jnp.broadcast_to(seed + t.astype(jnp.float32), (2, 2))
            buffer = buffer.add({"obs": obs, "t": jnp.full(2, t, jnp.int32)})

            def learn(buffer):
                sample = buffer.sample(sub, 4, beta=0.5)
                new = jnp.abs(sample.experience.first["obs"][:, 0]) + 0.1
                return buffer.set_priorities(sample, new), jnp.sum(sample.weights)

            def skip(buffer):
                return buffer, jnp.float32(0.0)

            buffer, w = jax.lax.cond(buffer.can_sample(), learn, skip, buffer)
            return (buffer, key), w

        (buffer, _), ws = jax.lax.scan(step, (buffer, jax.random.key(0)), jnp.arange(10))
        return buffer.max_priority, ws

    max_priority, ws = jax.jit(jax.vmap(train))(jnp.arange(3, dtype=jnp.float32))
    ws = np.asarray(ws)
    assert (ws[:, 0] == 0).all() and (ws[:, 1:] > 0).all()  # learn from the second step on
    assert (np.asarray(max_priority) > 1.0).all()
