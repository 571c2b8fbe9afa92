"""Episode-aware sequence sampling: the trajectory buffer's ring plus a `SumTree` with one leaf
per window start that is zero unless the window fits the episode rule.

- [`equibuffer.EpisodeTrajectoryBuffer`][]: leaves of 0 or 1, drawn exactly uniformly.
- `PrioritisedEpisodeTrajectoryBuffer`: leaves of `priority ** alpha` on the valid windows,
    drawn in proportion.

Both keep their tree in step at `add` exactly like the prioritised buffers keep theirs: only
the windows that start at one of the steps just written, or at one of the
`sequence_length - 1` steps before them, can change status, so an `add` of `T` steps touches
`add_batch_size * min(T + sequence_length - 1, max_length)` leaves and reads
`sequence_length - 1` episode flags for each. Sampling is a search in the tree: no rejection
loop. The pieces the two buffers share (the episode-end check, the validity of a set of
window starts, the pad mask) are the module-level functions below.
"""

from collections.abc import Callable, Mapping
from typing import Any, cast, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree, Shaped

from .._checks import check_positive_int, keystr
from .._custom_types import BoolScalar, ExampleTree, ExperienceBatch, Indices, IntScalar
from .._ring import RingStorage
from .._sumtree import SumTree
from .._windows import flat_indices, gather, window_layout, window_steps
from ._base import (
    AbstractBuffer,
    check_window_config,
    resolve_length,
    Sample,
    update_storage,
    UpdateFn,
)
from ._prioritised import _check_alpha, AbstractPrioritisedBuffer, PrioritisedSample


# A leaf name, or `step -> 0-d bool` (its output is checked at construction, with a message).
EpisodeEnd: TypeAlias = str | Callable[[PyTree[Shaped[Array, "..."]]], Any]
Mode: TypeAlias = Literal["never_cross", "pad"]

# Uniform leaves hold 0 or 1 and every node an integer count, exact in float32 up to 2**24.
_MAX_LEAVES = 1 << 24


class EpisodeSample(Sample):
    """What [`equibuffer.EpisodeTrajectoryBuffer`][]'s `sample` returns: a
    [`equibuffer.Sample`][] (`experience` with leaves `(batch, sequence_length, *leaf)`,
    `indices`, `steps`) plus

    - `mask`: `(batch, sequence_length)` bool, true at the steps that belong to the window's
        episode. With `mode="never_cross"` it is all true; with `mode="pad"` it is false
        after the first episode end in the window, and the experience is zero there.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"r": jnp.float32(0), "done": jnp.bool_(False)}
        buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=1, max_length=8,
                                            sequence_length=3, mode="pad")
        done = jnp.array([[False, True, False, False, False]])  # episodes 0-1 and 2-4
        buffer = buffer.add({"r": jnp.ones((1, 5)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert isinstance(sample, eb.EpisodeSample) and sample.mask.shape == (16, 3)
        assert (sample.experience["r"] == sample.mask.astype(jnp.float32)).all()  # 0 past the end
        ```
    """

    mask: Bool[Array, "batch sequence"]


class PrioritisedEpisodeSample(PrioritisedSample):
    """What `PrioritisedEpisodeTrajectoryBuffer.sample` returns: a
    [`equibuffer.PrioritisedSample`][] (`experience`, `indices`, `steps`, `probabilities`,
    `weights`) plus `mask`, `(batch, sequence_length)` bool, as in
    [`equibuffer.EpisodeSample`][]: all true with `mode="never_cross"`; with `mode="pad"`
    false after the first episode end in the window, where the experience is zero.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
            {"r": jnp.float32(0), "done": jnp.bool_(False)}, add_batch_size=1,
            max_length=8, sequence_length=3, mode="pad")
        done = jnp.array([[False, True, False, False, False]])  # episodes 0-1, 2-
        buffer = buffer.add({"r": jnp.ones((1, 5)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert sample.mask.shape == (8, 3) and bool(sample.mask[:, 0].all())
        # a padded window's loss averages over its own episode's steps only
        steps = sample.mask.sum(axis=1, dtype=jnp.float32)
        loss = (sample.weights * sample.experience["r"].sum(axis=1) / steps).mean()
        ```
    """

    mask: Bool[Array, "batch sequence"]


