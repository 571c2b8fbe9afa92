"""Sampling rules: which windows may be drawn, with what probability, and the state that takes.

A rule is an `eqx.Module` holding its own arrays. The buffer calls it on every add (`added`,
with what the ring's write reports), after `update` (`updated`) and after its ring was replaced
(`updated(..., restored=True)`: `with_storage`, `Archive.restore`, `Archive.load`), and asks it
to `draw`.
The window itself (layout, validity by the counters, start steps) is the rule of
`_windows.py`, used by every rule here; the pieces two rules share are components:

- `EpisodeEnds`: the episode-end flag of every slot, and the episode rule on top of the
    counters' (`never_cross`: no end before a window's last step; `pad`: cut at the end).
- `PriorityState` functions (`draw_by_priority`, `set_by_priority`): a `SumTree` of
    `p ** alpha` and the largest priority seen, importance weights, stale updates dropped.

| rule | validity | drawn |
|---|---|---|
| `Uniform` | counters | uniformly, from the counters alone (no tree) |
| `Prioritised` | counters | in proportion to `p ** alpha` |
| `Episodic` | counters + episode rule | exactly uniformly (a tree of 0/1 leaves) |
| `PrioritisedEpisodic` | counters + episode rule | in proportion to `p ** alpha` |
"""

import abc
import math
from collections.abc import Callable, Mapping
from typing import Any, cast, Literal, NamedTuple, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree, Shaped

from .._checks import keystr
from .._custom_types import BoolScalar, Indices, IntScalar, Steps
from .._errors import branched_error_if, error_if, record
from .._ring import Appended, RingStorage
from .._sumtree import read_once, SumTree
from .._windows import (
    changed_offsets,
    flat_indices,
    offset_slots,
    start_steps,
    uniform_windows,
    window_layout,
    window_offsets,
    window_steps,
    windows_held,
)
from ._samples import Sample


# A leaf name, or `step -> 0-d bool` (its output is checked at construction, with a message).
EpisodeEnd: TypeAlias = str | Callable[[PyTree[Shaped[Array, "..."]]], Any]
Mode: TypeAlias = Literal["never_cross", "pad"]


class Window(NamedTuple):
    """The static window configuration a rule works with: its length (the view's), the
    period of its starts, and how errors name the window (e.g. `sequence_length=4`)."""

    length: int
    period: int
    name: str


class Drawn(NamedTuple):
    """What a rule's draw gives the buffer: the flat index and absolute start step of each
    window, and for prioritised rules the probability and importance weight of each."""

    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"] | None = None
    weights: Float[Array, " batch"] | None = None


# ------------------------------------------------------------------------- episode ends


def check_episode_end(where: str, example: Any, episode_end: Any) -> EpisodeEnd:
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


def check_mode(where: str, mode: Any) -> Mode:
    if mode not in ("never_cross", "pad"):
        raise ValueError(f"{where}: `mode` must be 'never_cross' or 'pad', got {mode!r}.")
    return mode


