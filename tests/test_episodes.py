"""Episode-aware sequence sampling, uniform and prioritised: windows that stay inside one
episode (never_cross) or are cut and zero-padded at its end (pad), checked against a NumPy
reference that enumerates the valid windows and models the priorities.

Compilation dominates the run time, so most tests share one configuration (`_make`) and the
module-level jitted functions below, which compile once per buffer configuration and shape.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
from equibuffer._buffers._episode_trajectory import (
    EpisodeSample,
    EpisodeTrajectoryBuffer,
    PrioritisedEpisodeSample,
    PrioritisedEpisodeTrajectoryBuffer,
)

from .helpers import chi_square_pvalue


# The shared configuration: an even ring length keeps a slot's step parity, so with period 2
# an aligned slot is aligned again after it is overwritten.
ROWS, LENGTH, S, PERIOD = 3, 16, 4, 2
N = 8192  # draws per sample
ALPHA, BETA = 0.7, 0.4
Uniform, Prioritised = EpisodeTrajectoryBuffer, PrioritisedEpisodeTrajectoryBuffer


def _example():
    return {"x": jnp.int32(0), "done": jnp.bool_(False)}


def _make(cls: type, mode: Any) -> Any:
    kw: dict[str, Any] = {"alpha": ALPHA} if cls is Prioritised else {}
    return cls(
        _example(), add_batch_size=ROWS, max_length_time_axis=LENGTH, sequence_length=S,
        period=PERIOD, mode=mode, **kw,
    )  # fmt: skip


_add = eb.filter_jit(lambda b, batch: b.add(batch))
_sample = eb.filter_jit(lambda b, k: b.sample(k, N))
_psample = eb.filter_jit(lambda b, k, beta: b.sample(k, N, beta=beta))
_set = eb.filter_jit(lambda b, sample, p: b.set_priorities(sample, p))


def _draw(buffer, key):
    if isinstance(buffer, Prioritised):
        return _psample(buffer, key, jnp.float32(BETA))
    return _sample(buffer, key)


def _add_one_by_one(buffer, x: np.ndarray, done: np.ndarray):
    """Add `(rows, T)` steps in the one-step form (`_add` compiled once for it)."""
    for t in range(x.shape[1]):
        buffer = _add(buffer, {"x": jnp.asarray(x[:, t]), "done": jnp.asarray(done[:, t])})
    return buffer


def _values(rows: int, start: int, t: int) -> np.ndarray:
    """Unique per (row, absolute step): row * 100_000 + step."""
    return (np.arange(rows)[:, None] * 100_000 + start + np.arange(t)[None, :]).astype(np.int32)


def _priority(rows: np.ndarray, starts: np.ndarray, round_: int) -> np.ndarray:
    """A priority per window (the same for a window drawn twice); some are 0."""
    return (((3 * rows + starts) % 5) * 0.75 + 0.25 * round_).astype(np.float32) * (
        (rows + starts) % 7 != 0
    )


class Reference:
    """Every step ever added, per row, with its episode-end flag; enumerates the valid
    windows and (for the prioritised buffer) the priority of each."""

    def __init__(self, mode: str, rows: int = ROWS, length: int = LENGTH, s: int = S,
                 period: int = PERIOD):  # fmt: skip
        self.rows, self.length, self.s, self.period, self.mode = rows, length, s, period, mode
        self.done = np.zeros((rows, 0), bool)
        self.prio: dict[tuple[int, int], float] = {}  # valid window -> priority
        self.max_p = 1.0

    @property
    def total(self) -> int:
        return self.done.shape[1]

    @property
    def oldest(self) -> int:
        return self.total - min(self.total, self.length)

    def add(self, done: np.ndarray) -> None:
        self.done = np.concatenate([self.done, done], axis=1)
        self._rerate()

    def relabel(self, done: np.ndarray) -> None:
        """The held steps' flags replaced (what `update` does)."""
        self.done[:, self.oldest :] = done
        self._rerate()

    def _rerate(self) -> None:
        # A window valid before keeps its priority (it is the same absolute window, so its
        # slot was not overwritten); a newly valid one enters at the max seen.
        self.prio = {w: self.prio.get(w, self.max_p) for w in self.valid()}

    def set_priorities(self, rows: np.ndarray, starts: np.ndarray, p: np.ndarray) -> None:
        applied = [0.0]
        for r, t, q in zip(rows.tolist(), starts.tolist(), p.tolist(), strict=True):
            if (r, t) in self.prio:  # dropped: overwritten since, or not valid
                self.prio[(r, t)] = q
                applied.append(q)
        self.max_p = max(self.max_p, *applied)

    def valid(self) -> set[tuple[int, int]]:
        """`(row, absolute start)` of every valid window."""
        total, s = self.total, self.s
        out = set()
        for r in range(self.rows):
            for t in range(self.oldest, total):
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

    def flat(self, windows) -> np.ndarray:
        out = np.zeros(self.rows * self.length, bool)
        for r, t in windows:
            out[r * self.length + t % self.length] = True
        return out

    def leaves(self) -> np.ndarray:
        out = np.zeros(self.rows * self.length, np.float32)
        for (r, t), p in self.prio.items():
            out[r * self.length + t % self.length] = np.float32(p) ** np.float32(ALPHA)
        return out

    def mask(self, row: int, start: int) -> np.ndarray:
        flags = self.done[row, start : start + self.s]
        flags = np.pad(flags, (0, self.s - flags.shape[0]))
        return np.cumsum(flags) - flags == 0


