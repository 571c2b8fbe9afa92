"""Episode-aware sequence sampling: windows that stay inside one episode (never_cross) or are
cut and zero-padded at its end (pad), checked against a NumPy enumeration of valid windows."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equibuffer._buffers._episodes import EpisodeSample, EpisodeTrajectoryBuffer

from .helpers import chi_square_pvalue


class Reference:
    """Every step ever added, per row, with its episode-end flag; enumerates valid windows."""

    def __init__(self, rows: int, length: int, s: int, period: int, mode: str):
        self.rows, self.length, self.s, self.period, self.mode = rows, length, s, period, mode
        self.done = np.zeros((rows, 0), bool)

    def add(self, done: np.ndarray) -> None:
        self.done = np.concatenate([self.done, done], axis=1)

    @property
    def total(self) -> int:
        return self.done.shape[1]

    def valid(self) -> set[tuple[int, int]]:
        """`(row, absolute start)` of every valid window."""
        total, s = self.total, self.s
        oldest = total - min(total, self.length)
        out = set()
        for r in range(self.rows):
            for t in range(oldest, total):
                if t % self.period:
                    continue
                inner = self.done[r, t : min(t + s - 1, total)]
                if self.mode == "never_cross":
                    ok = t + s <= total and not inner.any()
                else:
                    ok = t + s <= total or inner.any()
                if ok:
                    out.add((r, t))
        return out

    def mask(self, row: int, start: int) -> np.ndarray:
        flags = self.done[row, start : start + self.s]
        flags = np.pad(flags, (0, self.s - flags.shape[0]))
        return np.cumsum(flags) - flags == 0


def _values(rows: int, start: int, t: int) -> np.ndarray:
    """Unique per (row, absolute step): row * 100_000 + step."""
    return (np.arange(rows)[:, None] * 100_000 + start + np.arange(t)[None, :]).astype(np.int32)


def _example():
    return {"x": jnp.int32(0), "done": jnp.bool_(False)}


@pytest.mark.parametrize("mode", ["never_cross", "pad"])
@pytest.mark.parametrize("period", [1, 3])
def test_matches_reference_across_wraparound(mode, period, getkey):
    rows, length, s = 3, 13, 4
    buffer = EpisodeTrajectoryBuffer(
        _example(), add_batch_size=rows, max_length=length, sequence_length=s, period=period,
        mode=mode,
    )  # fmt: skip
    ref = Reference(rows, length, s, period, mode)
    rng = np.random.default_rng(period)
    add = eqx.filter_jit(lambda b, batch: b.add(batch))
    sample_fn = eqx.filter_jit(lambda b, k: b.sample(k, 64))
    for t in [1, 3, 1, 3, 1, 16, 3, 1, 7, 3, 1]:  # 16 > length: only the newest kept
        done = rng.random((rows, t)) < 0.2
        x = _values(rows, ref.total, t)
        batch = {"x": jnp.asarray(x), "done": jnp.asarray(done)}
        if t == 1 and ref.total % 2:
            batch = {"x": batch["x"][:, 0], "done": batch["done"][:, 0]}  # one-step form
        buffer = add(buffer, batch)
        ref.add(done)
        valid = ref.valid()
        leaves = np.asarray(buffer.tree.values())
        expected = np.zeros(rows * length)
        for r, start in valid:
            expected[r * length + start % length] = 1.0
        np.testing.assert_array_equal(leaves, expected)
        assert int(buffer.num_valid_windows()) == len(valid)
        if not valid or not bool(buffer.can_sample()):
            continue
        sample = sample_fn(buffer, getkey())
        assert isinstance(sample, EpisodeSample)
        indices, starts = np.asarray(sample.indices), np.asarray(sample.steps).astype(np.int64)
        rows_of = indices // length
        assert all(
            (r, t0) in valid for r, t0 in zip(rows_of.tolist(), starts.tolist(), strict=True)
        )
        np.testing.assert_array_equal(indices % length, starts % length)
        mask = np.stack(
            [ref.mask(r, t0) for r, t0 in zip(rows_of.tolist(), starts.tolist(), strict=True)]
        )
        np.testing.assert_array_equal(np.asarray(sample.mask), mask)
        if mode == "never_cross":
            assert mask.all()
            assert not np.asarray(sample.experience["done"][:, :-1]).any()
        want = rows_of[:, None] * 100_000 + starts[:, None] + np.arange(s)[None, :]
        np.testing.assert_array_equal(np.asarray(sample.experience["x"]), np.where(mask, want, 0))
        assert not np.asarray(sample.experience["done"])[~mask].any()


@pytest.mark.parametrize("mode", ["never_cross", "pad"])
def test_exactly_uniform_over_valid_windows(mode, getkey):
    rows, length, s = 2, 24, 5
    buffer = EpisodeTrajectoryBuffer(
        _example(), add_batch_size=rows, max_length=length, sequence_length=s, mode=mode
    )
    ref = Reference(rows, length, s, 1, mode)
    rng = np.random.default_rng(0)
    for t in [10, 10, 9]:  # wraps
        done = rng.random((rows, t)) < 0.15
        buffer = buffer.add({"x": jnp.asarray(_values(rows, ref.total, t)), "done": done})
        ref.add(done)
    valid = sorted(ref.valid())
    assert 10 < len(valid) < rows * length
    n = 40_000
    sample = jax.jit(lambda b, k: b.sample(k, n))(buffer, getkey())
    found = {key: i for i, key in enumerate(valid)}
    counts = np.zeros(len(valid))
    rows_of = np.asarray(sample.indices) // length
    for row, start in zip(rows_of.tolist(), np.asarray(sample.steps).tolist(), strict=True):
        counts[found[(row, start)]] += 1  # KeyError: an invalid window was drawn
    assert chi_square_pvalue(counts, np.full(len(valid), 1 / len(valid))) > 1e-3


def test_pad_mode_masks_and_zeros():
    buffer = EpisodeTrajectoryBuffer(
        {"obs": jnp.zeros(2), "done": jnp.bool_(False)},
        add_batch_size=1, max_length=16, sequence_length=4, mode="pad",
    )  # fmt: skip
    done = np.array([[False, True, False, False, False, True, False]])  # episodes 0-1, 2-5, 6-
    obs = jnp.broadcast_to(jnp.arange(1.0, 8.0)[None, :, None], (1, 7, 2))
    buffer = buffer.add({"obs": obs, "done": jnp.asarray(done)})
    # Starts 0, 1 (cut at 1), 2, 3 (whole), 4, 5 (cut at 5); 6 is neither whole nor cut yet.
    assert np.asarray(buffer.tree.values())[:7].tolist() == [1, 1, 1, 1, 1, 1, 0]
    sample = buffer.sample(jax.random.key(1), 200)
    for i in range(200):
        start = int(sample.steps[i])
        got = np.asarray(sample.experience["obs"][i, :, 0])
        mask = np.asarray(sample.mask[i])
        end = {0: 1, 1: 1, 2: 5, 3: 5, 4: 5, 5: 5}[start]
        n = min(end - start + 1, 4)
        assert mask.tolist() == [True] * n + [False] * (4 - n)
        assert got.tolist() == [start + 1.0 + j for j in range(n)] + [0.0] * (4 - n)


def test_episode_end_function_and_update():
    example = {"x": jnp.int32(0), "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}
    buffer = EpisodeTrajectoryBuffer(
        example, add_batch_size=1, max_length=8, sequence_length=3,
        episode_end=lambda step: step["terminated"] | step["truncated"],
    )  # fmt: skip
    term = jnp.array([[False, True, False, False, False, False]])
    trunc = jnp.array([[False, False, False, True, False, False]])
    buffer = buffer.add({"x": jnp.arange(6)[None], "terminated": term, "truncated": trunc})
    # Episodes 0-1, 2-3, 4-5: no 3-step window fits except none... starts 4? 4-6 not held.
    assert int(buffer.num_valid_windows()) == 0
    buffer = buffer.add({"x": jnp.arange(6, 8)[None], "terminated": jnp.zeros((1, 2), bool),
                         "truncated": jnp.zeros((1, 2), bool)})  # fmt: skip
    assert int(buffer.num_valid_windows()) == 2  # starts 4 and 5
    # Relabel: clear every flag, so all 6 windows of the 8 held steps become valid.
    buffer = buffer.update(lambda step: {**step, "terminated": jnp.bool_(False),
                                         "truncated": jnp.bool_(False)})  # fmt: skip
    assert int(buffer.num_valid_windows()) == 6


def test_no_window_fits_raises_inside_jit():
    buffer = EpisodeTrajectoryBuffer(_example(), add_batch_size=2, max_length=16, sequence_length=5)
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 4))
    with pytest.raises(Exception, match="cannot be sampled yet"):
        sample(buffer, jax.random.key(0))
    done = jnp.tile(jnp.array([False, False, True]), 4)[None].repeat(2, 0)  # episodes of 3
    buffer = buffer.add({"x": jnp.zeros((2, 12), jnp.int32), "done": done})
    assert bool(buffer.can_sample())
    with pytest.raises(Exception, match="no window of sequence_length=5 fits inside an episode"):
        sample(buffer, jax.random.key(0))
    with pytest.raises(Exception, match="mode='pad'"):
        sample(buffer, jax.random.key(0))
    padded = EpisodeTrajectoryBuffer(
        _example(), add_batch_size=2, max_length=16, sequence_length=5, mode="pad"
    ).add({"x": jnp.zeros((2, 12), jnp.int32), "done": done})
    assert sample(padded, jax.random.key(0)).mask.sum(axis=1).max() <= 3


def test_vmapped_training_with_can_sample_cond():
    def train(seed):
        key = jax.random.key(seed)
        buffer = EpisodeTrajectoryBuffer(
            _example(), add_batch_size=4, max_length=32, sequence_length=6
        )

        def step(carry, t):
            buffer, key, total = carry
            key, k_done, k_sample = jax.random.split(key, 3)
            done = jax.random.uniform(k_done, (4,)) < 0.1
            buffer = buffer.add({"x": jnp.full((4,), t, jnp.int32), "done": done})

            def learn(buffer, k):
                return buffer.sample(k, 8).experience["x"].sum()

            total = total + jax.lax.cond(
                buffer.can_sample(), learn, lambda b, k: jnp.int32(0), buffer, k_sample
            )
            return (buffer, key, total), buffer.can_sample()

        (buffer, _, total), ready = jax.lax.scan(
            step, (buffer, key, jnp.int32(0)), jnp.arange(40, dtype=jnp.int32)
        )
        return total, ready, buffer.num_valid_windows()

    total, ready, valid = jax.jit(jax.vmap(train))(jnp.arange(3))
    assert not ready[:, :5].any() and ready[:, 5:].all()
    assert (total > 0).all() and (valid > 0).all()


def test_donated_jit_does_not_retrace(getkey):
    buffer = EpisodeTrajectoryBuffer(
        {"obs": jnp.zeros(3), "done": jnp.bool_(False)},
        add_batch_size=2, max_length=20, sequence_length=4, mode="pad",
    )  # fmt: skip

    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        return buffer, buffer.sample(key, 5).experience["obs"].sum()

    rng = np.random.default_rng(0)
    for _ in range(8):
        batch = {"obs": jnp.ones((2, 4, 3)), "done": jnp.asarray(rng.random((2, 4)) < 0.3)}
        buffer, _ = step(buffer, batch, getkey())
    assert buffer.storage.steps_added() == 32


@pytest.mark.parametrize("mode", ["never_cross", "pad"])
def test_motivating_case_scaled(mode, getkey):
    # The case: (84, 84, 3) obs, 100 envs, 100_000 sequences of 40 steps. Scaled here:
    # (8, 8, 3) obs and 200 steps per env (20_000 steps); the window rule is the same.
    envs, s = 100, 40
    example = {"obs": jnp.zeros((8, 8, 3), jnp.uint8), "step": jnp.int32(0), "done": jnp.bool_(0)}
    buffer = EpisodeTrajectoryBuffer(
        example, add_batch_size=envs, sequence_length=s, capacity=envs * 200, mode=mode
    )
    assert buffer.capacity == 20_000 and buffer.max_length == 200
    # Even envs: one long episode (steps 0-119); odd envs: episodes of 20 steps.
    t = np.arange(120)
    done = np.where(np.arange(envs)[:, None] % 2 == 0, t[None] == 119, t[None] % 20 == 19)
    obs = jnp.zeros((envs, 120, 8, 8, 3), jnp.uint8)
    steps = jnp.broadcast_to(jnp.arange(120, dtype=jnp.int32), (envs, 120))
    batch = {"obs": obs, "step": steps, "done": jnp.asarray(done)}
    buffer = eqx.filter_jit(lambda b, x: b.add(x))(buffer, batch)
    leaves = np.asarray(buffer.tree.values()).reshape(envs, 200)
    # Windows at any step of the long episode: 11-50 and 27-66, not only 0-39, 40-79.
    assert leaves[0, 11] == 1 and leaves[0, 27] == 1 and leaves[0, 80] == 1
    if mode == "never_cross":
        assert leaves[0, 81] == 0  # 81-120 would leave the episode
        assert not leaves[1::2].any()  # 20-step episodes are skipped
    else:
        assert leaves[1::2, :120].all()  # every start of a short episode is usable, padded
    sample = jax.jit(lambda b, k: b.sample(k, 512))(buffer, getkey())
    starts = np.asarray(sample.steps)
    assert (starts % s != 0).any()
    first = np.asarray(sample.experience["step"][:, 0])
    np.testing.assert_array_equal(first, starts)
    rows = np.asarray(sample.indices) // 200
    mask = np.asarray(sample.mask)
    if mode == "never_cross":
        assert (rows % 2 == 0).all() and mask.all()
    else:
        short = rows % 2 == 1
        assert short.any() and (mask[short].sum(axis=1) <= 20).all()
        assert (mask[short].sum(axis=1) == 20 - starts[short] % 20).all()
        assert (np.asarray(sample.experience["step"])[~mask] == 0).all()


def test_construction_errors():
    make = EpisodeTrajectoryBuffer
    kw: dict[str, Any] = {"add_batch_size": 2, "max_length": 8, "sequence_length": 3}
    with pytest.raises(ValueError, match=r"episode_end='end'.*\['done'\]"):
        make(_example(), episode_end="end", **kw)
    with pytest.raises(TypeError, match=r"\['done'\] must be a 0-d bool.*int32"):
        make({"done": jnp.int32(0)}, **kw)
    with pytest.raises(TypeError, match=r"\['done'\] must be a 0-d bool.*shape \(2,\)"):
        make({"done": jnp.zeros(2, bool)}, **kw)
    with pytest.raises(TypeError, match="must return a 0-d bool"):
        make(_example(), episode_end=lambda s: s["x"], **kw)
    with pytest.raises((ValueError, TypeError), match="mode"):
        make(_example(), mode="clip", **kw)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="2\\*\\*24"):
        make(_example(), add_batch_size=1 << 13, max_length=1 << 12, sequence_length=2)
