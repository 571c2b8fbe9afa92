"""The rank-based prioritised rule (`eb.rules.RankPrioritised`), composed with
`eb.PrioritisedBuffer`: its law against a NumPy model of Schaul et al.'s rank-based variant,
its importance weights, and `set_priorities` (stale updates dropped, the last of repeated
updates winning, a bad priority refused with nothing changed), under `eqx.filter_jit` and
`eb.filter_jit` as a training step runs it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import chi_square_pvalue


def _buffer(rows=1, capacity=16, alpha=0.7, view=None, **kwargs):
    return eb.PrioritisedBuffer(
        {"x": jnp.float32(0)},
        add_batch_size=rows,
        capacity=capacity,
        rule=eb.rules.RankPrioritised(alpha=alpha),
        view=eb.views.ItemView() if view is None else view,
        **kwargs,
    )


def _filled(priorities, alpha=0.7):
    """One row of `len(priorities)` items, item `x` in slot `x` with priority
    `priorities[x]`."""
    n = len(priorities)
    buffer = _buffer(capacity=n, alpha=alpha).add({"x": jnp.arange(float(n))[None]})
    slots = jnp.arange(n)
    p = jnp.asarray(priorities, jnp.float32)
    return buffer.set_priorities(slots, p, steps=slots.astype(jnp.uint32))


def _law(priorities, alpha):
    """Schaul et al.'s rank-based law: rank 1 for the largest priority (ties by index),
    `P(rank r) = r**-alpha / sum_k k**-alpha`."""
    order = sorted(range(len(priorities)), key=lambda i: (-priorities[i], i))
    rank = np.empty(len(priorities))
    rank[order] = np.arange(1, len(priorities) + 1)
    mass = rank**-alpha
    return mass / mass.sum()


def test_is_a_prioritised_rule_composed_with_the_generic_buffer():
    buffer = _buffer()
    assert isinstance(buffer.rule, eb.rules.AbstractPrioritisedRule)
    assert isinstance(buffer, eb.AbstractPrioritisedBuffer)
    assert buffer.rule.priorities.shape == (16,) and buffer.alpha == 0.7
    with pytest.raises(AttributeError, match="keeps its priorities in no SumTree"):
        _ = buffer.tree


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.5])
def test_probabilities_and_weights_follow_the_ranks(alpha):
    priorities = [0.3, 5.0, 0.3, 2.0, 9.0, 0.0]
    buffer = _filled(priorities, alpha)
    law = _law(priorities, alpha)
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 64, beta=0.5))(buffer, jax.random.key(0))
    x = np.asarray(sample.experience["x"]).astype(int)
    np.testing.assert_allclose(sample.probabilities, law[x], rtol=1e-5)
    weights = (len(priorities) * law[x]) ** -0.5
    np.testing.assert_allclose(sample.weights, weights / weights.max(), rtol=1e-5)


def test_draws_follow_the_law():
    priorities = [0.5, 4.0, 1.0, 3.0, 0.1, 2.0, 8.0, 0.2]
    buffer = _filled(priorities, alpha=1.0)
    draw = eqx.filter_jit(lambda b, k: b.sample(k, 1000).experience["x"])
    keys = jax.random.split(jax.random.key(1), 20)
    x = np.concatenate([np.asarray(draw(buffer, k)) for k in keys]).astype(int)
    counts = np.bincount(x, minlength=len(priorities))
    assert chi_square_pvalue(counts, _law(priorities, 1.0)) > 1e-3


def test_new_items_enter_at_the_largest_priority():
    buffer = _buffer(capacity=8).add({"x": jnp.arange(4.0)[None]})  # 8 slots, 4 held
    slots = jnp.arange(4)
    priorities = jnp.array([1.0, 7.0, 2.0, 3.0])
    buffer = buffer.set_priorities(slots, priorities, steps=slots.astype(jnp.uint32))
    assert float(buffer.max_priority) == 7.0
    buffer = buffer.add({"x": jnp.full((1, 1), 4.0)})  # slot 4: enters at priority 7
    assert float(buffer.rule.priorities[4]) == 7.0
    sample = buffer.sample(jax.random.key(0), 200, beta=0.0)
    # ranks: item 1 (7, first by index), item 4 (7), then 3, 2, 0
    law = _law([1.0, 7.0, 2.0, 3.0, 7.0], 0.7)
    x = np.asarray(sample.experience["x"]).astype(int)
    np.testing.assert_allclose(sample.probabilities, law[x], rtol=1e-5)


def test_only_valid_windows_are_ranked():
    # Pairs over one row of 6 steps: 5 valid windows; the ring of 8 slots has 3 unwritten.
    buffer = _buffer(capacity=8, view=eb.views.PairView())
    buffer = buffer.add({"x": jnp.arange(6.0)[None]})
    sample = buffer.sample(jax.random.key(0), 100)
    assert (sample.experience.second["x"] == sample.experience.first["x"] + 1).all()
    assert int(jnp.max(sample.indices)) == 4
    law = _law([1.0] * 5, 0.7)
    np.testing.assert_allclose(sample.probabilities, law[np.asarray(sample.indices)], rtol=1e-5)


def test_a_stale_update_is_dropped():
    buffer = _filled([1.0, 2.0, 3.0, 4.0])
    sample = buffer.sample(jax.random.key(0), 4)
    overwritten = buffer.add({"x": jnp.zeros((1, 4))})  # every item replaced
    stale = overwritten.set_priorities(sample, jnp.full(4, 50.0))
    np.testing.assert_array_equal(stale.rule.priorities, overwritten.rule.priorities)
    assert float(stale.max_priority) == 4.0


def test_the_last_of_repeated_updates_wins():
    buffer = _filled([1.0, 2.0, 3.0, 4.0])
    slots = jnp.array([2, 0, 2, 2])
    steps = slots.astype(jnp.uint32)
    updated = eqx.filter_jit(
        lambda b: b.set_priorities(slots, jnp.array([9.0, 5.0, 8.0, 6.0]), steps=steps)
    )(buffer)
    assert updated.rule.priorities.tolist() == [5.0, 2.0, 6.0, 4.0]
    assert float(updated.max_priority) == 9.0  # the largest given for a current window


@pytest.mark.parametrize("bad", [np.nan, -1.0, np.inf])
def test_a_bad_priority_is_refused_and_changes_nothing(bad):
    buffer = _filled([1.0, 2.0, 3.0, 4.0])
    sample = buffer.sample(jax.random.key(0), 4)
    priorities = jnp.array([2.0, bad, 3.0, 4.0], jnp.float32)
    step = eb.filter_jit(lambda b, s, p: b.set_priorities(s, p), donate="all")
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-negative and finite") as caught:
        step(buffer, sample, priorities)
    kept = caught.value.output
    assert kept.rule.priorities.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert float(kept.max_priority) == 4.0


def test_sampling_too_early_fails_in_the_step():
    with pytest.raises(eqx.EquinoxRuntimeError, match="sample"):
        eb.filter_jit(lambda b, k: b.sample(k, 4).weights.sum())(_buffer(), jax.random.key(0))


def test_row_blocks_rank_within_each_block():
    buffer = _buffer(rows=2, capacity=8)
    buffer = buffer.add({"x": jnp.array([[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]])})
    sample = buffer.sample(jax.random.key(0), 8, row_blocks=2)
    x = np.asarray(sample.experience["x"])
    assert (x[:4] < 10).all() and (x[4:] >= 10).all()
    # Three items of priority 1 in each block, ranked by slot: each draw's probability is
    # its rank's in its own block.
    law = _law([1.0] * 3, 0.7)
    slot = np.asarray(sample.indices) % 4
    np.testing.assert_allclose(sample.probabilities, law[slot], rtol=1e-5)


def test_a_training_step_under_donation_does_not_retrace():
    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        sample = buffer.sample(key, 8, beta=0.5)
        return buffer.set_priorities(sample, jnp.abs(sample.experience["x"]) + 1e-3)

    buffer = _buffer(rows=2, capacity=32)
    for i in range(5):
        batch = {"x": jnp.full((2,), float(i + 1))}
        buffer = step(buffer, batch, jax.random.key(i))
    assert float(buffer.max_priority) > 1.0 and int(buffer.size()) == 10


def test_restored_windows_enter_at_the_given_priority():
    buffer = _filled([1.0, 2.0, 3.0, 4.0])
    restored = buffer.with_storage(buffer.storage, priority=2.5)
    assert restored.rule.priorities.tolist() == [2.5] * 4
    assert float(restored.max_priority) == 2.5


def test_an_epoch_visits_every_valid_window():
    buffer = _filled([1.0, 2.0, 3.0, 4.0])
    epoch = buffer.epoch(jax.random.key(0), batch_size=2)
    seen = []
    for i in range(int(epoch.num_batches())):
        sample, valid = buffer.epoch_batch(epoch, i)
        seen += sample.experience["x"][valid].tolist()
    assert sorted(seen) == [0.0, 1.0, 2.0, 3.0]
