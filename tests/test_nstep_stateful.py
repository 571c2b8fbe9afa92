"""Stateful test of `TransitionBuffer(n_step=..., discount=...)`: random adds of steps with
random rewards, terminations and truncations (with a `truncated` leaf, without one, and with
one the buffer is told to ignore), and samples, every n-step transition compared with the NumPy
reference (`equibuffer.testing`: `BufferReference` with an `NStepView`).

Only the public API is used, and every buffer is built by `_make`.
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
from .reference import BufferReference, NStepView, tags, UniformRule


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int
    length: int
    n: int
    discount: float
    truncated: str | None  # the leaf the buffer reads as truncations (None: none)
    truncated_leaf: bool  # whether the steps have a `truncated` leaf at all
    min_length_time_axis: int | None = None


def _example(c: Config) -> dict[str, Any]:
    example = {
        "obs": jnp.zeros(2, jnp.float32),
        "t": jnp.int32(0),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
    }
    if c.truncated_leaf:
        example["truncated"] = jnp.bool_(False)
    return example


def _make(c: Config) -> eb.TransitionBuffer:
    """The one place the n-step buffers are built."""
    return eb.TransitionBuffer(
        _example(c),
        add_batch_size=c.rows,
        max_length_time_axis=c.length,
        min_length_time_axis=c.min_length_time_axis,
        n_step=c.n,
        discount=c.discount,
        truncated=c.truncated,
    )


CONFIGS = [
    Config(2, 5, 2, 0.9, "truncated", True),
    Config(1, 4, 1, 0.5, "truncated", True),
    Config(2, 5, 3, 0.75, None, False),  # no truncated leaf
    Config(3, 6, 3, 1.0, "truncated", True, min_length_time_axis=5),
    Config(2, 3, 2, 0.0, None, True),  # n + 1 == max_length; discount 0; leaf ignored
    Config(1, 7, 4, 0.9, "truncated", True),
]
ADD_STEPS = (3, None, 1, 9)  # None: the one-step form, 1: `(rows, 1, ...)`; 9 > any ring
BATCH = 16
REWARDS = (0.5, -1.0, 0.0, 2.0, 0.25)
FLAG = st.sampled_from([False, False, False, True])
TOO_EARLY = "cannot be sampled yet"


@eb.filter_jit
def _add(buffer, batch):
    buffer = buffer.add(batch)
    return buffer, {
        "can_sample": buffer.can_sample(),
        "size": buffer.size(),
        "num_windows": buffer.num_windows(),
    }


@eb.filter_jit
def _sample(buffer, key):
    return buffer.sample(key, BATCH)


class NStepMachine(CountedMachine):
    """Random adds and samples of an n-step `TransitionBuffer`."""

    @initialize(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
    def setup(self, config: Config, seed: int):
        self.c = config
        self.buffer = _make(config)
        view = NStepView(config.n, config.discount, truncated=config.truncated)
        self.ref = BufferReference(
            config.rows,
            config.length,
            UniformRule(sequence_length=config.n + 1),
            view=view,
            min_steps_per_row=config.min_length_time_axis,
        )
        self.history, self.rule = self.ref.history, self.ref.rule
        self.key = jax.random.key(seed)

    def _ready(self) -> bool:
        return self.ref.ready()

    @rule(t=st.sampled_from(ADD_STEPS), data=st.data())
    def add(self, t: int | None, data: st.DataObject):
        c, h = self.c, self.history
        n = 1 if t is None else t

        def draw(strategy, label):
            values = data.draw(st.lists(strategy, min_size=c.rows * n, max_size=c.rows * n), label)
            return np.array(values).reshape(c.rows, n)

        x = tags(c.rows, h.total, n)
        steps = {
            "obs": np.stack([x, -x], axis=-1).astype(np.float32),
            "t": x,
            "reward": draw(st.sampled_from(REWARDS), "reward").astype(np.float32),
            "terminated": draw(FLAG, "terminated").astype(bool),
        }
        if c.truncated_leaf:
            steps["truncated"] = draw(FLAG, "truncated").astype(bool)
        batch = steps if t is not None else {k: v[:, 0] for k, v in steps.items()}
        self.buffer, seen = _add(self.buffer, jax.tree.map(jnp.asarray, batch))
        self.ref.add(steps)
        assert bool(seen["can_sample"]) == self._ready()
        assert int(seen["size"]) == h.fill * c.rows
        assert int(seen["num_windows"]) == len(self.rule.valid(h))

    @rule()
    def sample(self):
        h = self.history
        self.key, key = jax.random.split(self.key)
        if not self._ready():
            with pytest.raises(Exception, match=TOO_EARLY):
                _sample(self.buffer, key)
            return
        sample = _sample(self.buffer, key)
        out = sample.experience
        assert isinstance(out, eb.NStepTransition)
        assert set(out.first) == set(h.steps)
        assert set(self.ref.windows(sample)) <= self.rule.valid(h)
        # first, last, second, reward, discount and steps of each transition
        self.ref.check_sample(sample)


NStepMachine.TestCase.settings = stateful_settings(max_examples=50, stateful_step_count=12)
TestNStepMachine = pytest.mark.stateful(NStepMachine.TestCase)