# ----------------------------------------------------------------------------- shared pieces


def _check_episode_end(where: str, example: Any, episode_end: Any) -> EpisodeEnd:
    """Validate `episode_end` against the example (a tree of `jax.ShapeDtypeStruct`s)."""
    if isinstance(episode_end, str):
        if not isinstance(example, Mapping) or episode_end not in example:
            leaves = jax.tree_util.tree_flatten_with_path(example)[0]
            names = ", ".join(keystr(p) for p, _ in leaves)
            raise ValueError(
                f"{where}: `episode_end={episode_end!r}` names no top-level leaf of the example "
                f"(its leaves are {names}). Name a boolean 0-d leaf of a dict example, or pass "
                "a function `step -> bool`, e.g. `lambda s: s['terminated'] | s['truncated']`."
            )
        leaf = example[episode_end]
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        if shape != () or dtype != jnp.bool_:
            raise TypeError(
                f"{where}: the episode-end leaf [{episode_end!r}] must be a 0-d bool "
                f"(e.g. jnp.bool_(False)), got shape {shape} and dtype {dtype.name}. Store "
                "`terminated | truncated` as a bool, or pass a function `step -> bool`."
            )
        return episode_end
    if not callable(episode_end):
        raise TypeError(
            f"{where}: `episode_end` must be the name of a boolean leaf or a function "
            f"`step -> bool`, got {episode_end!r}."
        )
    out = jax.eval_shape(episode_end, example)
    if not hasattr(out, "shape") or tuple(out.shape) != () or jnp.dtype(out.dtype) != jnp.bool_:
        got = (
            f"shape {tuple(out.shape)} and dtype {jnp.dtype(out.dtype).name}"
            if hasattr(out, "shape")
            else repr(out)
        )
        raise TypeError(
            f"{where}: the `episode_end` function must return a 0-d bool for one step, got {got}."
        )
    return cast(EpisodeEnd, episode_end)


def _configure(
    buffer: "EpisodeTrajectoryBuffer | PrioritisedEpisodeTrajectoryBuffer",
    where: str,
    example: ExampleTree,
    add_batch_size: int,
    sequence_length: int,
    period: int,
    max_length: int | None,
    capacity: int | None,
    max_size: int | None,
    min_length: int | None,
    episode_end: Any,
    mode: Any,
    exact_counts: bool,
) -> None:
    """Check the constructor arguments both buffers share and set their fields (called from
    `__init__`): `storage`, `sequence_length`, `period`, `min_length`, `mode`,
    `episode_end`, `ends` (all false) and `tree` (all zero). `exact_counts`: the leaves
    count windows (0 or 1), so their float32 sums must stay exact."""
    rows = check_positive_int(where, "add_batch_size", add_batch_size)
    length = resolve_length(where, rows, max_length, capacity, max_size)
    if exact_counts and rows * length > _MAX_LEAVES:
        raise ValueError(
            f"{where}: add_batch_size * max_length = {rows * length} steps is more than "
            f"{_MAX_LEAVES} (2**24), the largest count of windows drawn exactly uniformly "
            "(the valid windows are counted in float32). Lower `capacity`/`max_length`."
        )
    buffer.sequence_length, buffer.period, buffer.min_length = check_window_config(
        where, length, sequence_length, period, min_length
    )
    if mode not in ("never_cross", "pad"):
        raise ValueError(f"{where}: `mode` must be 'never_cross' or 'pad', got {mode!r}.")
    buffer.mode = mode
    buffer.storage = RingStorage(example, rows, length)
    buffer.episode_end = _check_episode_end(where, buffer.storage.example(), episode_end)
    buffer.ends = jnp.zeros((rows, length), jnp.bool_)
    buffer.tree = SumTree(rows * length)


