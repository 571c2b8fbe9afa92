"""The public parts (`equibuffer.rules`, `equibuffer.views`) and the generic buffers that
compose them (`Buffer`, `PrioritisedBuffer`): the same parts as a named class give the same
buffer, and combinations no named class offers sample as the NumPy reference model says."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, Phase, settings

import equibuffer as eb
import equibuffer.testing as ebt
from equibuffer.testing import BufferReference

from .helpers import budget


EXAMPLE = {"x": jnp.int32(0), "reward": jnp.float32(0),
           "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}  # fmt: skip


def _batch(rows, t0, done):
    done = np.asarray(done)
    n = done.shape[1]
    x = (np.arange(rows)[:, None] * 1000 + t0 + np.arange(n)[None, :]).astype(np.int32)
    return {
        "x": jnp.asarray(x),
        "reward": jnp.asarray((x % 7).astype(np.float32)),
        "terminated": jnp.asarray(done),
        "truncated": jnp.zeros(done.shape, bool),
    }


def _pairs(s, period, mode, alpha):
    """(named buffer, the same parts composed) constructors, keyed by name."""
    nstep = eb.views.NStepView(2, 0.5)
    ep = dict(episode_end="terminated", mode=mode)
    return {
        "trajectory": (
            lambda **k: eb.TrajectoryBuffer(EXAMPLE, sequence_length=s, period=period, **k),
            lambda **k: eb.Buffer(EXAMPLE, view=eb.views.WindowView(s), period=period, **k),
        ),
        "transition": (
            lambda **k: eb.TransitionBuffer(EXAMPLE, **k),
            lambda **k: eb.Buffer(EXAMPLE, view=eb.views.PairView(), **k),
        ),
        "item": (
            lambda **k: eb.ItemBuffer(EXAMPLE, **k),
            lambda **k: eb.Buffer(EXAMPLE, view=eb.views.ItemView(), **k),
        ),
        "episode_nstep": (
            lambda **k: eb.TransitionBuffer(EXAMPLE, n_step=2, discount=0.5, **ep, **k),
            lambda **k: eb.Buffer(EXAMPLE, rule=eb.rules.Episodic(**ep), view=nstep, **k),
        ),
        "episode_trajectory": (
            lambda **k: eb.EpisodeTrajectoryBuffer(
                EXAMPLE, sequence_length=s, period=period, **ep, **k
            ),
            lambda **k: eb.Buffer(
                EXAMPLE,
                rule=eb.rules.Episodic(**ep),
                view=eb.views.WindowView(s),
                period=period,
                **k,
            ),  # fmt: skip
        ),
        "prioritised_trajectory": (
            lambda **k: eb.PrioritisedTrajectoryBuffer(
                EXAMPLE, sequence_length=s, period=period, alpha=alpha, **k
            ),
            lambda **k: eb.PrioritisedBuffer(
                EXAMPLE,
                rule=eb.rules.Prioritised(alpha),
                view=eb.views.WindowView(s),
                period=period,
                **k,
            ),  # fmt: skip
        ),
        "prioritised_episode_nstep": (
            lambda **k: eb.PrioritisedTransitionBuffer(
                EXAMPLE, n_step=2, discount=0.5, alpha=alpha, **ep, **k
            ),
            lambda **k: eb.PrioritisedBuffer(
                EXAMPLE, rule=eb.rules.PrioritisedEpisodic(**ep, alpha=alpha), view=nstep, **k
            ),
        ),
        "prioritised_episode_trajectory": (
            lambda **k: eb.PrioritisedEpisodeTrajectoryBuffer(
                EXAMPLE, sequence_length=s, period=period, alpha=alpha, **ep, **k
            ),
            lambda **k: eb.PrioritisedBuffer(
                EXAMPLE,
                rule=eb.rules.PrioritisedEpisodic(**ep, alpha=alpha),
                view=eb.views.WindowView(s),
                period=period,
                **k,
            ),  # fmt: skip
        ),
        "prioritised_item": (
            lambda **k: eb.PrioritisedItemBuffer(EXAMPLE, alpha=alpha, **k),
            lambda **k: eb.PrioritisedBuffer(
                EXAMPLE, rule=eb.rules.Prioritised(alpha), view=eb.views.ItemView(), **k
            ),
        ),
    }


def _assert_same(a, b):
    if not isinstance(a, eb.AbstractBuffer):  # (a named buffer and a composed one differ)
        assert type(a).__name__ == type(b).__name__
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# (no shrinking: each example compiles a buffer, and a failure prints its arguments)
@settings(max_examples=budget(12), deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    kind=st.sampled_from(sorted(_pairs(2, 1, "never_cross", 0.6))),
    rows=st.integers(1, 2),
    length=st.integers(5, 9),
    s=st.integers(1, 3),
    period=st.integers(1, 2),
    mode=st.sampled_from(["never_cross", "pad"]),
    adds=st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_the_same_parts_give_the_same_buffer(kind, rows, length, s, period, mode, adds, seed):
    named, composed = _pairs(s, period, mode, 0.7)[kind]
    a = named(add_batch_size=rows, max_length_time_axis=length)
    b = composed(add_batch_size=rows, max_length_time_axis=length)
    assert (a.view, a.period, a.min_length_time_axis) == (b.view, b.period, b.min_length_time_axis)
    t = 0
    for done in adds:
        batch = _batch(rows, t, np.tile(np.asarray(done)[None], (rows, 1)))
        a, b = a.add(batch), b.add(batch)
        t += len(done)
    _assert_same(a, b)  # the storage and every array of the rule
    assert bool(a.can_sample()) == bool(b.can_sample())
    if not a.can_sample() or int(a.num_valid_windows()) == 0:
        return
    key = jax.random.key(seed)
    prioritised = isinstance(a, eb.AbstractPrioritisedBuffer)
    kwargs = {"beta": 0.5} if prioritised else {}
    sa, sb = a.sample(key, 8, **kwargs), b.sample(key, 8, **kwargs)
    _assert_same(sa, sb)
    if prioritised:
        priorities = jnp.arange(1.0, 9.0)
        a, b = a.set_priorities(sa, priorities), b.set_priorities(sb, priorities)
        _assert_same(a, b)
        _assert_same(a.sample(key, 8, beta=1.0), b.sample(key, 8, beta=1.0))
    ea, eb_ = a.epoch(key, 4), b.epoch(key, 4)
    _assert_same(ea, eb_)
    _assert_same(a.epoch_batch(ea, 0), b.epoch_batch(eb_, 0))


def _check_against_reference(buffer, batches, beta=None, priorities=None):
    """`buffer` after `batches` against its reference; its calls jitted, as a training step
    runs them (compiled whole rather than op by op)."""
    reference = BufferReference.from_buffer(buffer)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    for batch in batches:
        buffer, _ = add(buffer, batch), reference.add(batch)
    assert reference.valid(), "the test must leave windows to sample"
    assert int(buffer.num_valid_windows()) == len(reference.valid())
    kwargs = {} if beta is None else {"beta": beta}
    sample_fn = eqx.filter_jit(lambda b, key: b.sample(key, 64, **kwargs))
    sample = sample_fn(buffer, jax.random.key(0))
    reference.check_sample(sample, **kwargs)
    if priorities is not None:
        buffer = eqx.filter_jit(lambda b, s, p: b.set_priorities(s, p))(buffer, sample, priorities)
        reference.set_priorities(sample, priorities)
        reference.check_sample(sample_fn(buffer, jax.random.key(1)), **kwargs)
    return buffer, reference


def _episodes(rows, n, ends):
    done = np.zeros((rows, n), bool)
    done[:, list(ends)] = True
    return done


@pytest.mark.parametrize("mode", ["never_cross", "pad"])
def test_episode_aware_windows_with_an_n_step_view(mode):
    """Episode-aware n-step transitions over windows starting every 2 steps: no named class
    offers a `period` with n-step transitions."""
    buffer = eb.Buffer(EXAMPLE, add_batch_size=2, max_length_time_axis=16, period=2,
                       rule=eb.rules.Episodic(episode_end="terminated", mode=mode),
                       view=eb.views.NStepView(n=3, discount=0.5))  # fmt: skip
    batches = [_batch(2, 0, _episodes(2, 7, [4])), _batch(2, 7, _episodes(2, 6, [3]))]
    buffer, reference = _check_against_reference(buffer, batches)
    # never_cross: no transition sums across an end; pad: the last ones are cut at it
    sample = buffer.sample(jax.random.key(2), 64)
    first = np.asarray(sample.experience.first["x"]) % 1000
    assert (first % 2 == 0).all()  # the period


def test_n_step_transitions_with_a_period():
    buffer = eb.Buffer(EXAMPLE, add_batch_size=1, max_length_time_axis=12, period=3,
                       view=eb.views.NStepView(n=2, discount=0.9))  # fmt: skip
    batches = [_batch(1, 0, _episodes(1, 8, [5])), _batch(1, 8, _episodes(1, 9, []))]
    buffer, reference = _check_against_reference(buffer, batches)
    # the ring holds steps 5-16: starts at multiples of 3 whose 3 steps are held
    assert {t for _, t in reference.valid()} == {6, 9, 12}


def test_prioritised_episode_windows_with_an_n_step_view_and_a_period():
    rule = eb.rules.PrioritisedEpisodic(episode_end="terminated", alpha=0.8)
    buffer = eb.PrioritisedBuffer(EXAMPLE, add_batch_size=2, max_length_time_axis=16,
                                  period=2, rule=rule,
                                  view=eb.views.NStepView(n=2, discount=0.5))  # fmt: skip
    batches = [_batch(2, 0, _episodes(2, 11, [5]))]
    _check_against_reference(buffer, batches, beta=0.5, priorities=jnp.linspace(0.5, 3.0, 64))


def test_a_stateless_rule_adds_no_leaves():
    """The rule is a pytree field of every buffer; a `Uniform` rule has no leaves, so a
    jitted call flattens only the ring, as for the named buffers, and never retraces."""
    buffer = eb.Buffer(EXAMPLE, add_batch_size=2, capacity=16, view=eb.views.PairView())
    named = eb.TransitionBuffer(EXAMPLE, add_batch_size=2, capacity=16)
    assert isinstance(buffer.rule, eb.rules.Uniform)
    assert len(jax.tree.leaves(buffer)) == len(jax.tree.leaves(named))
    assert len(jax.tree.leaves(buffer)) == len(jax.tree.leaves(buffer.storage))
    episodic = eb.Buffer(EXAMPLE, add_batch_size=2, capacity=16, view=eb.views.PairView(),
                         rule=eb.rules.Episodic("terminated"))  # fmt: skip
    rule_leaves = jax.tree.leaves(episodic.rule)
    assert rule_leaves and len(jax.tree.leaves(episodic)) == len(
        jax.tree.leaves(episodic.storage)
    ) + len(rule_leaves)

    for b in (buffer, episodic):

        @eqx.filter_jit(donate="all")
        @eqx.debug.assert_max_traces(max_traces=1)
        def step(buffer, batch, key):
            buffer = buffer.add(batch)
            return buffer, buffer.sample(key, 4)

        for i in range(3):
            b, _ = step(b, _batch(2, i * 3, np.zeros((2, 3), bool)), jax.random.key(i))


def test_with_storage_rebuilds_a_composed_rule():
    ring = eb.RingStorage(EXAMPLE, rows=1, length=8).write(_batch(1, 0, _episodes(1, 6, [2])))
    buffer = eb.Buffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.WindowView(3),
                       rule=eb.rules.Episodic("terminated"))  # fmt: skip
    restored = buffer.with_storage(ring)
    assert int(restored.num_valid_windows()) == 2  # steps 0-2 and 3-5
    prioritised = eb.PrioritisedBuffer(EXAMPLE, add_batch_size=1, capacity=8,
                                       view=eb.views.ItemView(),
                                       rule=eb.rules.Prioritised(1.0))  # fmt: skip
    restored = prioritised.with_storage(ring, priority=2.0)
    assert float(restored.tree.total()) == 12.0  # 6 items at priority 2


def test_the_generic_buffers_refuse_the_wrong_parts():
    with pytest.raises(TypeError, match=r"Buffer\(\): the rule Prioritised .*PrioritisedBuffer"):
        eb.Buffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.ItemView(),
                  rule=eb.rules.Prioritised())  # fmt: skip
    with pytest.raises(TypeError, match=r"PrioritisedBuffer\(\): the rule Uniform .*eb.Buffer"):
        eb.PrioritisedBuffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.ItemView(),
                             rule=eb.rules.Uniform())  # fmt: skip
    with pytest.raises(ValueError, match=r"Buffer\(\): `sequence_length` must be"):
        eb.Buffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.WindowView(0))
    with pytest.raises(ValueError, match=r"Buffer\(\): .*names no top-level leaf"):
        eb.Buffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.ItemView(),
                  rule=eb.rules.Episodic("done"))  # fmt: skip
    with pytest.raises(ValueError, match=r"PrioritisedBuffer\(\): `alpha` must be"):
        eb.PrioritisedBuffer(EXAMPLE, add_batch_size=1, capacity=8, view=eb.views.ItemView(),
                             rule=eb.rules.Prioritised(-1.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"Buffer\(\): .*larger than the ring"):
        eb.Buffer(EXAMPLE, add_batch_size=1, capacity=4, view=eb.views.NStepView(4, 0.9))
    with pytest.raises(TypeError, match=r"`max_length` is not taken here"):
        eb.Buffer(EXAMPLE, add_batch_size=1, max_length=8, view=eb.views.ItemView())


def test_a_composed_buffer_survives_an_archive_restore(tmp_path):
    """Written to an archive and restored into a fresh buffer of the same parts: the episode
    flags are rebuilt and it samples as a buffer that received the same adds."""
    make = lambda: eb.PrioritisedBuffer(  # noqa: E731
        EXAMPLE, add_batch_size=2, max_length_time_axis=16, period=2,
        rule=eb.rules.PrioritisedEpisodic(episode_end="terminated", alpha=1.0),
        view=eb.views.NStepView(n=2, discount=0.5),
    )  # fmt: skip
    buffer = make()
    reference = BufferReference.from_buffer(buffer)
    batch = _batch(2, 0, _episodes(2, 11, [5]))
    # (Each call jitted, as a training step runs it: compiled whole, not op by op.)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    buffer, _ = add(buffer, batch), reference.add(batch)
    path = str(tmp_path / "composed.zarr")
    with eb.Archive(path, buffer, progress=False) as archive:
        archive.write(buffer)
    with eb.Archive(path, make(), progress=False) as archive:
        restored = archive.restore(make(), priority=2.0)
    assert int(restored.steps_added()) == 11
    assert int(restored.num_valid_windows()) == len(reference.valid())
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 64, beta=0.5))(restored, jax.random.key(3))
    reference.check_sample(sample, beta=0.5)  # every restored window at one priority
    assert float(restored.max_priority) == 2.0
    restored = eqx.filter_jit(lambda b, s, p: b.set_priorities(s, p))(
        restored, sample, jnp.linspace(1.0, 4.0, 64)
    )
    restored = add(restored, _batch(2, 11, _episodes(2, 1, [])))
    assert int(restored.steps_added()) == 12


def test_each_rule_declares_the_leaves_shard_rows_splits():
    storage = eb.RingStorage(EXAMPLE, rows=3, length=8)
    rules = [
        (eb.rules.Uniform(), 0),
        (eb.rules.Prioritised(0.5), 0),
        (eb.rules.Episodic("terminated"), 1),
        (eb.rules.PrioritisedEpisodic("terminated"), 2),
    ]
    for rule, count in rules:
        leaves = rule.sized("test", storage).row_leaves()
        assert len(leaves) == count, rule
        assert all(x.shape == (3, 8) for x in leaves), rule


class EveryOther(eb.rules.AbstractUniformRule):
    """A rule written as a user would, from the public parts only: uniform over every other
    window start (twice the view's period), with its reference model."""

    def _wider(self, window):
        return eb.rules.Window(window.length, 2 * window.period, window.name)

    def sized(self, where, storage):
        return self

    def row_leaves(self):
        return ()

    def added(self, storage, appended, window):
        return self

    def updated(self, storage, window, *, restored=False):
        return self

    def mask(self, storage, indices, window):
        return None

    def count_valid(self, storage, window):
        return eb.rules.Uniform().count_valid(storage, self._wider(window))

    def valid_starts(self, storage, window):
        return eb.rules.Uniform().valid_starts(storage, self._wider(window))

    def draw(self, storage, window, request):
        return eb.rules.Uniform().draw(storage, self._wider(window), request)

    def reference(self, window):
        return ebt.UniformRule(window.length, 2 * window.period)


class NoModel(EveryOther):
    """The same rule without a reference model."""

    def reference(self, window):
        return super(EveryOther, self).reference(window)


def test_a_rule_written_by_a_user():
    """A user's rule in a generic buffer, stepped in a donated jitted step: it samples as
    its reference model says (the reference built from the rule's own `reference`), as the
    named buffer with the same law does, and an epoch visits each of its windows once."""
    buffer = eb.Buffer(EXAMPLE, add_batch_size=2, capacity=16, rule=EveryOther(),
                       view=eb.views.WindowView(2))  # fmt: skip
    twin = eb.TrajectoryBuffer(EXAMPLE, add_batch_size=2, capacity=16, sequence_length=2,
                               period=2)  # fmt: skip
    reference = BufferReference.from_buffer(buffer)

    @eqx.filter_jit(donate="all-except-first")
    def step(key, buffer, batch):
        buffer = buffer.add(batch)
        return buffer, buffer.sample(key, 8)

    for i in range(4):  # 20 steps per row: the ring of 8 per row wraps around
        batch = _batch(2, 5 * i, np.zeros((2, 5), bool))
        key = jax.random.key(i)
        buffer, sample = step(key, buffer, batch)
        twin = twin.add(batch)
        reference.add(batch)
        eb.check(sample)
        reference.check_sample(sample)
        assert int(buffer.num_valid_windows()) == len(reference.valid())
        expected = twin.sample(key, 8).experience["x"]
        np.testing.assert_array_equal(sample.experience["x"], expected)
    epoch = buffer.epoch(jax.random.key(9), batch_size=3)
    visited = [buffer.epoch_batch(epoch, i)[0].indices for i in range(int(epoch.num_batches()))]
    starts = np.concatenate(visited)[: int(epoch.count)]
    assert sorted(starts.tolist()) == sorted(set(starts.tolist()))
    assert len(starts) == len(reference.valid())


def test_a_part_without_a_reference_model_is_refused_by_the_reference():
    buffer = eb.Buffer(EXAMPLE, add_batch_size=1, capacity=8, rule=NoModel(),
                       view=eb.views.WindowView(2))  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"from_buffer\(\): NoModel declares no"):
        BufferReference.from_buffer(buffer)