class EpisodeEnds(eqx.Module):
    """The episode-end flag of every slot of the ring, and the episode rule that reads them.

    `episode_end` marks the last step of an episode. `never_cross`: a valid window has no end
    before its last step. `pad`: a window may also be cut by an end (incomplete after it); the
    steps past the end are masked out.
    """

    ends: Bool[Array, "rows length"]
    episode_end: EpisodeEnd = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)

    def of(self, steps: PyTree[Shaped[Array, "rows time ..."]]) -> Bool[Array, "rows time"]:
        """The episode-end flag of every step of a `(rows, time, *leaf)` tree."""
        if isinstance(self.episode_end, str):
            return steps[self.episode_end]
        return jax.vmap(jax.vmap(self.episode_end))(steps)

    def written(self, storage: RingStorage, appended: Appended) -> "EpisodeEnds":
        """The flags with those of the steps just written."""
        slots = (appended.start + jnp.arange(appended.keep, dtype=jnp.int32)) % storage.length
        new = self.of(appended.steps)
        ends = self.ends.at[:, slots].set(new, unique_indices=True, mode="promise_in_bounds")
        return eqx.tree_at(lambda e: e.ends, self, ends)

    def recomputed(self, storage: RingStorage) -> "EpisodeEnds":
        """The flags recomputed from every held step (after `update`, or a ring replaced),
        false at the slots not written yet (as `written` leaves them)."""
        slots = jnp.arange(storage.length, dtype=jnp.int32)
        held = window_offsets(storage, slots) < storage.fill
        return eqx.tree_at(lambda e: e.ends, self, self.of(storage.data) & held[None, :])

    def validity(
        self, storage: RingStorage, offsets: Int[Array, " m"], window: Window
    ) -> tuple[Bool[Array, "rows m"], Int[Array, " m"]]:
        """Whether the window starting `offsets` steps after the oldest held step is valid by
        the counters and the episode rule, in every row; and the slot of each start."""
        s, period = window.length, window.period
        slots = offset_slots(storage, offsets)
        if s > 1:
            # The flags of the first `s - 1` steps of each window, and whether each is held.
            inner = offsets[:, None] + jnp.arange(s - 1, dtype=jnp.int32)[None, :]
            flags = self.ends[:, offset_slots(storage, inner)]  # (rows, m, s - 1)
            crossed = jnp.any(flags & (inner < storage.fill)[None], axis=-1)
        else:
            crossed = jnp.zeros((storage.rows, offsets.shape[0]), jnp.bool_)
        if self.mode == "never_cross":
            held = windows_held(storage, offsets, s, period)
            return held[None, :] & ~crossed, slots
        # pad: a held, aligned start whose window is complete or cut by an end.
        first, _ = window_layout(storage, s, period)
        rel = offsets - first
        aligned = (offsets >= 0) & (offsets < storage.fill) & (rel >= 0) & (rel % period == 0)
        whole = aligned & (offsets + s <= storage.fill)
        return aligned[None, :] & (whole[None, :] | crossed), slots

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        """True at the steps of each window up to and including the first episode end: all
        true in `never_cross` mode."""
        if self.mode == "never_cross":
            return jnp.ones((indices.shape[0], window.length), jnp.bool_)
        flat = window_steps(storage.length, indices, window.length)
        flags = self.ends.reshape(-1).at[flat].get(mode="promise_in_bounds").astype(jnp.int32)
        # Step j belongs to the episode when no end comes before it in the window.
        return jnp.cumsum(flags, axis=1) - flags == 0

    def no_window_message(self, where: str, window: Window, blocks: int = 1) -> str:
        fix = (
            "use mode='pad' (short episodes are zero-padded) or shorter windows"
            if self.mode == "never_cross"
            else "add more steps or use shorter windows"
        )
        held = "steps held"
        if blocks > 1:
            held = f"steps held in the rows of one of the row_blocks={blocks} blocks"
        return (
            f"{where}: no window of {window.name} fits inside an episode among the "
            f"{held} (mode={self.mode!r}; `can_sample()` only looks at the counters). "
            f"To sample anyway, {fix}."
        )


def new_episode_ends(where: str, storage: RingStorage, episode_end: Any, mode: Any) -> EpisodeEnds:
    """All-false flags for `storage`, with `episode_end` and `mode` checked."""
    return EpisodeEnds(
        ends=jnp.zeros((storage.rows, storage.length), jnp.bool_),
        episode_end=check_episode_end(where, storage.example(), episode_end),
        mode=check_mode(where, mode),
    )


# ----------------------------------------------------------------------------- priorities


def check_alpha(where: str, alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"{where}: `alpha` must be a Python float, got {alpha!r}.")
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(
            f"{where}: `alpha` must be finite and >= 0 (0 samples uniformly, 1 fully in "
            f"proportion to the priorities), got {alpha}."
        )
    return alpha


def check_priority(where: str, priority: Any) -> float:
    """A priority given on the host (`with_storage(..., priority=)`): a positive finite
    Python float (0 would exclude every window it is given to)."""
    if isinstance(priority, bool) or not isinstance(priority, int | float):
        raise TypeError(f"{where}: `priority` must be a Python float, got {priority!r}.")
    priority = float(priority)
    if not (math.isfinite(priority) and priority > 0):
        raise ValueError(
            f"{where}: `priority` must be finite and > 0 (a window of priority 0 is never "
            f"drawn), got {priority}."
        )
    return priority


