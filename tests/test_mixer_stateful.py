"""Stateful test of `Mixer`: random adds to its sources (uniform, prioritised and
episode-aware buffers), mixed samples and priority updates routed back, against one
`BufferReference` (`tests/reference.py`) per source: each row's source and data, each
prioritised source's probabilities and weights, `can_sample()`, and the errors of a source
that cannot be sampled.

Only the public API is used; the sources are built by `_make_source` and the mixer by `_make`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, rule

import equibuffer as eb

from .helpers import CountedMachine, stateful_settings
from .reference import BufferReference, EpisodeRule, tags, UniformRule, Window, window_of


EXAMPLE = {"x": jnp.int32(0), "done": jnp.bool_(False)}


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "item", "trajectory" or "episode"
    rows: int
    length: int
    sequence_length: int = 1
    period: int = 1
    mode: str = "never_cross"
    alpha: float | None = None  # prioritised when given


def _make_source(s: Source) -> Any:
    """The one place the sources are built."""
    kw: dict[str, Any] = {"add_batch_size": s.rows, "max_length_time_axis": s.length}
    if s.alpha is not None:
        kw["alpha"] = s.alpha
    if s.kind == "item":
        cls = eb.ItemBuffer if s.alpha is None else eb.PrioritisedItemBuffer
        return cls(EXAMPLE, **kw)
    kw.update(sequence_length=s.sequence_length, period=s.period)
    if s.kind == "trajectory":
        cls = eb.TrajectoryBuffer if s.alpha is None else eb.PrioritisedTrajectoryBuffer
        return cls(EXAMPLE, **kw)
    cls = eb.EpisodeTrajectoryBuffer if s.alpha is None else eb.PrioritisedEpisodeTrajectoryBuffer
    return cls(EXAMPLE, mode=s.mode, **kw)


def _make(sources: tuple[Source, ...], proportions: tuple[float, ...]) -> eb.Mixer:
    """The one place the mixers are built."""
    return eb.Mixer([_make_source(s) for s in sources], proportions=proportions)


def _reference(s: Source) -> BufferReference:
    if s.kind == "episode":
        rule: Any = EpisodeRule(s.sequence_length, s.period, s.mode, "done")
    else:
        rule = UniformRule(s.sequence_length, s.period)
    return BufferReference(s.rows, s.length, rule, alpha=s.alpha)


CONFIGS = [
    ((Source("item", 1, 4), Source("item", 2, 3, alpha=0.5)), (0.5, 0.5)),
    (
        (
            Source("trajectory", 2, 5, 2),
            Source("trajectory", 1, 4, 2, period=2, alpha=1.0),
            Source("episode", 1, 5, 2, mode="pad"),
        ),
        (0.25, 0.5, 0.25),
    ),
    ((Source("item", 1, 5, alpha=1.0), Source("item", 2, 2)), (1.0, 0.0)),
    (
        (Source("episode", 2, 4, 3, alpha=0.5), Source("trajectory", 1, 3, 3, period=2)),
        (0.625, 0.375),
    ),
]
ADD_STEPS = (2, None, 5)
BATCH = 8
END = st.sampled_from([False, False, False, True])
PRIORITIES = (0.0, 0.5, 1.0, 3.0)
DROPPED = 8.0  # the priority of updates to windows not valid now (must be dropped)
REFUSALS = {
    "too early": "cannot be sampled yet",
    "no window": "no window of sequence_length=[0-9]+ fits inside an episode",
    "all zero": "every valid window has priority 0",
}


@eb.filter_jit
def _add(mixer, i, batch):
    mixer = eqx.tree_at(lambda m: m.buffers[i], mixer, mixer.buffers[i].add(batch))
    return mixer, {
        "can_sample": mixer.can_sample(),
        "sources": [b.can_sample() for b in mixer.buffers],
        "size": mixer.buffers[i].size(),
    }


@eb.filter_jit
def _sample(mixer, key, beta):
    return mixer.sample(key, BATCH, beta=beta)


@eb.filter_jit
def _set(mixer, sample, priorities):
    return mixer.set_priorities(sample, priorities)


class MixerMachine(CountedMachine):
    """Random adds to the sources, mixed samples and priority updates of a `Mixer`."""

    @initialize(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
    def setup(self, config, seed: int):
        self.sources, self.proportions = config
        self.mixer = _make(self.sources, self.proportions)
        self.refs = [_reference(s) for s in self.sources]
        self.key = jax.random.key(seed)
        self.samples: list[Any] = []

    def _shared(self) -> list[int]:
        """The sources that give rows to a sample."""
        return [i for i, p in enumerate(self.proportions) if p > 0]

    @rule(data=st.data(), t=st.sampled_from(ADD_STEPS))
    def add(self, data: st.DataObject, t: int | None):
        """`t` steps to every source, or to one of them."""
        which = data.draw(st.sampled_from(["all", *range(len(self.sources))]), label="source")
        for i in range(len(self.sources)) if which == "all" else [which]:
            self._add(i, t, data)
        self._sample(beta=0.5, too_early=False)

    def _add(self, i: int, t: int | None, data: st.DataObject) -> None:
        ref, rows, n = self.refs[i], self.sources[i].rows, 1 if t is None else t
        done = data.draw(st.lists(END, min_size=rows * n, max_size=rows * n), label="done")
        steps = {
            "x": tags(rows, ref.history.total, n) + np.int32(1_000_000 * i),
            "done": np.array(done, bool).reshape(rows, n),
        }
        batch = steps if t is not None else {k: v[:, 0] for k, v in steps.items()}
        self.mixer, seen = _add(self.mixer, i, jax.tree.map(jnp.asarray, batch))
        ref.add(steps)
        assert [bool(b) for b in seen["sources"]] == [r.ready() for r in self.refs]
        assert bool(seen["can_sample"]) == all(self.refs[j].ready() for j in self._shared())
        assert int(seen["size"]) == ref.history.fill * rows

    @rule(beta=st.sampled_from([0.0, 0.5, 1.0]))
    def sample(self, beta: float):
        self._sample(beta)

    def _sample(self, beta: float, too_early: bool = True) -> None:
        """Sample and check the result against the references, or check the error they
        expect (`too_early=False`: not when a source's `can_sample()` is false)."""
        refusals = {self.refs[i].refusal() for i in self._shared()} - {None}
        if "too early" in refusals and not too_early:
            return
        self.key, key = jax.random.split(self.key)
        if refusals:
            with pytest.raises(Exception, match="|".join(REFUSALS[r] for r in refusals)):
                _sample(self.mixer, key, jnp.float32(beta))
            return
        sample = _sample(self.mixer, key, jnp.float32(beta))
        self._check(sample, beta)
        self.samples = [*self.samples[-2:], sample]

    def _check(self, sample: Any, beta: float) -> None:
        counts = self.mixer.counts(BATCH)
        assert sum(counts) == BATCH
        x = np.asarray(sample.experience["x"])
        done = np.asarray(sample.experience["done"])
        np.testing.assert_array_equal(
            np.asarray(sample.source), np.repeat(range(len(counts)), counts)
        )
        weights = np.asarray(sample.weights)
        start = 0
        for i, (source, ref, part, n) in enumerate(
            zip(self.sources, self.refs, sample.samples, counts, strict=True)
        ):
            if n == 0:
                assert part is None
                continue
            rows = slice(start, start + n)
            start += n
            windows = self._windows(i, part)
            valid = ref.valid()
            for j, window in zip(range(rows.start, rows.stop), windows, strict=True):
                assert window in valid, f"source {i} sampled {window}, valid: {sorted(valid)}"
                mask = ref.rule.mask(ref.history, window)
                s = source.sequence_length
                steps = ref.history.window(*window, s)
                want_x, want_done = np.where(mask, steps["x"], 0), steps["done"] & mask
                if source.kind == "item":
                    want_x, want_done = want_x[0], want_done[0]
                np.testing.assert_array_equal(x[j], want_x)
                np.testing.assert_array_equal(done[j], want_done)
                if source.kind == "episode":
                    np.testing.assert_array_equal(np.asarray(part.mask)[j - rows.start], mask)
            if ref.priorities is None:
                np.testing.assert_array_equal(weights[rows], 1.0)
                continue
            p = np.array([ref.priorities.probability(w) for w in windows])
            assert (p > 0).all(), "a window of priority 0 was drawn"
            np.testing.assert_allclose(np.asarray(part.probabilities), p, rtol=1e-5)
            np.testing.assert_allclose(weights[rows], (p / p.min()) ** -beta, rtol=1e-4)

    def _windows(self, i: int, part: Any) -> list[Window]:
        length = self.sources[i].length
        pairs = zip(np.asarray(part.indices), np.asarray(part.steps), strict=True)
        return [window_of(index, step, length) for index, step in pairs]

    @rule(data=st.data())
    def set_priorities(self, data: st.DataObject):
        """Priorities for a recent mixed sample (some of its windows may be overwritten since),
        routed by the mixer to its prioritised sources."""
        if not self.samples:
            return
        sample = data.draw(st.sampled_from(self.samples), label="sample")
        counts = self.mixer.counts(BATCH)
        priorities = np.full(BATCH, 5.0, np.float32)  # rows of uniform sources: ignored
        start = 0
        for i, (ref, part, n) in enumerate(zip(self.refs, sample.samples, counts, strict=True)):
            if part is None or ref.priorities is None:
                start += n
                continue
            windows = self._windows(i, part)
            values = data.draw(  # one per row: the last one given for a window wins
                st.lists(st.sampled_from(PRIORITIES), min_size=len(windows), max_size=len(windows))
            )
            held = ref.priorities.priority
            mine = np.array(
                [v if w in held else DROPPED for w, v in zip(windows, values, strict=True)],
                np.float32,
            )
            priorities[start : start + n] = mine
            ref.priorities.set(windows, mine)
            start += n
        self.mixer = _set(self.mixer, sample, jnp.asarray(priorities))
        self._sample(beta=1.0, too_early=False)


MixerMachine.TestCase.settings = stateful_settings(max_examples=40, stateful_step_count=12)
TestMixerMachine = pytest.mark.stateful(MixerMachine.TestCase)
