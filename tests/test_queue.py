import collections

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, rule

import equibuffer as eb
from equibuffer._buffers._queue import Queue

from .helpers import compiled_as_users_compile, CountedMachine, stateful_settings


def _example():
    return {"obs": jnp.zeros(2, jnp.float32), "t": jnp.int32(0)}


def _batch(rows, start, t):
    """Steps `start .. start+t-1` of every row, values unique per (row, step)."""
    n = 1 if t is None else t
    tag = np.arange(rows)[:, None] * 100_000 + np.arange(start, start + n)[None, :]
    batch = {"obs": np.stack([tag, -tag], -1).astype(np.float32), "t": tag.astype(np.int32)}
    if t is None:
        batch = {k: v[:, 0] for k, v in batch.items()}
    return jax.tree.map(jnp.asarray, batch)


@eb.filter_jit
def _add(queue, batch):
    return queue.add(batch)


@eb.filter_jit
def _sample(queue):
    return queue.sample()


class QueueMachine(CountedMachine):
    """Random adds and samples against a NumPy deque per row: FIFO order, no loss, and every
    refused add/sample raises without changing anything."""

    @initialize(
        rows=st.integers(1, 3), length=st.sampled_from([3, 5]), data=st.data(), items=st.booleans()
    )
    def setup(self, rows, length, data, items):
        seq = 1 if items else data.draw(st.integers(1, length))
        self.queue = Queue(
            _example(), add_batch_size=rows, max_length_time_axis=length, sequence_length=seq
        )
        self.rows, self.length, self.seq = rows, length, seq
        self.ref = [collections.deque() for _ in range(rows)]
        self.added = 0

    @rule(t=st.one_of(st.none(), st.integers(1, 5)))
    def add(self, t):
        n = 1 if t is None else t
        if n > self.length:
            with pytest.raises(ValueError, match="at most max_length"):
                self.queue.add(_batch(self.rows, self.added, t))
            return
        fits = len(self.ref[0]) + n <= self.length
        assert bool(self.queue.can_add(n)) == fits
        batch = _batch(self.rows, self.added, t)
        if not fits:
            with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full"):
                _add(self.queue, batch)
            return
        self.queue = _add(self.queue, batch)
        tags = np.asarray(batch["t"]).reshape(self.rows, n)
        for r in range(self.rows):
            self.ref[r].extend(tags[r].tolist())
        self.added += n

    @rule()
    def sample(self):
        ready = len(self.ref[0]) >= self.seq
        assert bool(self.queue.can_sample()) == ready
        if not ready:
            with pytest.raises(eqx.EquinoxRuntimeError, match="fewer than sequence_length"):
                _sample(self.queue)
            return
        self.queue, sample = _sample(self.queue)
        want = np.array(
            [[self.ref[r].popleft() for _ in range(self.seq)] for r in range(self.rows)]
        )
        np.testing.assert_array_equal(np.asarray(sample.experience["t"]), want)
        obs = np.asarray(sample.experience["obs"])
        np.testing.assert_array_equal(obs, np.stack([want, -want], -1).astype(np.float32))
        rows, slots = np.divmod(np.asarray(sample.indices), self.length)
        np.testing.assert_array_equal(rows, np.arange(self.rows))
        np.testing.assert_array_equal(slots, want[:, 0] % 100_000 % self.length)
        np.testing.assert_array_equal(np.asarray(sample.steps), want[:, 0] % 100_000)

    @invariant()
    def counters(self):
        if hasattr(self, "queue"):
            assert int(self.queue.unread) == len(self.ref[0])
            assert int(self.queue.size()) == self.rows * len(self.ref[0])


QueueMachine.TestCase.settings = stateful_settings(max_examples=15, stateful_step_count=10)
test_queue_matches_reference = pytest.mark.stateful(QueueMachine.TestCase)


@pytest.mark.parametrize("length", [6, 5])  # reads never wrap / reads that wrap the ring
def test_every_step_comes_out_once_in_order(length):
    queue = Queue(_example(), add_batch_size=2, max_length_time_axis=length, sequence_length=2)
    out = []
    for i in range(10):
        queue = _add(queue, _batch(2, 3 * i, 3))
        while bool(queue.can_sample()):
            queue, sample = _sample(queue)
            out.append(np.asarray(sample.experience["t"]))
    got = np.concatenate(out, axis=1)
    n = got.shape[1]
    assert n >= 28
    np.testing.assert_array_equal(got, np.arange(2)[:, None] * 100_000 + np.arange(n))


def test_errors_inside_jit_lose_nothing():
    queue = Queue(_example(), add_batch_size=1, max_length_time_axis=4, sequence_length=2)
    with pytest.raises(eqx.EquinoxRuntimeError, match="fewer than sequence_length=2"):
        _sample(queue)
    queue = _add(queue, _batch(1, 0, 3))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"can_add\(2\)"):
        _add(queue, _batch(1, 3, 2))
    queue, sample = _sample(queue)  # the queue before the refused add is intact
    np.testing.assert_array_equal(np.asarray(sample.experience["t"]), [[0, 1]])
    queue = _add(queue, _batch(1, 3, 2))
    queue, sample = _sample(queue)
    np.testing.assert_array_equal(np.asarray(sample.experience["t"]), [[2, 3]])