def _check_state(buffer, ref: Reference) -> None:
    valid = ref.valid()
    leaves = np.asarray(buffer.tree.nodes)[: ROWS * LENGTH]
    if isinstance(buffer, Prioritised):
        np.testing.assert_allclose(leaves, ref.leaves(), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(buffer.valid).reshape(-1), ref.flat(valid))
        assert float(buffer.max_priority) == pytest.approx(ref.max_p)
    else:
        np.testing.assert_array_equal(leaves, ref.flat(valid).astype(np.float32))
    assert int(buffer.num_valid_windows()) == len(valid)


def _check_sample(buffer, ref: Reference, sample) -> None:
    """Every drawn window is valid, in its place, with the reference's mask and data."""
    indices = np.asarray(sample.indices)
    starts = np.asarray(sample.steps).astype(np.int64)
    rows = indices // LENGTH
    valid = ref.valid()
    assert {(r, t) for r, t in zip(rows.tolist(), starts.tolist(), strict=True)} <= valid
    np.testing.assert_array_equal(indices % LENGTH, starts % LENGTH)
    masks = {w: ref.mask(*w) for w in valid}
    mask = np.stack([masks[(r, t)] for r, t in zip(rows.tolist(), starts.tolist(), strict=True)])
    np.testing.assert_array_equal(np.asarray(sample.mask), mask)
    if ref.mode == "never_cross":
        assert mask.all()
        assert not np.asarray(sample.experience["done"][:, :-1]).any()
    want = rows[:, None] * 100_000 + starts[:, None] + np.arange(S)[None, :]
    np.testing.assert_array_equal(np.asarray(sample.experience["x"]), np.where(mask, want, 0))
    assert not np.asarray(sample.experience["done"])[~mask].any()
    if isinstance(buffer, Prioritised):
        assert isinstance(sample, PrioritisedEpisodeSample)
        leaves = ref.leaves().astype(np.float64)
        probs = leaves[indices] / leaves.sum()
        np.testing.assert_allclose(np.asarray(sample.probabilities), probs, rtol=1e-5)
        weights = (probs / probs.min()) ** -BETA
        np.testing.assert_allclose(np.asarray(sample.weights), weights, rtol=1e-4)
    else:
        assert isinstance(sample, EpisodeSample)


def _check_distribution(buffer, ref: Reference, sample) -> None:
    """Frequencies match uniform (or `p**alpha / sum`) over the enumerated valid windows."""
    counts = np.bincount(np.asarray(sample.indices), minlength=ROWS * LENGTH)
    if isinstance(buffer, Prioritised):
        target = ref.leaves().astype(np.float64)
        # Stratified draws: each window's count is within 2 of its expectation.
        assert np.abs(counts - N * target / target.sum()).max() <= 2
    else:
        target = ref.flat(ref.valid()).astype(np.float64)
    assert chi_square_pvalue(counts, target / target.sum()) > 1e-3