def _ends_of(
    episode_end: EpisodeEnd, steps: PyTree[Shaped[Array, "rows time ..."]]
) -> Bool[Array, "rows time"]:
    """The episode-end flag of every step of a `(rows, time, *leaf)` tree."""
    if isinstance(episode_end, str):
        return steps[episode_end]
    return jax.vmap(jax.vmap(episode_end))(steps)


def _write(
    storage: RingStorage,
    ends: Bool[Array, "rows length"],
    batch: ExperienceBatch,
    episode_end: EpisodeEnd,
    sequence_length: int,
    where: str,
) -> tuple[RingStorage, Bool[Array, "rows length"], Int[Array, " m"], int]:
    """Write `batch` and its episode-end flags. Returns the new storage and flags, the offsets
    (from the oldest held step) of the `m = min(keep + sequence_length - 1, length)` window
    starts whose status may have changed, oldest first, and `keep`, the number of steps
    written (the last `keep` of those `m` starts are new data)."""
    t = storage.steps_in(batch, where)
    new_storage = storage.write(batch)
    length = storage.length
    steps = 1 if t is None else t
    keep = min(steps, length)
    if t is None:
        batch = jax.tree.map(lambda x: jnp.asarray(x)[:, None], batch)
    kept = jax.tree.map(lambda x: jnp.asarray(x)[:, steps - keep :], batch)
    start = (storage.head + (steps - keep)) % length
    slots = (start + jnp.arange(keep, dtype=jnp.int32)) % length
    new_ends = _ends_of(episode_end, kept)
    ends = ends.at[:, slots].set(new_ends, unique_indices=True, mode="promise_in_bounds")
    m = min(keep + sequence_length - 1, length)
    offsets = new_storage.fill - m + jnp.arange(m, dtype=jnp.int32)
    return new_storage, ends, offsets, keep


