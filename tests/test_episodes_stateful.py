"""Stateful test of the episode-aware buffers, uniform and prioritised, in both modes: random
adds with random episode ends (ends at the ring's wrap, episodes shorter than the window),
samples and priority updates (current, stale, invalid), every observable result compared with
the NumPy reference of `tests/reference.py`.

Only the public API is used, and every buffer is built by `_make`. The configurations come
from a small set, so that each one's jitted functions compile once per process.
"""

import dataclasses
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, rule

import equibuffer as eb

from .helpers import CountedMachine, stateful_settings
from .reference import BufferReference, EpisodeRule, flat_index, Priorities, tags, window_of


EXAMPLE = {"x": jnp.int32(0), "obs": jnp.zeros(2, jnp.float32), "done": jnp.bool_(False)}


def _done(step):
    """`episode_end` as a function of one step (the other form is the leaf's name)."""
    return step["done"]


@dataclasses.dataclass(frozen=True)
class Config:
    prioritised: bool
    mode: str
    rows: int
    length: int
    sequence_length: int
    period: int
    alpha: float
    episode_end: Any
    min_length_time_axis: int | None = None


def _make(c: Config) -> Any:
    """The one place the episode-aware buffers are built."""
    kw: dict[str, Any] = dict(
        add_batch_size=c.rows,
        max_length_time_axis=c.length,
        sequence_length=c.sequence_length,
        period=c.period,
        mode=c.mode,
        episode_end=c.episode_end,
        min_length_time_axis=c.min_length_time_axis,
    )
    if c.prioritised:
        return eb.PrioritisedEpisodeTrajectoryBuffer(EXAMPLE, alpha=c.alpha, **kw)
    return eb.EpisodeTrajectoryBuffer(EXAMPLE, **kw)


# (rows, length, sequence_length, period, alpha, episode_end, min_length): windows of one
# step and of the whole ring, periods that do and do not divide the ring, a period longer
# than the window, a min_length above the window.
SHAPES = [
    (1, 5, 3, 1, 0.5, "done", None),
    (2, 6, 4, 2, 1.0, _done, None),
    (3, 7, 2, 3, 0.0, "done", 5),
    (2, 4, 1, 1, 0.7, "done", None),
    (1, 6, 6, 1, 1.0, "done", None),
    (2, 5, 2, 4, 0.5, _done, None),
]
UNIFORM = [Config(False, mode, *shape) for shape in SHAPES for mode in ("never_cross", "pad")]
PRIORITISED = [dataclasses.replace(c, prioritised=True) for c in UNIFORM]
# Steps per add. None: the one-step form; 9 is more than any ring; "wrap": one step at a
# time up to the ring's last slot, that step ending an episode in some rows.
ADD_STEPS = (5, None, 2, 9, "wrap")
BATCH = 16
END = st.sampled_from([False, False, False, True])  # an episode end on about 1 step in 4
PRIORITIES = (0.0, 0.25, 1.0, 2.0, 3.5)
DROPPED = 8.0  # the priority of updates to windows not valid now
REFUSALS = {
    "too early": "cannot be sampled yet",
    "no window": "no window of sequence_length=[0-9]+ fits inside an episode",
    "all zero": "every valid window has priority 0",
}


def _observe(buffer) -> dict[str, Any]:
    return {
        "can_sample": buffer.can_sample(),
        "size": buffer.size(),
        "num_valid_windows": buffer.num_valid_windows(),
    }


@eb.filter_jit
def _add(buffer, batch):
    buffer = buffer.add(batch)
    return buffer, _observe(buffer)


@eb.filter_jit
def _sample(buffer, key):
    return buffer.sample(key, BATCH)


@eb.filter_jit
def _psample(buffer, key, beta):
    return buffer.sample(key, BATCH, beta=beta)


@eb.filter_jit
def _set(buffer, sample, priorities):
    buffer = buffer.set_priorities(sample, priorities)
    return buffer, _observe(buffer)


@eb.filter_jit
def _set_at(buffer, indices, steps, priorities):
    buffer = buffer.set_priorities(indices, priorities, steps=steps)
    return buffer, _observe(buffer)