def test_bad_configuration_and_input():
    with pytest.raises(ValueError, match="sequence_length=5 is larger than the queue"):
        Queue(_example(), add_batch_size=1, max_length_time_axis=4, sequence_length=5)
    with pytest.raises(ValueError, match="`sequence_length` must be at least 1"):
        Queue(_example(), add_batch_size=1, max_length_time_axis=4, sequence_length=0)
    queue = Queue(_example(), add_batch_size=2, capacity=8, sequence_length=2)
    assert queue.max_length_time_axis == 4 and queue.capacity == 8 and queue.add_batch_size == 2
    with pytest.raises(ValueError, match=r"leaf \['obs'\] has shape \(3, 2\)"):
        queue.add({"obs": jnp.zeros((3, 2)), "t": jnp.zeros(3, jnp.int32)})
    with pytest.raises(TypeError, match=r"leaf \['t'\] has dtype float32"):
        queue.add({"obs": jnp.zeros((2, 2)), "t": jnp.zeros(2, jnp.float32)})
    with pytest.raises(ValueError, match="at most max_length_time_axis=4"):
        queue.add(_batch(2, 0, 5))
    with pytest.raises(ValueError, match="`steps` must be at least 1"):
        queue.can_add(0)


def test_donating_jit_rollout_loop_traces_once():
    """A PPO-style loop: add a rollout every step, consume it when ready."""

    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(queue, i):
        batch = jax.tree.map(lambda x: x + i.astype(x.dtype), _batch(4, 0, 2))
        queue = queue.add(batch)

        def consume(q):
            q, sample = q.sample()
            return q, jnp.sum(sample.experience["t"])

        return jax.lax.cond(queue.can_sample(), consume, lambda q: (q, jnp.int32(-1)), queue)

    queue = Queue(_example(), add_batch_size=4, max_length_time_axis=8, sequence_length=4)
    totals = []
    for i in range(6):
        queue, total = step(queue, jnp.int32(10 * i))
        totals.append(int(total))
    tag = np.arange(4)[:, None] * 100_000
    for i in (1, 3, 5):
        want = sum(int(np.sum(tag + np.array([0, 1]) + 10 * j)) for j in (i - 1, i))
        assert totals[i] == want
    assert totals[0] == totals[2] == totals[4] == -1


def test_update_touches_written_slots_only():
    queue = Queue(_example(), add_batch_size=2, max_length_time_axis=4, sequence_length=2)
    queue = queue.add(_batch(2, 1, 3))
    queue = queue.update(lambda s: {"obs": s["obs"] + 1.0, "t": s["t"] * 2})
    t = np.asarray(queue.storage.data["t"])
    np.testing.assert_array_equal(t[:, :3], 2 * (np.arange(2)[:, None] * 100_000 + [1, 2, 3]))
    np.testing.assert_array_equal(t[:, 3], 0)
    queue, sample = queue.sample()
    np.testing.assert_array_equal(np.asarray(sample.experience["t"])[0], [2, 4])


def test_vmapped_queues():
    queue = Queue(_example(), add_batch_size=1, max_length_time_axis=4, sequence_length=2)
    queues = eqx.filter_vmap(lambda _: queue, axis_size=3)(jnp.arange(3))

    @eqx.filter_vmap
    def go(q, offset):
        q = q.add(jax.tree.map(lambda x: x + offset.astype(x.dtype), _batch(1, 0, 3)))
        q, s = q.sample()
        return q, s.experience["t"]

    queues, t = go(queues, jnp.arange(3, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(t)[:, 0], [[0, 1], [1, 2], [2, 3]])
    np.testing.assert_array_equal(np.asarray(queues.unread), [1, 1, 1])


def test_one_device_sample_is_one_slice_or_one_gather_per_leaf():
    """Slots that do not cross the end of the ring are read as one slice of every row; those
    that do, by the row-by-row gather (which keeps a sharded queue's rows on their devices),
    compiled on one device to one gather of the `rows * sequence_length` steps per leaf, with
    no transposing copy: the one-device program does no more work than a flat gather."""
    queue = Queue(_example(), add_batch_size=16, max_length_time_axis=64, sequence_length=3)
    queue = _add(queue, _batch(16, 0, 5))
    arrays, static = eqx.partition(queue, eqx.is_array)

    def sample(arrays):
        return eqx.partition(eqx.combine(arrays, static).sample()[1], eqx.is_array)[0]

    hlo = compiled_as_users_compile(jax.jit(sample).lower(arrays))
    gathers = [line for line in hlo.splitlines() if " gather(" in line]
    assert len(gathers) == 2, gathers  # "obs" and "t"
    assert all("[48," in line for line in gathers), gathers  # 16 rows * 3 steps, one go
    assert " transpose(" not in hlo
    slices = [line for line in hlo.splitlines() if " dynamic-slice(" in line]
    assert len(slices) == 2 and all("[16,3" in line for line in slices), slices