def _validity(
    storage: RingStorage,
    ends: Bool[Array, "rows length"],
    offsets: Int[Array, " m"],
    sequence_length: int,
    period: int,
    mode: Mode,
) -> tuple[Bool[Array, "rows m"], Int[Array, " m"]]:
    """Whether the window starting `offsets` steps after the oldest held step (may be
    negative: not held) is valid by the episode rule, in every row; and the slot of each
    start. `never_cross`: a held, period-aligned, complete window with no episode end before
    its last step. `pad`: a held, period-aligned window that is complete or cut by an end."""
    s, length = sequence_length, storage.length
    first, count = window_layout(storage, s, period)
    rel = offsets - first
    aligned = (offsets >= 0) & (offsets < storage.fill) & (rel >= 0) & (rel % period == 0)
    base = storage.head - storage.fill + length  # slot of offset 0, plus `length`
    slots = (base + offsets) % length
    if s > 1:
        # The flags of the first `s - 1` steps of each window, and whether each is held.
        inner = offsets[:, None] + jnp.arange(s - 1, dtype=jnp.int32)[None, :]
        flags = ends[:, (base + inner) % length]  # (rows, m, s - 1)
        crossed = jnp.any(flags & (inner < storage.fill)[None], axis=-1)
    else:
        crossed = jnp.zeros((storage.rows, offsets.shape[0]), jnp.bool_)
    if mode == "never_cross":
        held = aligned & (rel // period < count)
        return held[None, :] & ~crossed, slots
    whole = aligned & (offsets + s <= storage.fill)
    return aligned[None, :] & (whole[None, :] | crossed), slots


def _mask(
    storage: RingStorage,
    ends: Bool[Array, "rows length"],
    indices: Indices,
    sequence_length: int,
    mode: Mode,
) -> Bool[Array, "batch sequence"]:
    """True at the steps of each window (starting at the flat `indices`) up to and including
    the first episode end: all true in `never_cross` mode."""
    if mode == "never_cross":
        return jnp.ones((indices.shape[0], sequence_length), jnp.bool_)
    flat = window_steps(storage.length, indices, sequence_length)
    flags = ends.reshape(-1).at[flat].get(mode="promise_in_bounds").astype(jnp.int32)
    # Step j belongs to the episode when no end comes before it in the window.
    return jnp.cumsum(flags, axis=1) - flags == 0


def _padded(
    windows: PyTree[Shaped[Array, "batch sequence ..."]],
    mask: Bool[Array, "batch sequence"],
    mode: Mode,
) -> PyTree[Shaped[Array, "batch sequence ..."]]:
    """The gathered `windows`, zero where `mask` is false (past the first episode end) in
    `pad` mode; unchanged in `never_cross` mode, where the mask is all true."""
    if mode == "never_cross":
        return windows

    def zero(x: Array) -> Array:
        m = mask.reshape(*mask.shape, *(1,) * (x.ndim - 2))
        return jnp.where(m, x, jnp.zeros((), x.dtype))

    return jax.tree.map(zero, windows)


def _no_window_message(where: str, sequence_length: int, mode: Mode) -> str:
    fix = (
        "use mode='pad' (short episodes are zero-padded) or a shorter sequence_length"
        if mode == "never_cross"
        else "add more steps or use a shorter sequence_length"
    )
    return (
        f"{where}: no window of sequence_length={sequence_length} fits inside an episode "
        f"among the steps held (mode={mode!r}; `can_sample()` only looks at the counters). "
        f"To sample anyway, {fix}."
    )


# ---------------------------------------------------------------------------- the buffers


class EpisodeTrajectoryBuffer(AbstractBuffer):
    """A [`equibuffer.TrajectoryBuffer`][] whose windows stay inside one episode.

    `episode_end` marks the last step of an episode (termination and truncation both end
    it: store `terminated | truncated`). Two modes:

    - `mode="never_cross"` (default): a window never contains an episode end except possibly
        at its last step, so it is `sequence_length` steps of one episode. Episodes shorter
        than the window are skipped. Sampling is exactly uniform over the windows that remain.
    - `mode="pad"`: a window may start at any (period-aligned) step of an episode; the steps
        after the first episode end in it come back zero, with `mask` false there. Short
        episodes are used, padded.

    In both modes windows start at absolute steps that are multiples of `period` and never
    mix two episodes or span the write head, also across the ring's wrap-around.

    `can_sample()` depends only on the counters (as for every buffer, so
    `lax.cond(buffer.can_sample(), learn, skip)` stays a cond under `vmap`). A state with
    ready counters but no window that fits inside an episode makes `sample` raise (inside
    jit, through `eqx.error_if`). `num_valid_windows()` counts the windows that can be drawn.

    The motivating configuration: `(84, 84, 3)` observations from 100 environments, 100,000
    sequences of 40 steps, any 40-step range inside an episode:

    ```python
    example = {"obs": jnp.zeros((84, 84, 3), jnp.uint8), "done": jnp.bool_(False)}
    buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=100, sequence_length=40,
                                        capacity=100_000 * 40, episode_end="done")
    ```

    (4,000,000 steps of 21 KB: 85 GB of observations, so it needs a large accelerator; the
    storage size is `capacity`, whatever the number of environments adding. See
    `docs/episodes.md`.)

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=2, max_length=32,
                                            sequence_length=4, episode_end="done")
        done = jnp.zeros((2, 12), bool).at[:, 5].set(True)  # episodes of 6 steps
        buffer = buffer.add({"obs": jnp.ones((2, 12, 2)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["obs"].shape == (16, 4, 2)
        # no episode end before the last step of any window
        assert not sample.experience["done"][:, :-1].any()
        ```
    """

    storage: RingStorage
    ends: Bool[Array, "rows length"]
    tree: SumTree
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    episode_end: EpisodeEnd = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        episode_end: EpisodeEnd = "done",
        mode: Mode = "never_cross",
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `max_length`, `capacity`
            (alias `max_size`), `min_length`: as for [`equibuffer.TrajectoryBuffer`][].
        - `episode_end`: what marks the last step of an episode: the name of a 0-d bool leaf
            of a dict example (default `"done"`), or a function of one step returning a 0-d
            bool (e.g. `lambda s: s["terminated"] | s["truncated"]`).
        - `mode`: `"never_cross"` (windows lie wholly inside an episode; shorter episodes are
            skipped) or `"pad"` (windows are cut at the episode end, zero-padded, with a
            `mask`).
        """
        where = "EpisodeTrajectoryBuffer()"
        _configure(
            self, where, example, add_batch_size, sequence_length, period, max_length, capacity,
            max_size, min_length, episode_end, mode, True,
        )  # fmt: skip

    def add(self, batch: ExperienceBatch) -> "EpisodeTrajectoryBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row, and keep the set of valid windows in step.

        **Returns:**

        The updated buffer. The bookkeeping touches
        `add_batch_size * min(T + sequence_length - 1, max_length)` windows and reads
        `sequence_length - 1` episode flags for each, never the whole ring; under
        `eqx.filter_jit(donate="all")` the write is in place.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.EpisodeTrajectoryBuffer({"done": jnp.bool_(False)}, add_batch_size=1,
                                                max_length=8, sequence_length=3, episode_end="done")
            buffer = buffer.add({"done": jnp.array([[False, False, True]])})  # a 3-step episode
            assert int(buffer.num_valid_windows()) == 1
            buffer = buffer.add({"done": jnp.array([False])})  # one step, leaves (add_batch_size,)
            buffer = buffer.add({"done": jnp.array([[False, False]])})  # the next episode: 3 steps
            assert int(buffer.num_valid_windows()) == 2 and int(buffer.size()) == 6
            ```
        """
        where = f"{type(self).__name__}.add()"
        storage, ends, offsets, _ = _write(
            self.storage, self.ends, batch, self.episode_end, self.sequence_length, where
        )
        return self._refresh(storage, ends, offsets)

    def update(self, fn: UpdateFn) -> "EpisodeTrajectoryBuffer":
        """Return the buffer with `fn` applied to every stored step (see
        [`equibuffer.AbstractBuffer.update`][]); the episode ends are recomputed from the
        updated steps, and with them every window's validity (a cost of order the capacity
        times `sequence_length`).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.EpisodeTrajectoryBuffer({"done": jnp.bool_(False)}, add_batch_size=1,
                                                max_length=8, sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_valid_windows()) == 2  # steps 1-3 and 2-4
            buffer = buffer.update(lambda step: {"done": jnp.zeros_like(step["done"])})
            assert int(buffer.num_valid_windows()) == 3  # no episode end left: steps 0-2 too
            ```
        """
        storage = update_storage(self.storage, fn, type(self).__name__)
        ends = _ends_of(self.episode_end, storage.data)
        return self._refresh(storage, ends, jnp.arange(storage.length, dtype=jnp.int32))

    def _refresh(
        self, storage: RingStorage, ends: Bool[Array, "rows length"], offsets: Int[Array, " m"]
    ) -> "EpisodeTrajectoryBuffer":
        """The buffer with `storage`, `ends`, and the leaves of the windows starting at
        `offsets` set to 1 if valid, else 0."""
        valid, slots = _validity(
            storage, ends, offsets, self.sequence_length, self.period, self.mode
        )
        indices = flat_indices(storage.rows, storage.length, slots)
        tree = self.tree.write(indices, valid.reshape(-1).astype(jnp.float32))
        return eqx.tree_at(lambda b: (b.storage, b.ends, b.tree), self, (storage, ends, tree))

    def num_valid_windows(self) -> IntScalar:
        """The number of windows that can be drawn now (0-d int32): those inside the held
        steps that fit inside an episode (`mode="never_cross"`) or are cut by an episode end
        (`mode="pad"`). A function of the stored episode flags, so batched under `vmap`: for
        branching use `can_sample()`.

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            example = {"done": jnp.bool_(False)}
            buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=1, max_length=8,
                                                sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_valid_windows()) == 2  # steps 1-3 and 2-4
            ```
        """
        return self.tree.total().astype(jnp.int32)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> EpisodeSample:
        """Draw `batch_size` windows independently and exactly uniformly over the valid
        windows (with replacement).

        **Returns:**

        An [`equibuffer.EpisodeSample`][]: `experience` leaves
        `(batch_size, sequence_length, *leaf)`, `indices`, `steps`, and `mask`
        `(batch_size, sequence_length)`.

        Raises inside jit (through `eqx.error_if`) when `can_sample()` is false, or when it is
        true but no window fits inside an episode.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            example = {"t": jnp.int32(0), "done": jnp.bool_(False)}
            buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=1, max_length=16,
                                                sequence_length=3)
            done = jnp.arange(10) % 5 == 4  # two episodes: steps 0-4 and 5-9
            buffer = buffer.add({"t": jnp.arange(10, dtype=jnp.int32)[None], "done": done[None]})
            sample = buffer.sample(jax.random.key(0), batch_size=8)
            assert sample.experience["t"].shape == (8, 3) and sample.mask.all()
            assert (sample.experience["t"][:, 0] % 5 <= 2).all()  # never across steps 4 and 5
            ```
        """
        where = f"{type(self).__name__}.sample()"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        total = self.num_valid_windows()
        rank = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1), dtype=jnp.int32)
        # Integer prefixes and integer node sums are exact in float32 below 2**24.
        indices = self.tree.find(rank.astype(jnp.float32))
        indices = eqx.branched_error_if(
            indices,
            ~self.can_sample() | (total == 0),
            jnp.where(self.can_sample(), 1, 0),
            [
                f"{where}: the buffer cannot be sampled yet: it needs at least "
                f"min_length={self.min_length} steps per row and one window of "
                f"sequence_length={self.sequence_length}. Check `buffer.can_sample()` first.",
                _no_window_message(where, self.sequence_length, self.mode),
            ],
        )
        storage, s = self.storage, self.sequence_length
        offset = (indices % storage.length - storage.head + storage.fill) % storage.length
        steps = storage.count_lo - storage.fill.astype(jnp.uint32) + offset.astype(jnp.uint32)
        mask = _mask(storage, self.ends, indices, s, self.mode)
        windows = _padded(gather(storage, indices, s), mask, self.mode)
        return EpisodeSample(experience=windows, indices=indices, steps=steps, mask=mask)


