"""One answer on every platform: where one `set_priorities` names a window several times, the
last priority given for it wins, as in NumPy, for every prioritised kind. XLA's scatter leaves
the order of repeated indices to the platform (an H200 kept the first, the CPU keeps the
last), so the result on this CPU proves little alone: `set_priorities` is checked to write
through `SumTree.write`'s deduplication too, which tests/test_sumtree.py checks leaves the
scatter no choice."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
from equibuffer._sumtree import SumTrees

from .helpers import spread
from .mesh_kinds import add, batch, prioritised_kinds


ROWS, LENGTH, BATCH = 2, 16, 8
KINDS = prioritised_kinds(ROWS, LENGTH)


def _filled(kind: str):
    buffer = KINDS[kind]()
    for i in range(3):
        b = batch(i, ROWS, 4)
        buffer = buffer.add(b) if isinstance(buffer, eb.RateLimited) else add(buffer, b)
    return buffer


def _sample(buffer, seed: int = 0):
    sample = buffer.sample(jax.random.key(seed), BATCH, beta=0.5)
    return sample[1] if isinstance(buffer, eb.RateLimited) else sample


def _update(buffer, sample, indices, steps, priorities):
    """`set_priorities` for the windows `(indices, steps)`, given as a sample (every kind
    takes one) that names them."""
    named = eqx.tree_at(
        lambda s: (s.indices, s.steps), sample, (jnp.asarray(indices), jnp.asarray(steps))
    )
    return buffer.set_priorities(named, jnp.asarray(priorities))


def _trees(buffer) -> list[np.ndarray]:
    if isinstance(buffer, eb.RateLimited):
        return _trees(buffer.buffer)
    if isinstance(buffer, eb.Mixer):
        return [t for b in buffer.buffers for t in _trees(b)]
    if isinstance(buffer, eb.PrioritisedClusteredBuffer):
        return [np.asarray(t.values()) for t in buffer.trees]
    return [np.asarray(buffer.tree.values())]


# (A mix routes each source's rows to that source's own `set_priorities`: the kinds below.)
@pytest.mark.parametrize("kind", spread(sorted(set(KINDS) - {"mixer"})))
def test_repeated_windows_in_one_update_the_last_priority_wins(kind):
    """Each sampled window three times with different priorities, then a stale update of a
    window (its start step overwritten: dropped) after the others: the tree holds, for every
    window, the last priority given for it that was not dropped."""
    buffer = _filled(kind)
    sample = _sample(buffer)
    indices, steps = np.asarray(sample.indices), np.asarray(sample.steps)
    order = np.concatenate([np.arange(BATCH), np.arange(BATCH)[::-1], np.arange(BATCH)])
    repeated, repeated_steps = indices[order], steps[order]
    stale = steps[:2] + np.uint32(1000)  # never the step a slot holds here
    repeated = np.concatenate([repeated, indices[:2]]).astype(np.int32)
    repeated_steps = np.concatenate([repeated_steps, stale])
    priorities = np.arange(1.0, repeated.size + 1, dtype=np.float32)
    priorities[-2:] = 1e6  # dropped, so never applied
    got = _update(buffer, sample, repeated, repeated_steps, priorities)
    last = {int(i): j for j, i in enumerate(repeated[:-2])}  # the last entry of each window
    chosen = np.array(sorted(last.values()))
    want = _update(buffer, sample, repeated[chosen], repeated_steps[chosen], priorities[chosen])
    for a, b in zip(_trees(got), _trees(want), strict=True):
        np.testing.assert_array_equal(a, b)
    inner = got.buffer if isinstance(got, eb.RateLimited) else got
    assert float(inner.max_priority) == priorities[:-2].max()  # (every current one counts)
    assert not np.array_equal(_trees(got)[0], _trees(buffer)[0])


def _written(buffer) -> int:
    """How many tree writes one `set_priorities` traces: one per `SumTree`, one for all the
    clusters' trees of a clustered buffer (a `SumTrees`); a Mixer traces its sources' twice
    (once to learn whether a source refuses the update: then every source refuses it)."""
    if isinstance(buffer, eb.RateLimited):
        return _written(buffer.buffer)
    if isinstance(buffer, eb.Mixer):
        return 2 * sum(_written(b) for b in buffer.buffers)
    return 1


@pytest.mark.parametrize("kind", spread(sorted(KINDS)))
def test_set_priorities_writes_through_the_deduplication(kind, monkeypatch):
    """The mechanism: `set_priorities` writes each tree's leaves with `SumTree.write`'s
    deduplication, or that of `SumTrees.write` (the same code) for a clustered buffer's
    trees, never the promise of unique indices the adds make; tests/test_sumtree.py checks
    that it leaves the value scatter no repeated index."""
    buffer = _filled(kind)
    sample = _sample(buffer)
    promised = []

    def spy(write):
        def spied(self, *args, **kwargs):
            promised.append(kwargs.get("unique_indices", False))
            return write(self, *args, **kwargs)

        return spied

    for cls in (eb.SumTree, SumTrees):
        monkeypatch.setattr(cls, "write", spy(cls.write))
    jax.make_jaxpr(lambda b, s: b.set_priorities(s, s.weights + 1.0))(buffer, sample)
    assert promised == [False] * _written(buffer)