def check_beta(where: str, beta: Any) -> Float[Array, ""]:
    if isinstance(beta, int | float) and not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"{where}: `beta` must be finite and >= 0, got {beta}.")
    exponent = jnp.asarray(beta, jnp.float32)
    if exponent.shape != ():
        raise ValueError(f"{where}: `beta` must be a scalar, got shape {exponent.shape}.")
    return exponent


def draw_by_priority(
    storage: RingStorage,
    tree: SumTree,
    key: PRNGKeyArray,
    batch_size: int,
    beta: Float[Array, ""],
    ready: BoolScalar,
    none_valid: BoolScalar,
    messages: tuple[str, str, str, str],
    blocks: int = 1,
) -> Drawn:
    """Draw `batch_size` leaves of `tree` in proportion to their values (stratified), with
    probabilities and importance weights. One check for the four ways to fail, in the order
    of `messages`: not `ready`; every valid window at priority 0; `none_valid`; a bad `beta`.

    With `blocks > 1` the leaves are cut into that many equal blocks (the rows' blocks) and
    the `b`-th `batch_size / blocks` draws are made inside block `b`, in proportion to the
    values there: probabilities and weights are those of the block (its total, its smallest
    drawn probability), and a block of total 0 fails as a tree of total 0 does."""
    if blocks == 1:
        indices, leaves = tree.sample_values(key, batch_size)
        totals = tree.total()
    else:
        per = batch_size // blocks
        totals = tree.block_totals(blocks)[:, None]
        u = (
            jnp.arange(per, dtype=jnp.float32)[None, :] + jax.random.uniform(key, (blocks, per))
        ) / per
        indices, leaves = tree.search_blocks(u * totals)
    # The barrier keeps XLA from fusing the tree search into the gather of the windows
    # (which would redo the search for every gathered element), and it is the only way out
    # of the tree: see `read_once`.
    indices, leaves, totals = read_once(indices, leaves, totals)
    total = jnp.min(totals)
    failure = jnp.where(total > 0, 3, jnp.where(none_valid, 2, 1))
    failure = jnp.where(~ready, 0, failure)
    indices = branched_error_if(
        indices,
        (failure < 3) | (beta < 0) | ~jnp.isfinite(beta),
        failure,
        list(messages),
    )
    probabilities = leaves / totals
    # (N P(i))^-beta / max_j (N P(j))^-beta, written so that it neither over- nor
    # underflows: every sampled P(i) > 0, and the ratio to the smallest is >= 1.
    smallest = jnp.min(probabilities, axis=-1, keepdims=True)
    weights = (probabilities / smallest) ** -beta
    indices, probabilities, weights = (x.reshape(-1) for x in (indices, probabilities, weights))
    steps = start_steps(storage, window_offsets(storage, indices))
    return Drawn(indices, steps, probabilities, weights)


def update_target(
    where: str, sample: Sample | Int[ArrayLike, " batch"], steps: Steps | None
) -> tuple[Int[ArrayLike, " batch"], Steps]:
    """The `(indices, steps)` a `set_priorities(sample, priorities, steps=...)` call names:
    those of the sample, or the indices given with `steps=`."""
    if isinstance(sample, Sample):
        if steps is not None:
            raise TypeError(
                f"{where}: `steps` is taken from the sample; pass either a Sample, or "
                "indices with `steps=`."
            )
        record(sample.error)  # a failure recorded while drawing it goes on to the buffer
        return sample.indices, sample.steps
    if steps is None:
        raise TypeError(
            f"{where}: pass the whole sample (`buffer.set_priorities(sample, "
            "priorities)`) or the indices with `steps=sample.steps`: the steps tell "
            "which windows were overwritten since they were sampled."
        )
    return sample, steps


