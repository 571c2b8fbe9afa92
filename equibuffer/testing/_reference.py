"""A NumPy reference model of the buffers: what a buffer holds, which windows it may sample,
with what probability, and what a sample of each window contains.

Written from the documented behaviour, never from the implementation, in pieces that combine
the way a buffer does (storage + a sampling rule + a view of what a sample returns); the
pieces live in `_models.py`, this file puts them together:

- `History`: every step ever added to a ring of `rows` rows that holds the newest `length`
    steps of each row, by absolute step.
- Rules, which say which windows `(row, absolute start)` may be sampled now: `UniformRule`
    (held, complete, starting at a multiple of `period`) and `EpisodeRule` (`never_cross` /
    `pad`, with the pad mask).
- Views, what a sample returns for a window: `WindowView`, `PairView`, `ItemView`, `NStepView`
    (with `n_step`, an n-step transition's reward, bootstrap discount and number of steps).
- `Priorities`: the priority of each valid window under the prioritised buffers' rules.
- `BufferReference` puts them together for one buffer (`BufferReference.from_buffer`), and
    `QueueReference` models a `Queue`.

`flat_index` / `window_of` are the one place that knows how `Sample.indices` and
`Sample.steps` name a window.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float, Integer, PyTree, Shaped

from .._buffers._base import AbstractBuffer
from .._buffers._queue import Queue
from .._buffers._samples import (
    AbstractPrioritisedSample,
    AbstractSample,
    EpisodeSample,
    PrioritisedEpisodeSample,
)
from ..rules import Prioritised, PrioritisedEpisodic
from ..views._nstep import NStepTransition
from ..views._pair import Transition
from ._models import (
    _aligned_starts,
    _named,
    EpisodeRule,
    flat_index,
    History,
    ItemView,
    NStepView,
    PairView,
    Priorities,
    rule_model,
    UniformRule,
    view_model,
    window_of,
    WindowView,
)


def _one_step(example: Any, batch: Any) -> bool:
    """Whether `batch` is the one-step form `(rows, *leaf)` of a tree like `example`."""
    leaf, want = jax.tree.leaves(batch)[0], jax.tree.leaves(example)[0]
    return np.ndim(leaf) == len(want.shape) + 1


def _as_steps(example: Any, batch: Any) -> Any:
    """`batch` as leaves `(rows, T, *leaf)`."""
    batch = jax.tree.map(np.asarray, batch)
    if example is not None and _one_step(example, batch):
        return jax.tree.map(lambda x: x[:, None], batch)
    return batch


def _tolerance(dtype: Any, n: int) -> float:
    dtype = np.dtype(dtype)
    eps = float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 1e-7
    return max(1e-6, 8 * n * eps)


def _assert_tree_equal(got: Any, want: Any, what: str) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def, f"{what}: structure {got_def}, expected {want_def}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype}, expected {w.dtype}"
        np.testing.assert_array_equal(g, w, err_msg=where)


class BufferReference:
    """A NumPy model of one ring buffer: a [`equibuffer.testing.History`][], the rule of its
    valid windows, the view of what its samples return, `min_steps_per_row` (before
    `can_sample()`), and [`equibuffer.testing.Priorities`][] when `alpha` is given.

    Feed it the batches you add to the buffer; then it says what the buffer must report
    (`ready()`, `size()`, `num_windows()`, `num_valid_windows()`), why `sample` must refuse
    (`refusal()`), and whether a sample is right (`check_sample`): every window valid, its data
    where the buffer put it, mask, probabilities and weights as documented.

    **Arguments:**

    - `rows`, `length`: the rows and steps per row of the ring.
    - `rule`: a [`equibuffer.testing.UniformRule`][] or [`equibuffer.testing.EpisodeRule`][].
    - `view`: what a sample returns per window (default `WindowView(rule.sequence_length)`).
    - `min_steps_per_row`: steps per row before `can_sample()` (default
        `rule.sequence_length`, the buffers' default).
    - `alpha`: the priority exponent of a prioritised buffer (default `None`: uniform).
    - `example`: one step (a tree of arrays or `jax.ShapeDtypeStruct`s), so that `add`
        also takes the one-step form `(rows, *leaf)`; without it `add` takes `(rows, T, *leaf)`.

    Most users build it with [`equibuffer.testing.BufferReference.from_buffer`][].

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import equibuffer as eb
        from equibuffer.testing import BufferReference

        buffer = eb.TrajectoryBuffer({"x": jnp.int32(0)}, add_batch_size=2, capacity=8,
                                     sequence_length=3)
        reference = BufferReference.from_buffer(buffer)
        batch = {"x": jnp.arange(10, dtype=jnp.int32).reshape(2, 5)}
        buffer, _ = buffer.add(batch), reference.add(batch)
        assert reference.ready() and reference.num_windows() == int(buffer.num_windows()) == 4
        reference.check_sample(buffer.sample(jax.random.key(0), batch_size=16))
        ```
    """

    def __init__(
        self,
        rows: int,
        length: int,
        rule: UniformRule | EpisodeRule,
        *,
        view: WindowView | PairView | ItemView | NStepView | None = None,
        min_steps_per_row: int | None = None,
        alpha: float | None = None,
        example: PyTree[Any] | None = None,
    ):
        self.history = History(rows, length)
        self.rule = rule
        self.view = WindowView(rule.sequence_length) if view is None else view
        if self.view.length != rule.sequence_length:
            raise ValueError(
                f"BufferReference(): the view spans {self.view.length} steps but the rule's "
                f"windows are sequence_length={rule.sequence_length}."
            )
        self.min_steps_per_row = (
            rule.sequence_length if min_steps_per_row is None else min_steps_per_row
        )
        self.priorities = None if alpha is None else Priorities(alpha)
        self.example = example

    def __repr__(self) -> str:
        h, alpha = self.history, None if self.priorities is None else self.priorities.alpha
        return (
            f"BufferReference(rows={h.rows}, length={h.length}, rule={self.rule!r}, "
            f"view={self.view!r}, min_steps_per_row={self.min_steps_per_row}, alpha={alpha}; "
            f"{h.total} steps added)"
        )

    @classmethod
    def from_buffer(cls, buffer: AbstractBuffer | Queue) -> "BufferReference":
        """The reference of an empty `buffer` (any ring buffer: uniform, prioritised,
        episode-aware, transitions, n-step, items): the same rows, steps per row, window,
        period, minimum, rule, view and `alpha`. (A `Queue` is refused: its model is
        [`equibuffer.testing.QueueReference`][].)

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb
            from equibuffer.testing import BufferReference, EpisodeRule

            example = {"obs": jnp.zeros(3), "done": jnp.bool_(False)}
            buffer = eb.PrioritisedEpisodeTrajectoryBuffer(example, add_batch_size=2,
                                                           capacity=16, sequence_length=4)
            reference = BufferReference.from_buffer(buffer)
            assert isinstance(reference.rule, EpisodeRule) and reference.rule.mode == "never_cross"
            assert reference.history.length == 8 and reference.priorities is not None
            ```
        """
        where = "BufferReference.from_buffer()"
        if not isinstance(buffer, AbstractBuffer):
            raise TypeError(
                f"{where}: expected a ring buffer (an equibuffer.AbstractBuffer), got "
                f"{type(buffer).__name__}"
                + (
                    ": use QueueReference.from_buffer for a Queue."
                    if isinstance(buffer, Queue)
                    else "."
                )
            )
        if buffer.storage.steps_added() != 0:
            raise ValueError(
                f"{where}: the buffer already holds steps; build the reference from the empty "
                "buffer, then add the same batches to both."
            )
        rows = buffer.add_batch_size
        length = buffer.capacity // rows
        # The library's own parts have their models here, by type; a part of a user's own
        # declares its model itself (`reference` of the rule and of the view).
        rule = buffer.rule
        try:
            model = rule_model(rule, buffer.window)
            view = view_model(buffer.view)
        except NotImplementedError as e:
            raise NotImplementedError(f"{where}: {e}") from None
        # The proportional priorities' model (a rule drawing by rank has none).
        alpha = rule.alpha if isinstance(rule, Prioritised | PrioritisedEpisodic) else None
        # Steps per row before `can_sample()` (a Queue has no minimum: its sequence).
        minimum = getattr(buffer, "min_length_time_axis", None)
        return cls(
            rows,
            length,
            model,
            view=view,
            min_steps_per_row=minimum,
            alpha=alpha,
            example=buffer.storage.example(),
        )

    def add(self, batch: PyTree[Shaped[ArrayLike, "rows ..."]]) -> None:
        """Add what `buffer.add(batch)` adds: leaves `(rows, T, *leaf)`, or `(rows, *leaf)`
        for one step when the reference knows the `example`."""
        self.history.add(_as_steps(self.example, batch))
        if self.priorities is not None:
            self.priorities.refresh(self.valid())

    def restore(self, priority: float | None = None) -> None:
        """Mirror `buffer.with_storage(storage, priority=priority)` given the ring of a buffer
        that received the batches added here, as `Archive.restore` fills a buffer from the
        archive of them: the steps stay; for a prioritised buffer every valid window enters
        at `priority`, which becomes the largest priority (default: the largest so far).

        !!! example

            ```python
            import jax, jax.numpy as jnp
            import equibuffer as eb
            from equibuffer.testing import BufferReference

            example = {"x": jnp.float32(0)}
            buffer = eb.PrioritisedItemBuffer(example, add_batch_size=1, capacity=4)
            reference = BufferReference.from_buffer(buffer)
            batch = {"x": jnp.arange(3.0)[None]}
            reference.add(batch)
            ring = eb.RingStorage(example, rows=1, length=4).write(batch)
            buffer = buffer.with_storage(ring, priority=2.0)
            reference.restore(priority=2.0)
            assert reference.priorities.max_priority == 2.0 == float(buffer.max_priority)
            reference.check_sample(buffer.sample(jax.random.key(0), batch_size=4))
            ```
        """
        if self.priorities is None:
            if priority is not None:
                raise TypeError("BufferReference.restore(): the reference has no `alpha`.")
            return
        if priority is not None:
            self.priorities.max_priority = np.float32(priority)
        top = self.priorities.max_priority
        self.priorities.priority = {w: top for w in self.valid()}

    def valid(self) -> set[tuple[int, int]]:
        """The windows `(row, absolute start)` a sample may draw now."""
        return self.rule.valid(self.history)

    def ready(self) -> bool:
        """`can_sample()`: at least `min_steps_per_row` steps per row and a window valid by the
        counters (whatever the episode ends)."""
        h = self.history
        return h.fill >= self.min_steps_per_row and self.num_windows() > 0

    def size(self) -> int:
        """`size()`: the steps held over all rows."""
        return self.history.fill * self.history.rows

    def num_windows(self) -> int:
        """`num_windows()`: the windows valid by the counters alone."""
        rule = self.rule
        return len(_aligned_starts(self.history, rule.sequence_length, rule.period)) * (
            self.history.rows
        )

    def num_valid_windows(self) -> int:
        """`num_valid_windows()`: the windows a sample may draw now."""
        return len(self.valid())

    def refusal(self) -> str | None:
        """Why `sample` must raise now, or `None`: `"too early"` (`can_sample()` is false),
        `"no window"` (ready counters, but no window valid by an episode rule), `"all zero"`
        (every valid window has priority 0)."""
        if not self.ready():
            return "too early"
        if not self.valid():
            return "no window"
        if self.priorities is not None and self.priorities.total() == 0:
            return "all zero"
        return None

    def windows(self, sample: AbstractSample) -> list[tuple[int, int]]:
        """The windows `(row, absolute start)` a sample drew, from its `indices` and `steps`."""
        pairs = zip(np.asarray(sample.indices), np.asarray(sample.steps), strict=True)
        return [window_of(i, t, self.history.length) for i, t in pairs]

    def set_priorities(
        self,
        sample: AbstractSample | Integer[ArrayLike, " batch"],
        priorities: Float[ArrayLike, " batch"],
        *,
        steps: Integer[ArrayLike, " batch"] | None = None,
    ) -> None:
        """Mirror `buffer.set_priorities(sample, priorities)` (or `(indices, priorities,
        steps=...)`): updates of windows valid now are applied, the others dropped."""
        if self.priorities is None:
            raise TypeError("BufferReference.set_priorities(): the reference has no `alpha`.")
        if isinstance(sample, AbstractSample):
            windows = self.windows(sample)
        else:
            assert steps is not None, "pass `steps=` with indices"
            pairs = zip(np.asarray(sample), np.asarray(steps), strict=True)
            windows = [(int(i) // self.history.length, int(t)) for i, t in pairs]
        self.priorities.set(windows, np.asarray(priorities, np.float32))

    def expected(self, windows: Sequence[tuple[int, int]]) -> Any:
        """What `sample.experience` holds for `windows` (JAX arrays, batched like a sample):
        a tree of `(batch, sequence_length, *leaf)` windows, of `(batch, *leaf)` items, an
        [`equibuffer.Transition`][] or an [`equibuffer.NStepTransition`][]."""
        h = self.history
        each: list[Any] = [self.view.experience(h, w, self.rule.mask(h, w)) for w in windows]

        def stack(*xs: Any) -> Any:
            return jax.tree.map(lambda *v: jnp.asarray(np.stack(v)), *xs)

        if isinstance(self.view, PairView):
            first, second = zip(*each, strict=True)
            return Transition(first=stack(*first), second=stack(*second))
        if isinstance(self.view, NStepView):
            dtype = np.asarray(_named(h.at(0, 0), self.view.reward)).dtype
            fields = {k: stack(*(e[k] for e in each)) for k in ("first", "second", "last")}
            for k in ("reward", "discount"):
                fields[k] = jnp.asarray(np.array([e[k] for e in each], dtype))
            fields["steps"] = jnp.asarray(np.array([e["steps"] for e in each], np.int32))
            return NStepTransition(**fields)
        return stack(*each)

    def check_sample(self, sample: AbstractSample, beta: float = 1.0) -> None:
        """Assert that `sample` (what `buffer.sample(key, batch_size, ...)` returned) is one
        the buffer may return now: every window valid; its experience the data of that
        window, in the view's form, zero past an episode end; the episode `mask`; for a
        prioritised buffer the `probabilities` and the `weights` for this `beta`.

        Raises `AssertionError` saying what differs.
        """
        h, windows, valid = self.history, self.windows(sample), self.valid()
        for w in windows:
            assert w in valid, (
                f"sampled window {w} (row, start) is not valid; valid: {sorted(valid)}"
            )
        masks = np.array([self.rule.mask(h, w) for w in windows]).reshape(len(windows), -1)
        if isinstance(self.rule, EpisodeRule):
            assert isinstance(sample, EpisodeSample | PrioritisedEpisodeSample), type(sample)
            np.testing.assert_array_equal(np.asarray(sample.mask), masks, err_msg="sample.mask")
        want = self.expected(windows)
        if isinstance(self.view, NStepView):
            out = sample.experience
            for k in ("first", "second", "last"):
                _assert_tree_equal(getattr(out, k), getattr(want, k), f"experience.{k}")
            np.testing.assert_array_equal(np.asarray(out.steps), np.asarray(want.steps), "steps")
            tol = _tolerance(np.asarray(want.reward).dtype, self.view.n)
            scale = max(1.0, float(np.abs(np.asarray(want.reward, np.float64)).max()))
            for k in ("reward", "discount"):
                np.testing.assert_allclose(
                    np.asarray(getattr(out, k), np.float64),
                    np.asarray(getattr(want, k), np.float64),
                    rtol=tol,
                    atol=tol * scale,
                    err_msg=f"experience.{k}",
                )
        else:
            _assert_tree_equal(sample.experience, want, "experience")
        if self.priorities is not None:
            p = np.array([self.priorities.probability(w) for w in windows])
            assert (p > 0).all(), "a window of priority 0 was drawn"
            assert isinstance(sample, AbstractPrioritisedSample), type(sample)
            got_p, got_w = np.asarray(sample.probabilities), np.asarray(sample.weights)
            np.testing.assert_allclose(got_p, p, rtol=1e-5, err_msg="probabilities")
            weights = (p / p.min()) ** -beta
            np.testing.assert_allclose(got_w, weights, rtol=1e-4, err_msg="weights")


class QueueReference:
    """A NumPy model of a [`equibuffer.Queue`][]: a [`equibuffer.testing.History`][] and the
    number of steps per row not read yet.

    **Arguments:**

    - `rows`, `length`: the rows and steps per row of the queue.
    - `sequence_length`: the steps per row each `sample` takes.
    - `example`: one step, so that `add` also takes the one-step form (as for
        [`equibuffer.testing.BufferReference`][]).

    !!! example

        ```python
        import jax.numpy as jnp
        import equibuffer as eb
        from equibuffer.testing import QueueReference

        queue = eb.Queue({"x": jnp.int32(0)}, add_batch_size=2, capacity=8, sequence_length=2)
        reference = QueueReference.from_buffer(queue)
        batch = {"x": jnp.arange(6, dtype=jnp.int32).reshape(2, 3)}
        queue, _ = queue.add(batch), reference.add(batch)
        assert reference.can_sample() and not reference.can_add(2)
        queue, sample = queue.sample()
        reference.check_sample(sample)  # the oldest 2 unread steps of each row; now read
        assert reference.unread == 1 == int(queue.unread)
        ```
    """

    def __init__(
        self, rows: int, length: int, sequence_length: int, *, example: PyTree[Any] | None = None
    ):
        self.history = History(rows, length)
        self.sequence_length = sequence_length
        self.example = example
        self.unread = 0

    def __repr__(self) -> str:
        h = self.history
        return (
            f"QueueReference(rows={h.rows}, length={h.length}, "
            f"sequence_length={self.sequence_length}; {h.total} steps added, {self.unread} unread)"
        )

    @classmethod
    def from_buffer(cls, queue: Queue | AbstractBuffer) -> "QueueReference":
        """The reference of an empty `queue` (another buffer is refused: its model is
        [`equibuffer.testing.BufferReference`][])."""
        if not isinstance(queue, Queue):
            raise TypeError(
                f"QueueReference.from_buffer(): expected a Queue, got {type(queue).__name__}."
            )
        if queue.storage.steps_added() != 0:
            raise ValueError(
                "QueueReference.from_buffer(): the queue already holds steps; build the "
                "reference from the empty queue, then add the same batches to both."
            )
        rows = queue.add_batch_size
        return cls(
            rows,
            queue.capacity // rows,
            queue.sequence_length,
            example=queue.storage.example(),
        )

    def can_add(self, steps: int = 1) -> bool:
        """`can_add(steps)`: whether `steps` more steps per row fit without overwriting unread
        ones."""
        return self.unread + steps <= self.history.length

    def can_sample(self) -> bool:
        """`can_sample()`: at least `sequence_length` unread steps per row."""
        return self.unread >= self.sequence_length

    def size(self) -> int:
        """`size()`: the unread steps over all rows."""
        return self.unread * self.history.rows

    def add(self, batch: PyTree[Shaped[ArrayLike, "rows ..."]]) -> None:
        """Add what `queue.add(batch)` adds (which must fit: `can_add(T)`)."""
        steps = _as_steps(self.example, batch)
        t = np.shape(jax.tree.leaves(steps)[0])[1]
        assert self.can_add(t), f"{t} steps per row do not fit ({self.unread} unread)"
        self.history.add(steps)
        self.unread += t

    def check_sample(self, sample: AbstractSample) -> None:
        """Assert that `sample` (from `queue.sample()`) holds the oldest `sequence_length`
        unread steps of every row, in order, with their indices and steps; then mark them
        read, as the queue did."""
        assert self.can_sample(), "the queue cannot be sampled: too few unread steps"
        h, s = self.history, self.sequence_length
        start = h.total - self.unread
        rows = range(h.rows)
        want = jax.tree.map(lambda *w: np.stack(w), *(h.window(r, start, s) for r in rows))
        _assert_tree_equal(sample.experience, want, "experience")
        indices = [flat_index((r, start), h.length) for r in rows]
        np.testing.assert_array_equal(np.asarray(sample.indices), indices, "indices")
        np.testing.assert_array_equal(np.asarray(sample.steps), [start % 2**32] * h.rows, "steps")
        self.unread -= s
