"""Flashbax's item adds on the item buffers (issue 47): `add_batches` and `add_sequences`
take leaves `(batch, [time], *leaf)` of any sizes, each add's items stored, as
`fbx.make_item_buffer(add_batches=..., add_sequences=...)` takes them, side by side with it."""

import collections

import equinox as eqx
import flashbax as fbx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from scipy import stats

import equibuffer as eb


EX = {"obs": jnp.zeros(2), "reward": jnp.float32(0)}
KINDS = {"ItemBuffer": eb.ItemBuffer, "PrioritisedItemBuffer": eb.PrioritisedItemBuffer}


def _rollout(start: int, *lead: int) -> dict:
    """Items numbered from `start`, leaves `(*lead, *leaf)`: item `i` holds obs `[i, -i]`."""
    n = int(np.prod(lead))
    ids = jnp.arange(start, start + n, dtype=jnp.float32).reshape(lead)
    return {"obs": jnp.stack([ids, -ids], axis=-1), "reward": ids}


def _as_flashbax_runs():
    """JAX's default promotion, which Flashbax's code relies on (the tests run strict)."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.numpy_rank_promotion("allow"))
    stack.enter_context(jax.numpy_dtype_promotion("standard"))
    return stack


def _sample(buffer, key, n):
    sample = buffer.sample(key, n)
    return sample.experience


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "flags,shapes",
    [
        ((True, True), [(16, 8), (1, 8), (4, 3)]),  # a warm-up, then short time-major rollouts
        ((True, False), [(5,), (1,), (7,)]),
        ((False, True), [(6,), (2,)]),
    ],
    ids=["batches-and-sequences", "batches", "sequences"],
)
def test_items_of_adds_of_any_shape_are_stored_as_flashbaxs_are(kind, flags, shapes):
    add_batches, add_sequences = flags
    ours = KINDS[kind](EX, add_batches=add_batches, add_sequences=add_sequences, capacity=256)
    peer = fbx.make_item_buffer(
        max_length=256, min_length=1, sample_batch_size=64,
        add_batches=add_batches, add_sequences=add_sequences,
    )  # fmt: skip
    state = peer.init(EX)
    traces = collections.Counter()

    def add(buffer, batch):
        traces[jax.tree.leaves(batch)[0].shape] += 1
        return buffer.add(batch)

    add = eqx.filter_jit(add)
    start = 0
    for shape in shapes * 2:  # each shape twice: traced once
        batch = _rollout(start, *shape)
        start += int(np.prod(shape))
        ours = add(ours, batch)
        with _as_flashbax_runs():
            state = peer.add(state, batch)
    assert set(traces.values()) == {1} and len(traces) == len(set(shapes))
    # The same items held: the newest 256 (Flashbax's ring of 256 items, ours of one row). (New
    # prioritised items enter at one priority: drawn uniformly too.)
    held = set(np.asarray(ours.storage.data["reward"]).ravel().tolist())
    theirs = set(np.asarray(state.experience["reward"]).ravel().tolist())
    assert held == theirs == set(range(max(0, start - 256), start))
    # Both draw uniformly over them: the same law (chi-square, each against uniform).
    ours_drawn = np.asarray(_sample(ours, jax.random.key(0), 4096)["reward"])
    keys = jax.random.split(jax.random.key(1), 32)
    with _as_flashbax_runs():
        theirs_drawn = np.concatenate(
            [np.asarray(peer.sample(state, k).experience["reward"]) for k in keys]
        )
    for drawn in (ours_drawn, theirs_drawn):
        counts = collections.Counter(drawn.tolist())
        assert set(counts) <= held
        assert stats.chisquare([counts[i] for i in sorted(held)]).pvalue > 1e-4


def test_a_time_major_rollout_with_both_flags_and_a_rate_limiter():
    """`(time, envs, *leaf)` with both flags: every item stored whatever the axes' order; a
    `RateLimited` item buffer counts them all."""
    buffer = eb.ItemBuffer(EX, add_batches=True, add_sequences=True, capacity=100)
    limited = eb.RateLimited(buffer, samples_per_insert=1.0, tolerance=1000.0)
    limited = limited.add(_rollout(0, 5, 4))  # 5 steps of 4 environments
    assert int(limited.buffer.size()) == 20 and float(limited.credit()) == 20.0
    assert limited.buffer.steps_in(_rollout(0, 3, 4)) == 12


def test_item_add_errors_say_what_to_write(monkeypatch):
    # (the library's own checks, without the tests' jaxtyping hook, as a user runs)
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(ValueError, match=r"flattened into one row: leave `add_batch_size` out"):
        eb.ItemBuffer(EX, add_batch_size=4, add_batches=True, capacity=8)
    with pytest.raises(TypeError, match=r"give `add_batch_size`, the rows each `add` writes"):
        eb.ItemBuffer(EX, capacity=8)
    with pytest.raises(TypeError, match=r"`add_sequences` must be a bool, got 'yes'"):
        eb.ItemBuffer(EX, add_sequences="yes", capacity=8)
    with pytest.raises(TypeError, match=r"`frames` needs each row's steps in time order"):
        eb.ItemBuffer(
            {"obs": jnp.zeros((2, 3)), "done": jnp.bool_(False)},
            add_batches=True,
            capacity=8,
            frames=eb.Frames("obs", 3, episode_end="done"),
        )
    buffer = eb.ItemBuffer(EX, add_batches=True, add_sequences=True, capacity=8)
    with pytest.raises(ValueError, match=r"leaf \['obs'\] has shape \(4, 2\); with "
                       r"`add_batches=True` and `add_sequences=True` each leaf is "
                       r"\(batch, time, \*leaf\)"):  # fmt: skip
        buffer.add(_rollout(0, 4))
    with pytest.raises(ValueError, match="missing"):
        buffer.add({"obs": jnp.zeros((2, 3, 2))})