def _steps(start: int, done: np.ndarray) -> dict[str, np.ndarray]:
    """`(rows, T)` steps from absolute step `start`, values unique per (row, step)."""
    x = tags(done.shape[0], start, done.shape[1])
    return {"x": x, "obs": np.stack([x, -x], axis=-1).astype(np.float32), "done": done}


class EpisodeMachine(CountedMachine):
    """Random adds and samples of an `EpisodeTrajectoryBuffer`."""

    @initialize(config=st.sampled_from(UNIFORM), seed=st.integers(0, 2**32 - 1))
    def setup(self, config: Config, seed: int):
        self.start(config, seed)

    def start(self, config: Config, seed: int) -> None:
        self.c = config
        self.buffer = _make(config)
        rule = EpisodeRule(config.sequence_length, config.period, config.mode, "done")
        alpha = config.alpha if config.prioritised else None
        self.ref = BufferReference(
            config.rows,
            config.length,
            rule,
            min_steps_per_row=config.min_length_time_axis,
            alpha=alpha,
        )
        self.history, self.rule = self.ref.history, self.ref.rule
        self.priorities = self.ref.priorities or Priorities(0.0)  # (unused when uniform)
        self.key = jax.random.key(seed)
        self.samples: list[Any] = []  # the latest samples, for set_priorities

    # --- adds

    @rule(t=st.sampled_from(ADD_STEPS), data=st.data())
    def add(self, t: int | str | None, data: st.DataObject):
        rows = self.c.rows
        if t == "wrap":
            left = self.c.length - self.history.total % self.c.length
            ends = st.lists(st.booleans(), min_size=rows, max_size=rows)
            last = np.array(data.draw(ends, label="episode ends at the wrap"), bool)
            for k in range(left):
                self._add(None, (last if k == left - 1 else np.zeros(rows, bool))[:, None])
        else:
            assert not isinstance(t, str)
            n = 1 if t is None else t
            flags = data.draw(st.lists(END, min_size=rows * n, max_size=rows * n), label="done")
            self._add(t, np.array(flags, bool).reshape(rows, n))
        self.after_add()

    def _add(self, t: int | None, done: np.ndarray) -> None:
        steps = _steps(self.history.total, done)
        batch = steps if t is not None else {k: v[:, 0] for k, v in steps.items()}
        self.buffer, seen = _add(self.buffer, jax.tree.map(jnp.asarray, batch))
        self.ref.add(steps)
        self._check_counters(seen)

    def after_add(self) -> None:
        pass

    def _check_counters(self, seen: dict[str, Any]) -> None:
        c, h = self.c, self.history
        assert bool(seen["can_sample"]) == self.ref.ready()
        assert int(seen["size"]) == h.fill * c.rows
        assert int(seen["num_valid_windows"]) == len(self.rule.valid(h))

    # --- samples

    @rule(beta=st.sampled_from([0.0, 0.5, 1.0]))
    def sample(self, beta: float):
        self._sample(beta)

    def _sample(self, beta: float, too_early: bool = True) -> Any:
        """Sample and check the result against the reference, or check the error that the
        reference expects (`too_early=False`: not when `can_sample()` is false)."""
        c = self.c
        valid = self.ref.valid()
        refusal = self.ref.refusal()
        expected = None if refusal is None else REFUSALS[refusal]
        if refusal == "too early" and not too_early:
            return None
        self.key, key = jax.random.split(self.key)

        def draw():
            if c.prioritised:
                return _psample(self.buffer, key, jnp.float32(beta))
            return _sample(self.buffer, key)

        if expected is not None:
            with pytest.raises(Exception, match=expected):
                draw()
            return None
        sample = draw()
        self._check_sample(sample, valid, beta)
        self.samples = [*self.samples[-2:], sample]
        return sample

    def _check_sample(self, sample: Any, valid: set, beta: float) -> None:
        """Every window valid, in its place, with the reference's mask and data (zero past an
        episode end), probabilities and weights (`BufferReference.check_sample`)."""
        s = self.c.sequence_length
        x, obs = sample.experience["x"], sample.experience["obs"]
        assert x.shape == (BATCH, s) and obs.shape == (BATCH, s, 2)
        assert sample.mask.shape == (BATCH, s)
        assert set(self.ref.windows(sample)) <= valid
        self.ref.check_sample(sample, beta)