class PrioritisedEpisodeTrajectoryBuffer(AbstractPrioritisedBuffer):
    """An [`equibuffer.EpisodeTrajectoryBuffer`][] that draws its valid windows in proportion
    to their priority: window `i` with probability `p_i**alpha / sum_k p_k**alpha`, the sum
    over the windows valid by the episode rule (`mode="never_cross"` or `"pad"`, exactly as
    for the uniform buffer). A window that is not valid is never drawn and keeps no priority.

    - A window enters at the largest priority set so far (1 before any `set_priorities`),
        raised to `alpha`, when it becomes valid: once complete and inside an episode
        (`never_cross`), or complete or cut by an episode end (`pad`).
    - A window that is already valid keeps the priority it was given when later steps are
        added (in `pad` mode a window cut by an end is valid, and may be sampled and given a
        priority, before the steps after the end arrive). A slot overwritten by new data
        starts afresh.
    - `set_priorities(sample, priorities)` drops the updates of windows overwritten since
        they were sampled, and of windows that are not valid by the episode rule.
    - `can_sample()` depends only on the counters; with ready counters `sample` raises
        (inside jit) if no window fits the episode rule, or if every valid window has
        priority 0, and says which.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.PrioritisedEpisodeTrajectoryBuffer(example, add_batch_size=2, max_length=32,
                                                       sequence_length=4, alpha=0.6)
        done = jnp.zeros((2, 12), bool).at[:, 5].set(True)  # episodes of 6 steps
        buffer = buffer.add({"obs": jnp.ones((2, 12, 2)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16, beta=0.4)
        assert not sample.experience["done"][:, :-1].any()  # never crosses an end
        td_error = jnp.arange(16.0)
        buffer = buffer.set_priorities(sample, jnp.abs(td_error) + 1e-3)
        ```
    """

    storage: RingStorage
    ends: Bool[Array, "rows length"]
    valid: Bool[Array, "rows length"]
    num_valid: Int[Array, ""]
    tree: SumTree
    max_priority: Float[Array, ""]
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    episode_end: EpisodeEnd = eqx.field(static=True)
    alpha: float = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        episode_end: EpisodeEnd = "done",
        mode: Mode = "never_cross",
        alpha: float = 0.6,
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `max_length`, `capacity`
            (alias `max_size`), `min_length`, `episode_end`, `mode`: as for
            [`equibuffer.EpisodeTrajectoryBuffer`][].
        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over the valid windows of
            positive priority, 1 fully proportional. Default 0.6.
        """
        where = "PrioritisedEpisodeTrajectoryBuffer()"
        _configure(
            self, where, example, add_batch_size, sequence_length, period, max_length, capacity,
            max_size, min_length, episode_end, mode, False,
        )  # fmt: skip
        self.alpha = _check_alpha(where, alpha)
        self.valid = jnp.zeros((self.storage.rows, self.storage.length), jnp.bool_)
        self.num_valid = jnp.array(0, jnp.int32)
        self.max_priority = jnp.array(1.0, jnp.float32)

    def _experience(self, indices: Indices) -> Any:
        # Zeroed past the episode end by `sample`, which computes the mask once.
        return gather(self.storage, indices, self.sequence_length)

    def _no_valid_window(self, where: str) -> tuple[BoolScalar, str]:
        return self.num_valid == 0, _no_window_message(where, self.sequence_length, self.mode)

    def add(self, batch: ExperienceBatch) -> "PrioritisedEpisodeTrajectoryBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row, and keep the priorities in step: a window
        that becomes valid enters at `max_priority ** alpha`, one that stops being valid (its
        first step overwritten) gets 0, one that was valid already keeps its priority.

        **Returns:**

        The updated buffer. The bookkeeping touches
        `add_batch_size * min(T + sequence_length - 1, max_length)` windows, never the
        whole ring; under `eqx.filter_jit(donate="all")` the write is in place.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
                {"done": jnp.bool_(False)}, add_batch_size=1, max_length=8, sequence_length=3,
                alpha=1.0)
            buffer = buffer.add({"done": jnp.array([[False, False, True]])})  # one valid window
            sample = buffer.sample(jax.random.key(0), batch_size=2)
            buffer = buffer.set_priorities(sample, jnp.full(2, 4.0))
            buffer = buffer.add({"done": jnp.zeros((1, 3), bool)})  # a new one, entering at 4
            # two valid windows, both at priority 4
            assert jnp.allclose(buffer.sample(jax.random.key(1), batch_size=4).probabilities, 0.5)
            ```
        """
        where = f"{type(self).__name__}.add()"
        storage, ends, offsets, keep = _write(
            self.storage, self.ends, batch, self.episode_end, self.sequence_length, where
        )
        m = offsets.shape[0]
        return self._refresh(storage, ends, offsets, jnp.arange(m) >= m - keep)

    def update(self, fn: UpdateFn) -> "PrioritisedEpisodeTrajectoryBuffer":
        """Return the buffer with `fn` applied to every stored step (see
        [`equibuffer.AbstractBuffer.update`][]); the episode ends and every window's validity
        are recomputed (a cost of order the capacity times `sequence_length`). Windows valid
        before and after keep their priority; newly valid ones enter at the largest priority
        seen; the others get 0.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
                {"done": jnp.bool_(False)}, add_batch_size=1, max_length=8, sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_valid_windows()) == 2  # steps 1-3 and 2-4
            buffer = buffer.update(lambda step: {"done": jnp.zeros_like(step["done"])})
            assert int(buffer.num_valid_windows()) == 3  # no episode end left: steps 0-2 too
            ```
        """
        storage = update_storage(self.storage, fn, type(self).__name__)
        ends = _ends_of(self.episode_end, storage.data)
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        return self._refresh(storage, ends, offsets, jnp.zeros(storage.length, jnp.bool_))

    def _refresh(
        self,
        storage: RingStorage,
        ends: Bool[Array, "rows length"],
        offsets: Int[Array, " m"],
        overwritten: Bool[Array, " m"],
    ) -> "PrioritisedEpisodeTrajectoryBuffer":
        """The buffer with `storage`, `ends`, and the windows starting at `offsets` re-rated:
        0 if not valid; else the old leaf if the window was valid before and its slot was not
        `overwritten`, else `max_priority ** alpha`."""
        valid, slots = _validity(
            storage, ends, offsets, self.sequence_length, self.period, self.mode
        )
        rows, length = storage.rows, storage.length
        indices = flat_indices(rows, length, slots)
        before = self.valid[:, slots]
        old = self.tree.read(indices).reshape(valid.shape)
        fresh = self.max_priority**self.alpha
        kept = before & ~overwritten[None, :]
        leaves = jnp.where(valid, jnp.where(kept, old, fresh), 0.0)
        tree = self.tree.write(indices, leaves.reshape(-1))
        new_valid = self.valid.at[:, slots].set(
            valid, unique_indices=True, mode="promise_in_bounds"
        )
        num_valid = self.num_valid + jnp.sum(valid, dtype=jnp.int32)
        num_valid = num_valid - jnp.sum(before, dtype=jnp.int32)
        return eqx.tree_at(
            lambda b: (b.storage, b.ends, b.valid, b.num_valid, b.tree),
            self,
            (storage, ends, new_valid, num_valid, tree),
        )

    def _offsets(self, indices: Indices) -> tuple[Int[Array, " batch"], Bool[Array, " batch"]]:
        # The base's offset; validity by the episode rule (held and aligned included).
        offset, _ = AbstractPrioritisedBuffer._offsets(self, indices)
        valid = self.valid.reshape(-1).at[indices].get(mode="fill", fill_value=False)
        return offset, valid

    def num_valid_windows(self) -> IntScalar:
        """The number of windows valid by the episode rule now (0-d int32), whatever their
        priority. Batched under `vmap` (it depends on the stored flags): for branching use
        `can_sample()`.

        !!! example

            ```python
            import equibuffer as eb, jax.numpy as jnp

            buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
                {"done": jnp.bool_(False)}, add_batch_size=1, max_length=8, sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_valid_windows()) == 2  # steps 1-3 and 2-4
            ```
        """
        return self.num_valid

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        beta: float | Float[ArrayLike, ""] = 1.0,
    ) -> PrioritisedEpisodeSample:
        """Draw `batch_size` valid windows, each with probability
        `p_i**alpha / sum_k p_k**alpha` (stratified, as
        [`equibuffer.AbstractPrioritisedBuffer.sample`][]).

        **Arguments:** as for [`equibuffer.AbstractPrioritisedBuffer.sample`][].

        **Returns:**

        A `PrioritisedEpisodeSample`: `experience` (zero past the episode end in `pad`
        mode), `indices`, `steps`, `probabilities`, `weights` and `mask`.

        Raises inside jit (through `eqx.error_if`) when `can_sample()` is false, when it is
        true but no window fits the episode rule, or when every valid window has priority 0.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            example = {"r": jnp.float32(0), "done": jnp.bool_(False)}
            buffer = eb.PrioritisedEpisodeTrajectoryBuffer(example, add_batch_size=1, max_length=8,
                                                           sequence_length=3, mode="pad")
            done = jnp.array([[False, True, False, False, False]])  # episodes 0-1 and 2-4
            buffer = buffer.add({"r": jnp.ones((1, 5)), "done": done})
            sample = buffer.sample(jax.random.key(0), batch_size=6, beta=0.5)
            assert sample.experience["r"].shape == (6, 3) and sample.weights.shape == (6,)
            assert (sample.experience["r"] == sample.mask.astype(jnp.float32)).all()  # padded: 0
            ```
        """
        sample = AbstractPrioritisedBuffer.sample(self, key, batch_size, beta)
        mask = _mask(self.storage, self.ends, sample.indices, self.sequence_length, self.mode)
        return PrioritisedEpisodeSample(
            experience=_padded(sample.experience, mask, self.mode),
            indices=sample.indices,
            steps=sample.steps,
            probabilities=sample.probabilities,
            weights=sample.weights,
            mask=mask,
        )