def check_priority_update(
    where: str,
    capacity: int,
    indices: Int[ArrayLike, " batch"],
    steps: Steps,
    priorities: Float[ArrayLike, " batch"],
    bound: str = "add_batch_size * max_length_time_axis",
) -> tuple[Indices, Steps, Float[Array, " batch"]]:
    """The arguments of `set_priorities`, checked: shapes and dtypes at trace time, values
    (indices in range `[0, capacity)`, named `bound` in the error; priorities non-negative
    and finite) inside jit."""
    indices = jnp.asarray(indices)
    steps = jnp.asarray(steps)
    new = jnp.asarray(priorities)
    if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"{where}: `indices` must be a 1-d integer array, got shape {indices.shape} "
            f"and dtype {indices.dtype}."
        )
    for name, x in (("priorities", new), ("steps", steps)):
        if x.shape != indices.shape:
            raise ValueError(
                f"{where}: `{name}` has shape {x.shape} but `indices` has shape "
                f"{indices.shape}; give one per sampled window."
            )
    if steps.dtype != jnp.uint32:
        raise TypeError(f"{where}: `steps` must be uint32 (`sample.steps`), got {steps.dtype}.")
    new = new.astype(jnp.float32)
    indices = indices.astype(jnp.int32)
    out_of_range = jnp.any((indices < 0) | (indices >= capacity))
    new = branched_error_if(
        new,
        out_of_range | jnp.any((new < 0) | ~jnp.isfinite(new)),
        jnp.where(out_of_range, 0, 1),
        [
            f"{where}: every index must be in [0, {bound}={capacity}); pass `sample.indices`.",
            f"{where}: every priority must be non-negative and finite (a negative, NaN or "
            "infinite priority was given).",
        ],
    )
    return indices, steps, new


def set_by_priority(
    tree: SumTree,
    max_priority: Float[Array, ""],
    alpha: float,
    indices: Indices,
    new: Float[Array, " batch"],
    current: Bool[Array, " batch"],
) -> tuple[SumTree, Float[Array, ""]]:
    """Write `new ** alpha` at the `current` indices (the others are dropped), and raise the
    largest priority seen by the largest applied."""
    values = jnp.where(new > 0, new**alpha, 0.0)
    tree = tree.write(indices, values, mask=current)
    applied = jnp.max(jnp.where(current, new, 0.0))
    return tree, jnp.maximum(max_priority, applied)


# ---------------------------------------------------------------------------------- rules


class AbstractRule(eqx.Module):
    """A sampling rule: the state that says which windows may be drawn, kept in step with
    the ring by `added` and `updated`."""

    @abc.abstractmethod
    def added(self, storage: RingStorage, appended: Appended, window: Window) -> Any:
        """The rule after an add (`storage` is the ring after it, `appended` its report)."""

    @abc.abstractmethod
    def updated(self, storage: RingStorage, window: Window, *, restored: bool = False) -> Any:
        """The rule recomputed from `storage` (its held steps and its counters), whatever
        state it held: after `update` rewrote every stored step, or with `restored=True`
        after the ring itself was replaced (`with_storage`, and through it `Archive.restore`
        and `Archive.load`). What the steps and counters determine (episode flags, which
        windows are valid) is recomputed either way. What they do not (priorities) is kept
        after `update` for the windows that stay valid; when `restored`, every valid window
        enters anew, at `max_priority`, as a window an add makes valid does."""

    @abc.abstractmethod
    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"] | None:
        """The mask of the steps inside each drawn window's episode, or None (no episodes)."""

    @abc.abstractmethod
    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        """The number of windows that can be drawn now."""

    @abc.abstractmethod
    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        """Whether the window starting at each slot of each row is valid now (the windows
        `count_valid` counts; priorities play no part): what an epoch visits."""


def count_held(storage: RingStorage, window: Window) -> IntScalar:
    """The number of windows valid by the counters, over all rows."""
    return window_layout(storage, window.length, window.period)[1] * storage.rows