class PrioritisedEpisodeMachine(EpisodeMachine):
    """Random adds, samples and priority updates of a `PrioritisedEpisodeTrajectoryBuffer`.
    After every add and every update a sample checks the priorities (through its
    `probabilities`, which depend on every valid window's priority)."""

    @initialize(config=st.sampled_from(PRIORITISED), seed=st.integers(0, 2**32 - 1))
    def setup(self, config: Config, seed: int):
        self.start(config, seed)

    def after_add(self) -> None:
        self._sample(beta=0.5, too_early=False)

    @rule(data=st.data())
    def set_priorities(self, data: st.DataObject):
        """Priorities for a recent sample (its windows may have been overwritten since),
        given as the sample or as indices and steps, some of them replaced by arbitrary
        windows: held or overwritten, valid or not."""
        c, h = self.c, self.history
        if not self.samples:
            return
        sample = data.draw(st.sampled_from(self.samples), label="sample")
        indices, steps = np.asarray(sample.indices), np.asarray(sample.steps)
        windows = [window_of(i, t, c.length) for i, t in zip(indices, steps, strict=True)]
        as_arrays = data.draw(st.booleans(), label="as indices and steps")
        current = self.priorities.priority  # the windows valid now
        if as_arrays:
            lo = max(0, h.total - 2 * c.length)
            others = [(r, t) for r in range(c.rows) for t in range(lo, h.total)]
            others = [w for w in others if w not in current]  # overwritten, or not valid
            if others:
                for j in range(data.draw(st.integers(0, BATCH), label="replaced")):
                    windows[j] = data.draw(st.sampled_from(others))
        # One priority per row: a repeated window may get several, and the last one applied
        # wins (the reference applies them in order). Updates the buffer must drop carry a
        # priority above any other, which shows (as the entry priority of new windows) if
        # one is applied.
        n = len(windows)
        values = data.draw(st.lists(st.sampled_from(PRIORITIES), min_size=n, max_size=n))
        priorities = np.array(
            [v if w in current else DROPPED for w, v in zip(windows, values, strict=True)],
            np.float32,
        )
        if as_arrays:
            new_indices = jnp.array([flat_index(w, c.length) for w in windows], jnp.int32)
            new_steps = jnp.array([w[1] for w in windows], jnp.uint32)
            self.buffer, seen = _set_at(
                self.buffer, new_indices, new_steps, jnp.asarray(priorities)
            )
        else:
            self.buffer, seen = _set(self.buffer, sample, jnp.asarray(priorities))
        self.priorities.set(windows, priorities)
        self._check_counters(seen)
        self._sample(beta=1.0, too_early=False)

    @rule()
    def set_every_priority_to_zero(self):
        """Priority 0 for every valid window (`set_priorities` with indices and steps, in
        batches of `BATCH`): `sample` must refuse until an add brings new windows, which enter
        at the largest priority set so far."""
        c = self.c
        windows = sorted(self.ref.valid())
        for k in range(0, len(windows), BATCH):
            chunk = windows[k : k + BATCH]
            chunk += [chunk[0]] * (BATCH - len(chunk))  # (the same window, the same value)
            indices = jnp.array([flat_index(w, c.length) for w in chunk], jnp.int32)
            steps = jnp.array([w[1] for w in chunk], jnp.uint32)
            self.buffer, seen = _set_at(self.buffer, indices, steps, jnp.zeros(BATCH))
            self.priorities.set(chunk, np.zeros(BATCH, np.float32))
            self._check_counters(seen)
        self._sample(beta=0.5, too_early=False)


EpisodeMachine.TestCase.settings = stateful_settings(max_examples=12, stateful_step_count=12)
TestEpisodeMachine = pytest.mark.stateful(EpisodeMachine.TestCase)
PrioritisedEpisodeMachine.TestCase.settings = stateful_settings(
    max_examples=12, stateful_step_count=12
)
TestPrioritisedEpisodeMachine = pytest.mark.stateful(PrioritisedEpisodeMachine.TestCase)
