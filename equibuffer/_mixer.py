"""One batch drawn in fixed proportions from several buffers."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree, Shaped, UInt32

from ._axes import in_blocks, on_auto_axes
from ._buffers._epochs import no_epochs
from ._buffers._samples import AbstractSample
from ._checks import (
    as_sequence,
    check_key,
    check_positive_int,
    check_shares,
    keystr,
    refuse_flashbax_only,
)
from ._custom_types import Beta, BoolScalar, IntScalar
from ._errors import failure_in, first_failure, poisoned, recorded
from ._protocol import AbstractPrioritisedSource, AbstractSource
from .rules._by_priority import as_priorities


class MixedSample(eqx.Module):
    """What [`equibuffer.Mixer.sample`][] returns.

    - `experience`: the sources' experience concatenated along the batch axis, source 0's
        rows first (`counts[0]` of them), then source 1's, and so on.
    - `source`: `(batch,)` int32, the source each row came from.
    - `weights`: `(batch,)` float32 importance weights: a prioritised source's own
        `weights` on its rows, 1 on the rows of a uniform source.
    - `samples`: each source's own sample (`None` for a source given 0 rows), with its
        `indices` and `steps` (a `MixedSample` for a source that is itself a `Mixer`): what
        [`equibuffer.Mixer.set_priorities`][] routes back. Their `experience` is `None`:
        those rows are in `experience` (not held twice, so a `MixedSample` returned from a
        jitted step carries the batch once).
    - `row_blocks`: the `row_blocks` it was drawn with (static). With `n > 1` the rows
        above are in `n` blocks rather than source by source: block `d` holds block `d` of
        source 0's own sample (`counts[0] / n` rows), then block `d` of source 1's, and so
        on; each source's sample in `samples` is its own, blocks in order.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        a = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
        b = eb.PrioritisedItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
        a, b = a.add({"x": jnp.ones((1, 2))}), b.add({"x": jnp.zeros((1, 2))})
        sample = eb.Mixer((a, b), proportions=(0.5, 0.5)).sample(jax.random.key(0), 4)
        assert isinstance(sample, eb.MixedSample) and sample.source.tolist() == [0, 0, 1, 1]
        assert sample.experience["x"][:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]
        assert sample.samples[1].experience is None and sample.weights.tolist() == [1.0] * 4
        ```
    """

    experience: PyTree[Shaped[Array, "batch ..."]]
    source: Int[Array, " batch"]
    weights: Float[Array, " batch"]
    samples: tuple["AbstractSample | MixedSample | None", ...]
    row_blocks: int = eqx.field(static=True, default=1)

    @property
    def error(self) -> UInt32[Array, ""]:
        """The failure recorded while drawing it inside jit (0-d uint32, 0 for none): the
        first among its sources' samples."""
        return first_failure(*[s.error for s in self.samples if s is not None])

    def with_error(self, word: UInt32[Array, ""]) -> "MixedSample":
        """The sample with failure `word` recorded in every source's sample, and its
        floating leaves NaN when a failure is recorded (see [`equibuffer.Sample`][])."""
        samples = tuple(None if s is None else s.with_error(word) for s in self.samples)
        word = first_failure(self.error, word)
        mixed = poisoned((self.experience, self.weights), word)
        return eqx.tree_at(lambda m: (m.experience, m.weights, m.samples), self, (*mixed, samples))


def largest_remainder(proportions: Sequence[float], batch_size: int) -> tuple[int, ...]:
    """Counts summing to `batch_size`: each source gets `floor(p * batch_size)` rows and the
    rows left go one each to the largest fractional parts (ties: the lower source index)."""
    exact = [p * batch_size for p in proportions]
    counts = [math.floor(x) for x in exact]
    left = batch_size - sum(counts)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return tuple(counts)


def _join(parts: Sequence[Array], blocks: int) -> Array:
    """The sources' `(n_i, ...)` parts as one `(sum n_i, ...)` array: one after the other, or
    with `blocks > 1` block by block (block `d` of each part in turn), each block's rows
    staying where the parts' block `d` are (on a mesh, on device `d`)."""
    if blocks == 1:
        return jnp.concatenate(parts, axis=0)
    split = [x.reshape(blocks, x.shape[0] // blocks, *x.shape[1:]) for x in parts]
    joined = jnp.concatenate(split, axis=1)
    return joined.reshape(-1, *joined.shape[2:])


class Mixer(AbstractPrioritisedSource):
    """Samples one batch made of fixed proportions of several sources (online and offline
    data, uniform and prioritised), each source drawing its share as its own sample: its
    rows follow that source's own uniform or prioritised distribution.

    A source is any [`equibuffer.AbstractSource`][]: every buffer (ring, episode-aware,
    clustered, uniform or prioritised) and a `Mixer` itself. The prioritised ones (each an
    [`equibuffer.AbstractPrioritisedSource`][]) get `beta` and their rows' priorities back;
    a `Mixer` is one too, so mixers nest.

    The row counts are static: source `i` gets `floor(p_i * batch_size)` rows and the rows
    left over go one each to the largest fractional parts, ties to the lower index
    (largest-remainder rounding), so they always sum to `batch_size`; see `counts`.

    A `Mixer` is a module holding its buffers, so it can sit in a train state; reach a source
    with `mixer.buffers[i]` and replace it with `eqx.tree_at(lambda m: m.buffers[i], mixer,
    new)`. All sources must give experience of the same structure, shapes and dtypes.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(3)}
        online = eb.ItemBuffer(example, add_batch_size=2, capacity=64)
        offline = eb.PrioritisedItemBuffer(example, add_batch_size=2, capacity=64)
        online = online.add({"obs": jnp.ones((2, 4, 3))})
        offline = offline.add({"obs": jnp.zeros((2, 4, 3))})
        mixer = eb.Mixer((online, offline), proportions=(0.75, 0.25))
        assert mixer.counts(10) == (8, 2)
        sample = mixer.sample(jax.random.key(0), batch_size=10, beta=0.4)
        assert sample.experience["obs"].shape == (10, 3)
        assert sample.source.tolist() == [0] * 8 + [1] * 2
        mixer = mixer.set_priorities(sample, jnp.ones(10))
        ```
    """

    buffers: tuple[AbstractSource, ...]
    proportions: tuple[float, ...] = eqx.field(static=True)

    @refuse_flashbax_only
    def __init__(self, buffers: Sequence[AbstractSource], proportions: Sequence[float]):
        """**Arguments:**

        - `buffers`: the sources (any [`equibuffer.AbstractSource`][]: a buffer or a
            `Mixer`).
        - `proportions`: one share per buffer, each `>= 0`, summing to 1 (within 1e-6).
        """
        where = "Mixer()"
        buffers = as_sequence(where, "buffers", buffers, "buffers")
        if not buffers:
            raise ValueError(f"{where}: `buffers` is empty: give at least one buffer.")
        for i, b in enumerate(buffers):
            if not isinstance(b, AbstractSource):
                raise TypeError(
                    f"{where}: buffers[{i}] is {type(b).__name__}, not a buffer (an "
                    "equibuffer.AbstractSource)."
                )
        self.buffers = buffers
        self.proportions = check_shares(where, "proportions", proportions, len(buffers), "buffer")

    def counts(self, batch_size: int) -> tuple[int, ...]:
        """The number of rows each source gives to a batch of `batch_size` (static ints,
        largest-remainder rounding; they sum to `batch_size`).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffers = [eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)] * 3
            mixer = eb.Mixer(buffers, proportions=(0.5, 0.25, 0.25))
            assert mixer.counts(8) == (4, 2, 2)
            assert mixer.counts(5) == (3, 1, 1)  # 2.5, 1.25, 1.25: the spare row to the largest .5
            ```
        """
        batch_size = check_positive_int("Mixer.counts()", "batch_size", batch_size)
        return largest_remainder(self.proportions, batch_size)

    def epoch(self, key: PRNGKeyArray, batch_size: int) -> NoReturn:
        """Refused (`TypeError`): a `Mixer` draws from its sources in fixed proportions,
        which an epoch, every window once, cannot keep. Plan an epoch of each source.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            items = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            mixer = eb.Mixer((items.add({"x": jnp.ones((1, 2))}), items), proportions=(1.0, 0.0))
            epoch = mixer.buffers[0].epoch(jax.random.key(0), batch_size=4)  # not mixer.epoch
            assert int(epoch.count) == 1
            ```
        """
        no_epochs(
            f"{type(self).__name__}.epoch()",
            (
                "a Mixer draws from its sources in fixed proportions, which an epoch (every window "
                "once) cannot keep: plan an epoch of each source instead, "
                "`mixer.buffers[k].epoch(key, batch_size)`."
            ),
        )

    def can_sample(self) -> BoolScalar:
        """Whether every source of positive proportion can be sampled (0-d bool, a function of
        the sources' counters only).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            a = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            b = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            a = a.add({"x": jnp.ones((1, 2))})
            assert not eb.Mixer((a, b), proportions=(0.5, 0.5)).can_sample()  # b is empty
            assert eb.Mixer((a, b), proportions=(1.0, 0.0)).can_sample()  # b gives no rows
            ```
        """
        ready = [
            b.can_sample() for b, p in zip(self.buffers, self.proportions, strict=True) if p > 0
        ]
        return jnp.all(jnp.stack(ready))

    def size(self) -> IntScalar:
        """The number of steps (or items) the sources hold together (0-d int32).

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            a = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            b = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=8)
            a, b = a.add({"x": jnp.ones((1, 3, 2))}), b.add({"x": jnp.ones((2, 2))})
            assert int(eb.Mixer((a, b), proportions=(0.5, 0.5)).size()) == 3 + 2
            ```
        """
        return jnp.sum(jnp.stack([b.size() for b in self.buffers]), dtype=jnp.int32)

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(
        self, key: PRNGKeyArray, batch_size: int, beta: Beta = 1.0, *, row_blocks: int = 1
    ) -> MixedSample:
        """Draw `counts(batch_size)[i]` rows from source `i`, each source with its own
        `sample` (independent keys), and concatenate them in source order.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the total number of rows (static).
        - `beta`: the importance-sampling exponent passed to prioritised sources.
        - `row_blocks`: `n >= 1` dividing every source's share `counts(batch_size)[i]`
            (static; a share of 0 is skipped, and `n` then divides `batch_size` too). Each
            source draws its share with its own `sample(..., row_blocks=n)`, and block `d`
            of the mix is block `d` of every source's sample, in source order: `counts[i] /
            n` rows drawn from what `shard_rows` puts on device `d` of source `i`, by that
            source's rule. So each block is the mix device `d` would draw on its own, in the
            same proportions (see [Scaling](../scaling.md)). Default 1: the whole sources.

        **Returns:**

        A [`equibuffer.MixedSample`][]. Each source raises inside jit as its own `sample`
        does when it cannot be sampled.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            a = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            b = eb.PrioritisedItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            a, b = a.add({"x": jnp.ones((1, 2))}), b.add({"x": jnp.zeros((1, 2))})
            mixer = eb.Mixer((a, b), proportions=(0.75, 0.25))
            sample = mixer.sample(jax.random.key(0), batch_size=8, beta=0.4)
            assert sample.experience["x"].shape == (8, 2)
            assert sample.source.tolist() == [0] * 6 + [1] * 2
            assert sample.experience["x"][:, 0].tolist() == [1.0] * 6 + [0.0] * 2
            ```
        """
        check_key("Mixer.sample()", key)
        counts = self.counts(batch_size)
        blocks = self._row_blocks(row_blocks, batch_size, counts)
        # (a source is asked for `row_blocks` only when it is used: 1 is every source's default)
        by_blocks = {} if blocks == 1 else {"row_blocks": blocks}
        keys = jax.random.split(key, len(self.buffers))
        samples: list[Any] = []
        weights: list[Array] = []
        for i, (buffer, n) in enumerate(zip(self.buffers, counts, strict=True)):
            if n == 0:
                samples.append(None)
            elif isinstance(buffer, AbstractPrioritisedSource):
                samples.append(buffer.sample(keys[i], n, beta=beta, **by_blocks))
                weights.append(samples[-1].weights.astype(jnp.float32))
            else:
                samples.append(buffer.sample(keys[i], n, **by_blocks))
                weights.append(jnp.ones(n, jnp.float32))
        drawn = [(i, s) for i, s in enumerate(samples) if s is not None]
        self._check_alike([(i, s.experience) for i, s in drawn])
        experience = jax.tree.map(lambda *xs: _join(xs, blocks), *[s.experience for _, s in drawn])
        source = _join([jnp.full(counts[i], i, jnp.int32) for i, _ in drawn], blocks)
        samples = [None if s is None else dataclasses.replace(s, experience=None) for s in samples]
        return MixedSample(
            experience=experience,
            source=source,
            weights=_join(weights, blocks),
            samples=tuple(samples),
            row_blocks=blocks,
        )

    @on_auto_axes()
    @recorded
    def set_priorities(
        self, sample: MixedSample, priorities: Float[ArrayLike, " batch"]
    ) -> "Mixer":
        """Route `priorities` (one per row of `sample`) back to the prioritised sources, each
        getting the slice of its own rows; rows of uniform sources are ignored.

        **Returns:**

        The mixer with its prioritised sources updated (see their `set_priorities`).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            a = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            b = eb.PrioritisedItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
            a, b = a.add({"x": jnp.ones((1, 2))}), b.add({"x": jnp.zeros((1, 2))})
            mixer = eb.Mixer((a, b), proportions=(0.5, 0.5))
            sample = mixer.sample(jax.random.key(0), batch_size=4)
            mixer = mixer.set_priorities(sample, jnp.array([9.0, 9.0, 2.0, 2.0]))
            assert float(mixer.buffers[1].max_priority) == 2.0  # rows 2-3 went to source 1
            ```
        """
        new = as_priorities("Mixer.set_priorities()", priorities)
        batch = sample.source.shape[0]
        if new.shape != (batch,):
            raise ValueError(
                f"Mixer.set_priorities(): `priorities` has shape {new.shape}, expected "
                f"({batch},), one per row of the sample."
            )
        # One bad priority (or a failed sample) refuses the whole update, in every source: each
        # then gets NaN priorities, which it refuses with the message of a bad priority.
        bad = jnp.any((new < 0) | ~jnp.isfinite(new)) | (sample.error != 0)
        new = jnp.where(bad, jnp.nan, new.astype(jnp.float32))
        # So does a source's own refusal (its indices out of range, as from another buffer's
        # sample): the routing is traced once to learn whether any source refuses (only the
        # checks of that pass are used, so jit keeps nothing else of it), then again with
        # NaN priorities everywhere if one does. Its failure is the first recorded.
        refused = failure_in(lambda: self._routed(sample, new))
        new = jnp.where(refused != 0, jnp.nan, new)
        return eqx.tree_at(lambda m: m.buffers, self, self._routed(sample, new))

    def _routed(self, sample: MixedSample, priorities: Float[Array, " batch"]) -> tuple:
        """Each prioritised source with `set_priorities` of its own rows of `sample`."""
        buffers = list(self.buffers)
        # Source i's rows: one run per block of the mix (one block unless `row_blocks > 1`).
        batch, blocks = priorities.shape[0], sample.row_blocks
        by_block = priorities.reshape(blocks, batch // blocks)
        start = 0
        for i, (buffer, n) in enumerate(zip(self.buffers, self.counts(batch), strict=True)):
            part = sample.samples[i]
            if part is not None and isinstance(buffer, AbstractPrioritisedSource):
                own = by_block[:, start : start + n // blocks].reshape(-1)
                buffers[i] = buffer.set_priorities(part, own)
            start += n // blocks
        return tuple(buffers)

    @staticmethod
    def _row_blocks(row_blocks: int, batch_size: int, counts: tuple[int, ...]) -> int:
        """`row_blocks` checked: a positive int dividing every source's share."""
        where = "Mixer.sample()"
        row_blocks = check_positive_int(where, "row_blocks", row_blocks)
        if any(n % row_blocks for n in counts):
            raise ValueError(
                f"{where}: row_blocks={row_blocks} must divide every source's share of the "
                f"batch, counts(batch_size={batch_size}) = {counts} (block d of the mix is "
                "block d of each source's own sample, counts[i] / row_blocks rows of source i)."
            )
        return row_blocks

    @staticmethod
    def _check_alike(experiences: list[tuple[int, Any]]) -> None:
        (i0, e0), *rest = experiences
        leaves0, def0 = jax.tree_util.tree_flatten_with_path(e0)
        for i, e in rest:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(e)
            if treedef != def0:
                raise ValueError(
                    f"Mixer.sample(): buffers[{i}] gives experience of structure {treedef}, "
                    f"but buffers[{i0}] gives {def0}; every source must hold the same kind "
                    "of experience."
                )
            for (path, a), (_, b) in zip(leaves0, leaves, strict=True):
                if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                    raise ValueError(
                        f"Mixer.sample(): leaf {keystr(path)} is {b.dtype}{list(b.shape[1:])} "
                        f"per row in buffers[{i}] but {a.dtype}{list(a.shape[1:])} in "
                        f"buffers[{i0}]; every source must hold the same shapes and dtypes."
                    )
