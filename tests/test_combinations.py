"""Combinations of rule and view that had no class before the composed core."""

import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb


def _steps(done):
    done = jnp.asarray(done)
    t = done.shape[1]
    return {
        "t": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), done.shape),
        "reward": jnp.ones(done.shape, jnp.float32),
        "terminated": done,
        "truncated": jnp.zeros(done.shape, bool),
    }


def test_prioritised_n_step_transitions():
    example = {"t": jnp.int32(0), "reward": jnp.float32(0),
               "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}  # fmt: skip
    buffer = eb.PrioritisedTransitionBuffer(example, add_batch_size=1, max_length_time_axis=16,
                                            n_step=3,
                                            discount=0.5, alpha=1.0)  # fmt: skip
    done = np.zeros((1, 10), bool)
    done[0, 4] = True  # an episode ends at step 4
    buffer = buffer.add(_steps(done))
    sample = buffer.sample(jax.random.key(0), batch_size=64, beta=1.0)
    first = np.asarray(sample.experience.first["t"])
    steps = np.asarray(sample.experience.steps)
    expected_steps = np.where((first <= 4) & (first + 3 > 4), 5 - first, 3)
    np.testing.assert_array_equal(steps, expected_steps)
    np.testing.assert_allclose(sample.experience.reward, (1 - 0.5**steps) / 0.5)
    np.testing.assert_allclose(sample.probabilities, 1 / 7)  # 7 windows of 4 of the 10 steps
    # a priority set on the sampled windows is applied; stale ones are dropped
    updated = buffer.set_priorities(sample, jnp.full(64, 3.0))
    assert float(updated.max_priority) == 3.0
    stale = buffer.add(_steps(np.zeros((1, 16), bool))).set_priorities(sample, jnp.full(64, 3.0))
    assert float(stale.max_priority) == 1.0


def test_episode_aware_pairs_never_cross():
    example = {"t": jnp.int32(0), "done": jnp.bool_(False)}
    buffer = eb.TransitionBuffer(
        example, add_batch_size=1, max_length_time_axis=16, episode_end="done"
    )
    done = np.zeros((1, 10), bool)
    done[0, 4] = True
    buffer = buffer.add({"t": jnp.arange(10, dtype=jnp.int32)[None], "done": jnp.asarray(done)})
    assert int(buffer.num_valid_windows()) == 8  # 9 pairs, less the one joining 4 and 5
    pair = buffer.sample(jax.random.key(1), batch_size=256).experience
    assert not (np.asarray(pair.first["t"]) == 4).any()
    assert (np.asarray(pair.second["t"]) == np.asarray(pair.first["t"]) + 1).all()


def test_terminal_n_step_transitions_are_sampled_in_pad_mode():
    """One episode per row, ending at the last step added: every transition, the terminal
    ones included, is sampled; nothing past the end is returned."""
    example = {"t": jnp.int32(0), "reward": jnp.float32(0),
               "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}  # fmt: skip
    buffer = eb.TransitionBuffer(example, add_batch_size=2, max_length_time_axis=8, n_step=3,
                                 discount=0.5, episode_end="terminated", mode="pad",
                                 min_length_time_axis=4)  # fmt: skip
    done = np.zeros((2, 6), bool)
    done[:, 5] = True
    buffer = buffer.add(_steps(done))
    assert int(buffer.num_valid_windows()) == 12  # every step of both rows
    sample = buffer.sample(jax.random.key(2), batch_size=512)
    first = np.asarray(sample.experience.first["t"])
    assert set(first.tolist()) == set(range(6))
    steps = np.asarray(sample.experience.steps)
    np.testing.assert_array_equal(steps, np.minimum(3, 6 - first))
    np.testing.assert_array_equal(sample.experience.discount, np.where(first >= 3, 0.0, 0.125))
    ended = first >= 3
    assert (np.asarray(sample.experience.second["t"])[ended] == 0).all()  # zero past the end
    assert (np.asarray(sample.experience.last["t"])[ended] == 5).all()


def test_pad_mode_n_step_sums_stop_at_an_episode_end_of_its_own():
    """With an `episode_end` leaf of its own (not `terminated`/`truncated`), a pad-mode n-step
    transition still sums no reward past the episode's last step, nor from a slot the row has
    not written since the ring wrapped (stale data: reward 100 here). Found by a helper's
    reasoning about equibuffer.testing's configurations; checked against plain arithmetic."""
    example = {"t": jnp.int32(0), "reward": jnp.float32(0), "terminated": jnp.bool_(False),
               "truncated": jnp.bool_(False), "done": jnp.bool_(False)}  # fmt: skip
    buffer = eb.TransitionBuffer(example, add_batch_size=1, max_length_time_axis=8, n_step=3,
                                 discount=1.0, episode_end="done", mode="pad")  # fmt: skip

    def steps(t0: int, n: int, reward: float, done_at: int) -> dict:
        t = jnp.arange(t0, t0 + n)
        no = jnp.zeros((1, n), bool)
        return {"t": t[None], "reward": jnp.full((1, n), reward), "terminated": no,
                "truncated": no, "done": (t == done_at)[None]}  # fmt: skip

    buffer = buffer.add(steps(0, 8, 100.0, -1))  # every slot holds reward 100
    buffer = buffer.add(steps(8, 3, 1.0, 10))  # steps 8-10 of reward 1; the episode ends at 10
    sample = buffer.sample(jax.random.key(0), batch_size=512)
    n = sample.experience
    got = {
        int(t): (float(r), int(k)) for t, r, k in zip(n.first["t"], n.reward, n.steps, strict=True)
    }
    assert got[8] == (3.0, 3) and got[9] == (2.0, 2) and got[10] == (1.0, 1)
    for start in (9, 10):
        i = int(np.argmax(np.asarray(n.first["t"]) == start))
        assert int(n.last["t"][i]) == 10  # the episode's last step
        assert int(n.second["t"][i]) == 0  # past the end: zero