def _stale_and_invalid(ref: Reference, previous) -> tuple[np.ndarray, np.ndarray]:
    """`(flat index, absolute start)` of updates that must be dropped or match the
    reference: the previous sample's windows (some overwritten since), every held window
    that is not valid (unaligned, crossing an end, incomplete), and windows overwritten."""
    rows, starts = [], []
    if previous is not None:
        rows.append(np.asarray(previous.indices) // LENGTH)
        starts.append(np.asarray(previous.steps).astype(np.int64))
    valid = ref.valid()
    held = [(r, t) for r in range(ROWS) for t in range(ref.oldest, ref.total)]
    gone = [(r, t) for r in range(ROWS) for t in range(max(ref.oldest - LENGTH, 0), ref.oldest)]
    extra = np.array([w for w in held if w not in valid] + gone, np.int64).reshape(-1, 2)
    rows.append(extra[:, 0])
    starts.append(extra[:, 1])
    return np.concatenate(rows), np.concatenate(starts)


def _update_priorities(buffer, ref: Reference, sample, previous, round_: int):
    """`set_priorities` with the sample's windows, followed by stale and invalid ones
    written into the tail of the same arrays (the same shapes: no recompilation)."""
    rows = np.asarray(sample.indices) // LENGTH
    starts = np.asarray(sample.steps).astype(np.int64)
    extra_rows, extra_starts = _stale_and_invalid(ref, previous)
    k = min(extra_rows.shape[0], N // 2)
    rows = np.concatenate([rows[: N - k], extra_rows[:k]])
    starts = np.concatenate([starts[: N - k], extra_starts[:k]])
    p = _priority(rows, starts, round_)
    indices = jnp.asarray(rows * LENGTH + starts % LENGTH, jnp.int32)
    steps = jnp.asarray(starts.astype(np.uint32))
    edited = eqx.tree_at(lambda s: (s.indices, s.steps), sample, (indices, steps))
    ref.set_priorities(rows, starts, p)
    return _set(buffer, edited, jnp.asarray(p))


# Steps per add (None: the one-step form); 13 leaves 3 old starts in a region capped at
# LENGTH. (More than LENGTH steps at once: `test_episode_end_function_and_update`.) Each
# configuration keeps to one or two shapes: every shape is a compilation.
SCENARIOS = [
    (Uniform, "never_cross", [3, 3, 3, 3, 3, 3, 3, 3]),
    (Uniform, "pad", [None] * 24),
    (Prioritised, "never_cross", [3, 3, 3, 3, 3, 3, 3, 3]),
    (Prioritised, "pad", [3, 3, 13, 3, 3, 3, 3, 3]),
]


@pytest.mark.parametrize(
    ("cls", "mode", "adds"), SCENARIOS, ids=[f"{c.__name__}-{m}" for c, m, _ in SCENARIOS]
)
def test_matches_reference_across_wraparound(cls, mode, adds, getkey):
    buffer = _make(cls, mode)
    ref = Reference(mode)
    rng = np.random.default_rng(len(adds))
    previous = None
    for round_, t in enumerate(adds):
        done = rng.random((ROWS, t or 1)) < 0.2
        x = _values(ROWS, ref.total, t or 1)
        if t is None:
            buffer = _add(buffer, {"x": jnp.asarray(x[:, 0]), "done": jnp.asarray(done[:, 0])})
        else:
            buffer = _add(buffer, {"x": jnp.asarray(x), "done": jnp.asarray(done)})
        ref.add(done)
        _check_state(buffer, ref)
        if not ref.valid() or ref.total < S:  # nothing valid, or `can_sample()` false
            assert bool(buffer.can_sample()) == (ref.total >= S)
            continue
        sample = _draw(buffer, getkey())
        _check_sample(buffer, ref, sample)
        if cls is Prioritised:
            buffer = _update_priorities(buffer, ref, sample, previous, round_)
            _check_state(buffer, ref)
            previous = sample
    assert ref.total > LENGTH  # wrapped around
    sample = _draw(buffer, getkey())
    _check_sample(buffer, ref, sample)
    _check_distribution(buffer, ref, sample)


def test_pad_mode_masks_and_zeros(getkey):
    # Row 0: episodes 0-1, 2-5, 6-; row 1: one episode; row 2: ends at every step.
    done = np.zeros((ROWS, 6), bool)
    done[0, [1, 5]] = done[2, :] = True
    buffer = _add_one_by_one(_make(Uniform, "pad"), _values(ROWS, 0, 6), done)
    # Even starts (period 2) of 6 held steps: row 0: 0 (cut at 1), 2 (whole, cut at 5),
    # 4 (cut at 5); row 1: 0 and 2 (whole), not 4 (4-7 not held, no end); row 2: 0, 2, 4.
    leaves = np.asarray(buffer.tree.nodes)[: ROWS * LENGTH].reshape(ROWS, LENGTH)
    assert [np.flatnonzero(r).tolist() for r in leaves] == [[0, 2, 4], [0, 2], [0, 2, 4]]
    sample = _sample(buffer, getkey())
    ends = {0: {0: 1, 2: 5, 4: 5}, 1: {0: 99, 2: 99}, 2: {0: 0, 2: 2, 4: 4}}
    rows, starts = np.asarray(sample.indices) // LENGTH, np.asarray(sample.steps)
    assert {(int(r), int(t)) for r, t in zip(rows, starts, strict=True)} == {
        (r, t) for r in ends for t in ends[r]
    }
    for i in range(0, N, 97):
        r, t = int(rows[i]), int(starts[i])
        n = min(ends[r][t] - t + 1, S)
        assert np.asarray(sample.mask[i]).tolist() == [True] * n + [False] * (S - n)
        want = [r * 100_000 + t + j for j in range(n)] + [0] * (S - n)
        assert np.asarray(sample.experience["x"][i]).tolist() == want


def test_pad_refresh_keeps_priorities_set_before_complete(getkey):
    """In pad mode a window cut by an episode end is valid (and may get a priority) before
    the steps after the end arrive; the adds that follow keep its priority, while a slot
    overwritten by new data starts afresh at the max priority. Stale updates are dropped."""
    a = np.float32(ALPHA)

    def add(buffer, start, end_at=None):
        done = np.zeros((ROWS, 3), bool)
        if end_at is not None:
            done[:, end_at - start] = True
        x = jnp.asarray(_values(ROWS, start, 3))
        buffer = _add(buffer, {"x": x, "done": jnp.asarray(done)})
        return buffer, np.asarray(buffer.tree.nodes)[: ROWS * LENGTH].reshape(ROWS, LENGTH)

    buffer, _ = add(_make(Prioritised, "pad"), 0)
    buffer, leaves = add(buffer, 3, end_at=5)  # every row: an episode ends at step 5
    # Starts 0, 2 (whole) and 4 (4-7, cut at 5: valid though steps 6, 7 are not held yet).
    assert np.flatnonzero(leaves.any(axis=0)).tolist() == [0, 2, 4]
    first = _psample(buffer, getkey(), jnp.float32(BETA))
    rows, starts = np.asarray(first.indices) // LENGTH, np.asarray(first.steps)
    table = np.array([0.5, 4.0, 2.0], np.float32)
    p = np.where(starts == 4, table[rows], np.float32(3.0))
    buffer = _set(buffer, first, jnp.asarray(p))
    buffer, leaves = add(buffer, 6)  # refreshes starts 3-8: window 4 keeps its priority
    np.testing.assert_allclose(leaves[:, 4], table**a, rtol=1e-6)
    assert not leaves[:, 6].any()  # 6-9: neither whole nor cut yet
    buffer, leaves = add(buffer, 9)  # 6-9 whole: enters at the max priority seen
    np.testing.assert_allclose(leaves[:, 6], np.float32(4.0) ** a, rtol=1e-6)
    np.testing.assert_allclose(leaves[:, 4], table**a, rtol=1e-6)
    for start in (12, 15):
        buffer, _ = add(buffer, start)
    buffer, leaves = add(buffer, 18, end_at=20)  # slot 4 now holds step 20, cut at once
    # Window 20 is new: fresh at the max priority, not the old window 4's priority.
    np.testing.assert_allclose(leaves[:, 4], np.float32(4.0) ** a, rtol=1e-6)
    assert np.asarray(buffer.valid)[:, 4].all()
    # The first sample's windows (0, 2, 4) were all overwritten since: updates dropped.
    after = _set(buffer, first, jnp.full(N, 9.0))
    np.testing.assert_array_equal(np.asarray(after.tree.nodes), np.asarray(buffer.tree.nodes))
    assert float(after.max_priority) == 4.0


def test_prioritised_update_keeps_or_resets_priorities(getkey):
    buffer = _make(Prioritised, "never_cross")
    ref = Reference("never_cross")
    for start in range(0, 12, 3):
        done = _values(ROWS, start, 3) % 100_000 % 6 == 5  # episodes end at steps 5, 11
        buffer = _add(buffer, {"x": jnp.asarray(_values(ROWS, start, 3)), "done": done})
        ref.add(done)
    sample = _psample(buffer, getkey(), jnp.float32(BETA))
    buffer = _update_priorities(buffer, ref, sample, None, 0)
    _check_state(buffer, ref)
    before = ref.valid()
    # Relabel: episodes end at steps 3, 9 instead. Windows valid before and after keep
    # their priority (0, 6), newly valid ones enter at the max seen (4), the others drop
    # to 0 (2, 8).
    buffer = eb.filter_jit(lambda b: b.update(_relabel))(buffer)
    ref.relabel(_values(ROWS, 0, 12) % 100_000 % 6 == 3)
    _check_state(buffer, ref)
    after = ref.valid()
    assert {t for _, t in before} == {0, 2, 6, 8} and {t for _, t in after} == {0, 4, 6}


def _relabel(step):
    return {**step, "done": step["x"] % 100_000 % 6 == 3}


def _end_of(step):
    return step["terminated"] | step["truncated"]


def test_episode_end_function_and_update():
    example = {"x": jnp.int32(0), "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}
    buffer = EpisodeTrajectoryBuffer(
        example, add_batch_size=1, max_length_time_axis=8, sequence_length=3, episode_end=_end_of
    )
    add = eb.filter_jit(lambda b, batch: b.add(batch))
    # 10 steps into a ring of 8: only steps 2-9 are kept. Ends at 3 and 5.
    x = jnp.arange(10, dtype=jnp.int32)[None]
    term, trunc = x == 3, x == 5
    buffer = add(buffer, {"x": x, "terminated": term, "truncated": trunc})
    assert int(buffer.num_valid_windows()) == 2  # 6-8 and 7-9 (4-6 crosses the end at 5)
    leaves = np.asarray(buffer.tree.nodes)[:8]
    assert np.flatnonzero(leaves).tolist() == [6, 7]
    x = jnp.arange(10, 20, dtype=jnp.int32)[None]
    no = jnp.zeros((1, 10), bool)
    buffer = add(buffer, {"x": x, "terminated": no, "truncated": no})
    assert int(buffer.num_valid_windows()) == 6  # held 12-19: starts 12-17
    # Relabel: a truncation at step 14 leaves starts 12 (ends at its last), 15, 16, 17.
    relabel = eb.filter_jit(lambda b: b.update(lambda s: {**s, "truncated": s["x"] == 14}))
    buffer = relabel(buffer)
    assert int(buffer.num_valid_windows()) == 4
    slots = np.flatnonzero(np.asarray(buffer.tree.nodes)[:8])
    assert sorted((slots - 12) % 8 + 12) == [12, 15, 16, 17]


def test_no_window_fits_raises_inside_jit(getkey):
    """`can_sample()` is a function of the counters; a state with ready counters and nothing
    valid raises inside `sample`, with a message that says which and what to change."""
    all_ends = {"x": jnp.zeros((ROWS, 3), jnp.int32), "done": jnp.ones((ROWS, 3), bool)}
    for cls in (Uniform, Prioritised):
        buffer = _make(cls, "never_cross")
        with pytest.raises(Exception, match="cannot be sampled yet"):
            _draw(buffer, getkey())
        buffer = _add(_add(buffer, all_ends), all_ends)  # episodes of 1 step
        assert bool(buffer.can_sample()) and int(buffer.num_valid_windows()) == 0
        with pytest.raises(Exception, match="no window of sequence_length=4 fits inside an ep"):
            _draw(buffer, getkey())
        with pytest.raises(Exception, match="mode='pad'"):
            _draw(buffer, getkey())
        if cls is Uniform:  # the shape this configuration is compiled for elsewhere
            ones = np.ones((ROWS, 6), bool)
            padded = _add_one_by_one(_make(cls, "pad"), _values(ROWS, 0, 6), ones)
        else:
            padded = _add(_add(_make(cls, "pad"), all_ends), all_ends)
        assert (np.asarray(_draw(padded, getkey()).mask).sum(axis=1) == 1).all()


def test_all_priorities_zero_raises(getkey):
    buffer = _make(Prioritised, "pad")
    steps = {"x": jnp.zeros((ROWS, 3), jnp.int32), "done": jnp.zeros((ROWS, 3), bool)}
    buffer = _add(_add(buffer, steps), steps)
    sample = _psample(buffer, getkey(), jnp.float32(BETA))
    # Stratified: every one of the few valid windows is drawn, so all get priority 0.
    assert np.unique(np.asarray(sample.indices)).size == int(buffer.num_valid_windows())
    buffer = _set(buffer, sample, jnp.zeros(N))
    assert float(buffer.tree.total()) == 0.0 and bool(buffer.can_sample())
    with pytest.raises(Exception, match="every valid window has priority 0"):
        _psample(buffer, getkey(), jnp.float32(BETA))
    # New windows enter at the max priority seen (still 1): sampling works again.
    buffer = _add(buffer, steps)
    assert float(_psample(buffer, getkey(), jnp.float32(BETA)).probabilities.max()) > 0


def test_vmapped_training_with_can_sample_cond():
    rows = 4

    def train(seed):
        key = jax.random.key(seed)
        uniform = Uniform(
            _example(), add_batch_size=rows, max_length_time_axis=32, sequence_length=6
        )
        prioritised = Prioritised(
            _example(), add_batch_size=rows, max_length_time_axis=32, sequence_length=6, mode="pad"
        )

        def step(carry, t):
            uniform, prioritised, key, total = carry
            key, k_done, k_u, k_p = jax.random.split(key, 4)
            done = jax.random.uniform(k_done, (rows,)) < 0.1
            batch = {"x": jnp.full((rows,), t, jnp.int32), "done": done}
            uniform, prioritised = uniform.add(batch), prioritised.add(batch)

            def learn_uniform(buffer, k):
                return buffer.sample(k, 8).experience["x"].sum()

            def learn_prioritised(buffer, k):
                sample = buffer.sample(k, 8, beta=0.5)
                loss = jnp.where(sample.mask, sample.experience["x"], 0).sum(axis=1)
                loss = loss.astype(jnp.float32)
                return buffer.set_priorities(sample, loss + 1.0), sample.mask.sum()

            total = total + jax.lax.cond(
                uniform.can_sample(), learn_uniform, lambda b, k: jnp.int32(0), uniform, k_u
            )
            prioritised, seen = jax.lax.cond(
                prioritised.can_sample(),
                learn_prioritised,
                lambda b, k: (b, jnp.int32(0)),
                prioritised,
                k_p,
            )
            ready = (uniform.can_sample(), prioritised.can_sample())
            return (uniform, prioritised, key, total + seen), ready

        init = (uniform, prioritised, key, jnp.int32(0))
        (uniform, prioritised, _, total), ready = jax.lax.scan(
            step, init, jnp.arange(40, dtype=jnp.int32)
        )
        return total, ready, prioritised.max_priority

    total, (ready_u, ready_p), max_p = jax.jit(jax.vmap(train))(jnp.arange(3))
    for ready in (ready_u, ready_p):
        assert not ready[:, :5].any() and ready[:, 5:].all()
    assert (total > 0).all() and (max_p > 1).all()


def test_donated_jit_does_not_retrace(getkey):
    kw: dict[str, Any] = {"add_batch_size": 2, "max_length_time_axis": 20, "sequence_length": 4}
    example = {"obs": jnp.zeros(3), "done": jnp.bool_(False)}
    uniform = Uniform(example, mode="pad", **kw)
    prioritised = Prioritised(example, mode="pad", **kw)

    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(uniform, prioritised, batch, key):
        k_u, k_p = jax.random.split(key)
        uniform, prioritised = uniform.add(batch), prioritised.add(batch)
        sample = prioritised.sample(k_p, 5, beta=0.4)
        loss = jnp.where(sample.mask, sample.experience["obs"].sum(axis=-1), 0.0).sum(axis=1)
        prioritised = prioritised.set_priorities(sample, loss + 0.1)
        return uniform, prioritised, uniform.sample(k_u, 5).experience["obs"].sum()

    rng = np.random.default_rng(0)
    for _ in range(8):
        batch = {"obs": jnp.ones((2, 4, 3)), "done": jnp.asarray(rng.random((2, 4)) < 0.3)}
        uniform, prioritised, _ = step(uniform, prioritised, batch, getkey())
    assert uniform.storage.steps_added() == prioritised.storage.steps_added() == 32


@pytest.mark.parametrize("mode", ["never_cross", "pad"])
def test_motivating_case_scaled(mode, getkey):
    # The case: (84, 84, 3) obs, 100 envs, 100_000 sequences of 40 steps (see
    # docs/episodes.md). Scaled here: (4, 4, 3) obs and 160 steps per env (16_000 steps);
    # the window rule is the same.
    envs, s = 100, 40
    example = {"obs": jnp.zeros((4, 4, 3), jnp.uint8), "step": jnp.int32(0), "done": jnp.bool_(0)}
    buffer = EpisodeTrajectoryBuffer(
        example, add_batch_size=envs, sequence_length=s, capacity=envs * 160, mode=mode
    )
    assert buffer.capacity == 16_000 and buffer.max_length_time_axis == 160
    # Even envs: one long episode (steps 0-119); odd envs: episodes of 20 steps.
    t = np.arange(120)
    done = np.where(np.arange(envs)[:, None] % 2 == 0, t[None] == 119, t[None] % 20 == 19)
    obs = jnp.zeros((envs, 120, 4, 4, 3), jnp.uint8)
    steps = jnp.broadcast_to(jnp.arange(120, dtype=jnp.int32), (envs, 120))
    batch = {"obs": obs, "step": steps, "done": jnp.asarray(done)}
    buffer = eb.filter_jit(lambda b, x: b.add(x))(buffer, batch)
    leaves = np.asarray(buffer.tree.nodes)[: envs * 160].reshape(envs, 160)
    # Windows at any step of the long episode: 11-50 and 27-66, not only 0-39, 40-79.
    assert leaves[0, 11] > 0 and leaves[0, 27] > 0 and leaves[0, 80] > 0
    if mode == "never_cross":
        assert leaves[0, 81] == 0  # 81-120 would leave the episode
        assert not leaves[1::2].any()  # 20-step episodes are skipped
    else:
        assert (leaves[1::2, :120] > 0).all()  # every start of a short episode, padded
    sample = eb.filter_jit(lambda b, k: b.sample(k, 512))(buffer, getkey())
    starts = np.asarray(sample.steps)
    assert (starts % s != 0).any()
    first = np.asarray(sample.experience["step"][:, 0])
    np.testing.assert_array_equal(first, starts)
    rows = np.asarray(sample.indices) // 160
    mask = np.asarray(sample.mask)
    if mode == "never_cross":
        assert (rows % 2 == 0).all() and mask.all()
    else:
        short = rows % 2 == 1
        assert short.any() and (mask[short].sum(axis=1) <= 20).all()
        assert (mask[short].sum(axis=1) == 20 - starts[short] % 20).all()
        assert (np.asarray(sample.experience["step"])[~mask] == 0).all()


def test_construction_errors():
    kw: dict[str, Any] = {"add_batch_size": 2, "max_length_time_axis": 8, "sequence_length": 3}
    for make in (Uniform, Prioritised):
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
        Uniform(_example(), add_batch_size=1 << 13, max_length_time_axis=1 << 12, sequence_length=2)
    with pytest.raises(ValueError, match="alpha"):
        Prioritised(_example(), alpha=-1.0, **kw)