def held_starts(storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
    """Whether the window starting at each slot is valid by the counters, in every row."""
    offsets = window_offsets(storage, jnp.arange(storage.length, dtype=jnp.int32))
    held = windows_held(storage, offsets, window.length, window.period)
    return jnp.broadcast_to(held, (storage.rows, storage.length))


class AbstractUniformRule(AbstractRule):
    """A rule that draws its valid windows uniformly."""

    @abc.abstractmethod
    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        """Draw `batch_size` valid windows uniformly, with replacement; raise `not_ready`
        inside jit unless `ready`. With `blocks > 1` (dividing the rows and `batch_size`),
        the `b`-th `batch_size / blocks` windows are drawn uniformly among those of the
        `b`-th of `blocks` equal blocks of rows."""


class AbstractPrioritisedRule(AbstractRule):
    """A rule that draws its valid windows in proportion to `priority ** alpha`."""

    tree: eqx.AbstractVar[SumTree]
    max_priority: eqx.AbstractVar[Float[Array, ""]]
    alpha: eqx.AbstractVar[float]

    @abc.abstractmethod
    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        beta: Float[Array, ""],
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        """Draw `batch_size` valid windows by priority, with probabilities and weights;
        with `blocks > 1`, by block of rows as the uniform rules do (see `draw_by_priority`)."""

    @abc.abstractmethod
    def current(
        self, storage: RingStorage, window: Window, indices: Indices, steps: Steps
    ) -> Bool[Array, " batch"]:
        """Whether each window is still the one sampled at `steps` and valid now."""

    @abc.abstractmethod
    def with_priorities(self, tree: SumTree, max_priority: Float[Array, ""]) -> Any:
        """The rule with a new tree and largest priority."""


class Uniform(AbstractUniformRule):
    """Uniform over the windows valid by the counters: no state at all."""

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Uniform":
        return self

    def updated(self, storage: RingStorage, window: Window, *, restored: bool = False) -> "Uniform":
        return self

    def mask(self, storage: RingStorage, indices: Indices, window: Window) -> None:
        return None

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return count_held(storage, window)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return held_starts(storage, window)

    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        indices, steps = uniform_windows(
            storage, key, batch_size, window.length, window.period, blocks
        )
        return Drawn(error_if(indices, ~ready, not_ready), steps)


# The one `Uniform` rule: it has no state, so every buffer may share it (and `_with` sees
# `added` return the very rule it holds).
UNIFORM = Uniform()


# Uniform episode leaves hold 0 or 1 and every node an integer count, exact in float32 up to
# 2**24.
MAX_COUNTED = 1 << 24


class Episodic(AbstractUniformRule):
    """Exactly uniform over the windows valid by the counters and the episode rule: a
    `SumTree` with a leaf of 1 at each valid window start and 0 elsewhere."""

    episodes: EpisodeEnds
    tree: SumTree

    def _rated(
        self, storage: RingStorage, episodes: EpisodeEnds, offsets: Int[Array, " m"], window: Window
    ) -> "Episodic":
        valid, slots = episodes.validity(storage, offsets, window)
        indices = flat_indices(storage.rows, storage.length, slots)  # (each slot named once)
        tree = self.tree.write(indices, valid.reshape(-1).astype(jnp.float32), unique_indices=True)
        return Episodic(episodes=episodes, tree=tree)

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Episodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        return self._rated(storage, episodes, offsets, window)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "Episodic":
        # Every flag and every leaf recomputed: the same whether restored or not.
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        return self._rated(storage, self.episodes.recomputed(storage), offsets, window)

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        return self.episodes.mask(storage, indices, window)

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return self.tree.total().astype(jnp.int32)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        # The leaves are 1 at the valid window starts, 0 elsewhere.
        return (self.tree.values() > 0).reshape(storage.rows, storage.length)

    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        # Integer prefixes and integer node sums are exact in float32 below 2**24.
        if blocks == 1:
            total = self.count_valid(storage, window)
            rank = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1), jnp.int32)
            indices = self.tree.find(rank.astype(jnp.float32))
        else:
            totals = self.tree.block_totals(blocks).astype(jnp.int32)[:, None]
            shape = (blocks, batch_size // blocks)
            rank = jax.random.randint(key, shape, 0, jnp.maximum(totals, 1), jnp.int32)
            indices = self.tree.search_blocks(rank.astype(jnp.float32))[0].reshape(-1)
            total = jnp.min(totals)
        indices = branched_error_if(
            indices,
            ~ready | (total == 0),
            jnp.where(ready, 1, 0),
            [not_ready, self.episodes.no_window_message(where, window, blocks)],
        )
        return Drawn(indices, start_steps(storage, window_offsets(storage, indices)))


def episodic(where: str, storage: RingStorage, episode_end: Any, mode: Any) -> Episodic:
    """A new `Episodic` rule for `storage` (arguments checked)."""
    if storage.rows * storage.length > MAX_COUNTED:
        raise ValueError(
            f"{where}: the buffer holds {storage.rows * storage.length} steps in total, "
            f"more than {MAX_COUNTED} (2**24), the largest count of windows drawn exactly "
            "uniformly (the valid windows are counted in float32). Lower `capacity` (or "
            "`max_length_time_axis`)."
        )
    episodes = new_episode_ends(where, storage, episode_end, mode)
    return Episodic(episodes=episodes, tree=SumTree(storage.rows * storage.length))


class Prioritised(AbstractPrioritisedRule):
    """In proportion to `priority ** alpha` over the windows valid by the counters: a
    `SumTree` with one leaf per window start (`row * length + slot`), holding `p ** alpha`
    while the window is valid and 0 otherwise. New windows enter at the largest priority
    set so far; so does every valid window of a restored ring (`updated(restored=True)`)."""

    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Prioritised":
        # Every window among the changed starts was incomplete or not held before the add
        # (the counters' rule), so a valid one is new and enters at the largest priority.
        rows, length = storage.rows, storage.length
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        valid = windows_held(storage, offsets, window.length, window.period)
        fresh = self.max_priority**self.alpha
        values = jnp.broadcast_to(jnp.where(valid, fresh, 0.0), (rows, m)).reshape(-1)
        if rows == 1:
            # One row: the leaves are one block of slots, wrapping the ring's end as the tree's
            # (a block write is contiguous slices only: no per-level scatter and gather).
            start = jax.lax.rem(storage.head - m + length, jnp.int32(length))  # (non-negative)
            tree = self.tree.write_block(start, values)
        else:
            slots = (storage.head - m + jnp.arange(m, dtype=jnp.int32)) % length  # (m <= length)
            tree = self.tree.write(flat_indices(rows, length, slots), values, unique_indices=True)
        return eqx.tree_at(lambda r: r.tree, self, tree)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "Prioritised":
        if not restored:  # `update` keeps the counters: every window keeps its priority
            return self
        # Every leaf written: `max_priority ** alpha` at each window valid by the counters.
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        valid = windows_held(storage, offsets, window.length, window.period)
        fresh = jnp.where(valid, self.max_priority**self.alpha, 0.0)
        values = jnp.broadcast_to(fresh, (storage.rows, storage.length)).reshape(-1)
        indices = flat_indices(storage.rows, storage.length, offset_slots(storage, offsets))
        tree = self.tree.write(indices, values, unique_indices=True)  # (every slot once)
        return eqx.tree_at(lambda r: r.tree, self, tree)

    def mask(self, storage: RingStorage, indices: Indices, window: Window) -> None:
        return None

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return count_held(storage, window)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return held_starts(storage, window)

    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        beta: Float[Array, ""],
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        return draw_by_priority(
            storage,
            self.tree,
            key,
            batch_size,
            beta,
            ready,
            jnp.array(False),
            _priority_messages(where, not_ready, f"{where}: no valid window.", blocks),
            blocks,
        )

    def current(
        self, storage: RingStorage, window: Window, indices: Indices, steps: Steps
    ) -> Bool[Array, " batch"]:
        offset = window_offsets(storage, indices)
        valid = (offset < storage.fill) & windows_held(
            storage, offset, window.length, window.period
        )
        return valid & (start_steps(storage, offset) == steps)

    def with_priorities(self, tree: SumTree, max_priority: Float[Array, ""]) -> "Prioritised":
        return Prioritised(tree=tree, max_priority=max_priority, alpha=self.alpha)


class PrioritisedEpisodic(AbstractPrioritisedRule):
    """In proportion to `priority ** alpha` over the windows valid by the counters and the
    episode rule. A window enters at the largest priority set so far when it becomes valid,
    keeps its priority while it stays valid (in `pad` mode a window cut by an end is valid
    before the steps after the end arrive), and gets 0 when it stops being valid."""

    episodes: EpisodeEnds
    valid: Bool[Array, "rows length"]
    num_valid: Int[Array, ""]
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def _rated(
        self,
        storage: RingStorage,
        episodes: EpisodeEnds,
        offsets: Int[Array, " m"],
        overwritten: Bool[Array, " m"],
        window: Window,
    ) -> "PrioritisedEpisodic":
        """Re-rate the windows starting at `offsets`: 0 if not valid; else the old leaf if the
        window was valid before and its slot was not `overwritten`, else `max_priority **
        alpha`."""
        valid, slots = episodes.validity(storage, offsets, window)
        indices = flat_indices(storage.rows, storage.length, slots)  # (each slot named once)
        before = self.valid[:, slots]
        old = self.tree.read(indices).reshape(valid.shape)
        fresh = self.max_priority**self.alpha
        kept = before & ~overwritten[None, :]
        leaves = jnp.where(valid, jnp.where(kept, old, fresh), 0.0)
        tree = self.tree.write(indices, leaves.reshape(-1), unique_indices=True)
        # The flags written only after `before` is read: else XLA copies them to keep
        # `before`, which nothing makes it read first (see `read_once`).
        before, valid = read_once(before, valid)
        new_valid = self.valid.at[:, slots].set(
            valid, unique_indices=True, mode="promise_in_bounds"
        )
        num_valid = self.num_valid + jnp.sum(valid, dtype=jnp.int32)
        num_valid = num_valid - jnp.sum(before, dtype=jnp.int32)
        return PrioritisedEpisodic(
            episodes=episodes,
            valid=new_valid,
            num_valid=num_valid,
            tree=tree,
            max_priority=self.max_priority,
            alpha=self.alpha,
        )

    def added(
        self, storage: RingStorage, appended: Appended, window: Window
    ) -> "PrioritisedEpisodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        overwritten = jnp.arange(m) >= m - appended.keep
        return self._rated(storage, episodes, offsets, overwritten, window)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "PrioritisedEpisodic":
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        # Restored: every slot counts as overwritten, so no old priority is kept.
        overwritten = jnp.full(storage.length, restored, jnp.bool_)
        episodes = self.episodes.recomputed(storage)
        return self._rated(storage, episodes, offsets, overwritten, window)

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        return self.episodes.mask(storage, indices, window)

    def draw(
        self,
        storage: RingStorage,
        window: Window,
        key: PRNGKeyArray,
        batch_size: int,
        beta: Float[Array, ""],
        ready: BoolScalar,
        not_ready: str,
        where: str,
        blocks: int = 1,
    ) -> Drawn:
        no_window = self.episodes.no_window_message(where, window)
        return draw_by_priority(
            storage,
            self.tree,
            key,
            batch_size,
            beta,
            ready,
            self.num_valid == 0,
            _priority_messages(where, not_ready, no_window, blocks),
            blocks,
        )

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return self.num_valid

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return self.valid

    def current(
        self, storage: RingStorage, window: Window, indices: Indices, steps: Steps
    ) -> Bool[Array, " batch"]:
        valid = self.valid.reshape(-1).at[indices].get(mode="fill", fill_value=False)
        return valid & (start_steps(storage, window_offsets(storage, indices)) == steps)

    def with_priorities(
        self, tree: SumTree, max_priority: Float[Array, ""]
    ) -> "PrioritisedEpisodic":
        return eqx.tree_at(lambda r: (r.tree, r.max_priority), self, (tree, max_priority))


def prioritised(where: str, storage: RingStorage, alpha: Any) -> Prioritised:
    """A new `Prioritised` rule for `storage` (`alpha` checked)."""
    alpha = check_alpha(where, alpha)
    tree = SumTree(storage.rows * storage.length)
    return Prioritised(tree=tree, max_priority=jnp.array(1.0, jnp.float32), alpha=alpha)


def prioritised_episodic(
    where: str, storage: RingStorage, episode_end: Any, mode: Any, alpha: Any
) -> PrioritisedEpisodic:
    """A new `PrioritisedEpisodic` rule for `storage` (arguments checked)."""
    alpha = check_alpha(where, alpha)
    episodes = new_episode_ends(where, storage, episode_end, mode)
    shape = (storage.rows, storage.length)
    return PrioritisedEpisodic(
        episodes=episodes,
        valid=jnp.zeros(shape, jnp.bool_),
        num_valid=jnp.array(0, jnp.int32),
        tree=SumTree(storage.rows * storage.length),
        max_priority=jnp.array(1.0, jnp.float32),
        alpha=alpha,
    )


def _priority_messages(
    where: str, not_ready: str, no_window: str, blocks: int = 1
) -> tuple[str, str, str, str]:
    which = (
        "every valid window has priority 0"
        if blocks == 1
        else f"in the rows of one of the row_blocks={blocks} blocks, every valid window has "
        "priority 0 (or none is valid)"
    )
    return (
        not_ready,
        f"{where}: {which}, so there is nothing to draw "
        "(`can_sample()` only looks at the counters). Give some windows a positive "
        "priority with `set_priorities`, or add data (new windows enter at the largest "
        "priority seen).",
        no_window,
        f"{where}: `beta` must be finite and >= 0.",
    )
