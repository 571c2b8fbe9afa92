"""Sampling rules: which windows may be drawn, with what probability, and the state that takes.

Public as `equibuffer.rules`. A rule is an `eqx.Module` built from its configuration alone
(`Episodic(episode_end="done")`); a buffer sizes it to its ring (`sized`: the arrays it keeps
beside the ring, allocated, and the configuration checked against the example). The buffer
then calls it on every add (`added`, with what the ring's write reports), after `update`
(`updated`) and after its ring was replaced (`updated(..., restored=True)`: `with_storage`,
`Archive.restore`, `Archive.load`), and asks it to `draw`.
The window itself (layout, validity by the counters, start steps) is the rule of
`_windows.py`, used by every rule here; the pieces two rules share are components:

- `EpisodeEnds` (`_episode_ends.py`): the episode-end flag of every slot, and the episode rule
    on top of the counters' (`never_cross`: no end before a window's last step; `pad`: cut
    at the end).
- `_priorities.py` (`draw_by_priority`, `set_by_priority`): a `SumTree` of `p ** alpha` and
    the largest priority seen, importance weights, stale updates dropped.

| rule | validity | drawn |
|---|---|---|
| `Uniform` | counters | uniformly, from the counters alone (no tree) |
| `Prioritised` | counters | in proportion to `p ** alpha` |
| `Episodic` | counters + episode rule | exactly uniformly (a tree of 0/1 leaves) |
| `PrioritisedEpisodic` | counters + episode rule | in proportion to `p ** alpha` |
"""

import abc
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._custom_types import Indices, IntScalar, Steps
from .._errors import branched_error_if, error_if
from .._ring import Appended, RingStorage
from .._sumtree import SumTree
from .._barriers import read_once
from .._windows import (
    changed_offsets,
    flat_indices,
    offset_slots,
    start_steps,
    uniform_windows,
    window_layout,
    window_offsets,
    windows_held,
)
from ._episode_ends import (
    check_episode_end,
    check_mode,
    EpisodeEnd,
    EpisodeEnds,
    Mode,
    new_episode_ends,
)
from ._priorities import check_alpha, draw_by_priority
from ._window import Drawn, Request, Window


_Rule = TypeVar("_Rule", bound="AbstractRule")


# ---------------------------------------------------------------------------------- rules


class AbstractRule(eqx.Module):
    """A sampling rule: which windows of a buffer's ring may be drawn, and the state that
    takes (arrays kept beside the ring, in step with it through `added` and `updated`).

    A rule is built from its configuration alone and given to a buffer
    ([`equibuffer.Buffer`][], [`equibuffer.PrioritisedBuffer`][]), which sizes it to its ring
    with `sized`. What a rule must say, so that no other part needs to know it:

    - `sized`: its state for an empty ring (its configuration checked against the example);
    - `added`, `updated`: its state after an add, after `update`, and rebuilt from a ring
        that was replaced (`restored=True`: `with_storage`, `Archive.restore`/`load`);
    - `mask`, `count_valid`, `valid_starts`: episode masks, what `num_valid_windows` and an
        epoch see;
    - `row_leaves`: its arrays with one entry per row, which `shard_rows` splits with the
        rows;
    - `draw` (in [`equibuffer.rules.AbstractUniformRule`][] and
        [`equibuffer.rules.AbstractPrioritisedRule`][]).

    Every method takes the ring (a [`equibuffer.RingStorage`][]) and the
    [`equibuffer.rules.Window`][] the buffer's view spans; the window layout itself (which
    windows the counters allow) is shared by every rule.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        rule = eb.rules.Episodic(episode_end="done")  # configuration only
        buffer = eb.Buffer({"done": jnp.bool_(False)}, add_batch_size=1, capacity=8,
                           rule=rule, view=eb.views.WindowView(2))
        assert isinstance(buffer.rule, eb.rules.AbstractRule)
        assert buffer.rule.episodes.ends.shape == (1, 8)  # sized to the ring
        ```
    """

    @abc.abstractmethod
    def sized(self: _Rule, where: str, storage: RingStorage) -> _Rule:
        """This rule with its state allocated for `storage`, a ring with nothing added, and
        its configuration checked against the ring's example (errors start with `where`)."""

    @abc.abstractmethod
    def row_leaves(self) -> tuple[Array, ...]:
        """The arrays of the rule with one entry per row of the ring (leading axis `rows`):
        [`equibuffer.shard_rows`][] splits them over the devices with the rows, and
        replicates every other array of the rule (sum trees, counters)."""

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

    def reference(self, window: Window) -> Any:
        """This rule's NumPy model, for [`equibuffer.testing.BufferReference`][]: which
        windows are valid after any sequence of adds (a model of
        `equibuffer.testing`'s `UniformRule` or `EpisodeRule` kind: `valid(history)`,
        `windows_of(history)`, ...). A rule of your own that returns one gets the reference
        model's checks; by default there is none, and `BufferReference.from_buffer` refuses
        the buffer, saying so."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no reference model: give it a "
            "`reference(window)` method returning one (see equibuffer.testing's "
            "UniformRule and EpisodeRule)."
        )


def unless(refused: Bool[ArrayLike, ""], values: Array) -> Bool[Array, " m"] | None:
    """The mask of a rule's tree write after an add that a check may have `refused`: no
    entry written where it did (`None`, no mask, for an add that cannot be refused)."""
    if refused is False:
        return None
    return jnp.broadcast_to(~jnp.asarray(refused), values.shape)


def count_held(storage: RingStorage, window: Window) -> IntScalar:
    """The number of windows valid by the counters, over all rows."""
    return window_layout(storage, window.length, window.period)[1] * storage.rows


def held_starts(storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
    """Whether the window starting at each slot is valid by the counters, in every row."""
    offsets = window_offsets(storage, jnp.arange(storage.length, dtype=jnp.int32))
    held = windows_held(storage, offsets, window.length, window.period)
    return jnp.broadcast_to(held, (storage.rows, storage.length))


def uniform_model(window: Window) -> Any:
    """The reference model of the windows valid by the counters alone."""
    from ..testing._models import UniformRule

    return UniformRule(window.length, window.period)


def episode_model(episodes: EpisodeEnds, window: Window) -> Any:
    """The reference model of the windows valid by the counters and the episode rule."""
    from ..testing._models import EpisodeRule

    return EpisodeRule(window.length, window.period, episodes.mode, episodes.episode_end)


class _ByTheCounters:
    """The methods of a rule whose windows are valid by the counters alone (held, complete,
    on the period): no episodes, every valid window a candidate."""

    def mask(self, storage: RingStorage, indices: Indices, window: Window) -> None:
        return None

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return count_held(storage, window)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return held_starts(storage, window)

    def reference(self, window: Window) -> Any:
        return uniform_model(window)


class AbstractUniformRule(AbstractRule):
    """A rule that draws its valid windows uniformly: the rule of an
    [`equibuffer.Buffer`][].

    !!! example

        ```python
        import equibuffer as eb

        assert isinstance(eb.rules.Uniform(), eb.rules.AbstractUniformRule)
        assert isinstance(eb.rules.Episodic(), eb.rules.AbstractUniformRule)
        ```
    """

    @abc.abstractmethod
    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        """Draw `request.batch_size` valid windows uniformly, with replacement, as the
        [`equibuffer.rules.Request`][] says (its `beta` is None); with `blocks > 1`, the
        `b`-th `batch_size / blocks` windows uniformly among those of the `b`-th block."""


class AbstractPrioritisedRule(AbstractRule):
    """A rule that draws its valid windows in proportion to `priority ** alpha`, from a
    [`equibuffer.SumTree`][] with one leaf per window start: the rule of an
    [`equibuffer.PrioritisedBuffer`][].

    !!! example

        ```python
        import equibuffer as eb

        assert isinstance(eb.rules.Prioritised(alpha=0.6), eb.rules.AbstractPrioritisedRule)
        assert isinstance(eb.rules.PrioritisedEpisodic(), eb.rules.AbstractPrioritisedRule)
        ```
    """

    tree: eqx.AbstractVar[SumTree]
    max_priority: eqx.AbstractVar[Float[Array, ""]]
    alpha: eqx.AbstractVar[float]

    @abc.abstractmethod
    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        """Draw `request.batch_size` valid windows by priority, with probabilities and
        importance weights of exponent `request.beta`; with `blocks > 1`, by block of rows
        as the uniform rules do (see `draw_by_priority`)."""

    @abc.abstractmethod
    def current(
        self, storage: RingStorage, window: Window, indices: Indices, steps: Steps
    ) -> Bool[Array, " batch"]:
        """Whether each window is still the one sampled at `steps` and valid now."""

    @abc.abstractmethod
    def with_priorities(self, tree: SumTree, max_priority: Float[Array, ""]) -> Any:
        """The rule with a new tree and largest priority."""


class Uniform(_ByTheCounters, AbstractUniformRule):
    """Uniform over the windows valid by the counters (held, complete, on the period): no
    state at all, so it costs nothing at `add`. The rule of `TrajectoryBuffer`,
    `TransitionBuffer` and `ItemBuffer`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"t": jnp.int32(0)}, add_batch_size=1, capacity=8,
                           rule=eb.rules.Uniform(), view=eb.views.WindowView(3))
        buffer = buffer.add({"t": jnp.arange(5, dtype=jnp.int32)[None]})
        assert int(buffer.num_valid_windows()) == 3  # starts 0, 1 and 2
        ```
    """

    def sized(self, where: str, storage: RingStorage) -> "Uniform":
        return self

    def row_leaves(self) -> tuple[Array, ...]:
        return ()

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Uniform":
        return self

    def updated(self, storage: RingStorage, window: Window, *, restored: bool = False) -> "Uniform":
        return self

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        key, batch_size, ready, not_ready, _, blocks, _ = request
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
    `SumTree` with a leaf of 1 at each valid window start and 0 elsewhere. The rule of
    `EpisodeTrajectoryBuffer` (and of `TransitionBuffer(episode_end=...)`).

    `episode_end` marks the last step of an episode: the name of a 0-d bool leaf of a dict
    example, or a function of one step returning a 0-d bool. `mode="never_cross"`: a window
    has no end before its last step; `"pad"`: a window may be cut by an end, and what lies
    past it comes back zero, with `sample.mask` false there.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"done": jnp.bool_(False)}, add_batch_size=1, capacity=16,
                           rule=eb.rules.Episodic(episode_end="done"),
                           view=eb.views.WindowView(3))
        buffer = buffer.add({"done": jnp.array([[False, True, False, False, False]])})
        assert int(buffer.num_valid_windows()) == 1  # steps 2-4: the only one in an episode
        ```
    """

    episodes: EpisodeEnds
    tree: SumTree

    def __init__(self, episode_end: EpisodeEnd = "done", mode: Mode = "never_cross"):
        """**Arguments:**

        - `episode_end`: the name of a 0-d bool leaf (default `"done"`), or a function
            `step -> 0-d bool`; checked against the example when a buffer sizes the rule.
        - `mode`: `"never_cross"` (default) or `"pad"`.

        The rule holds empty arrays until a buffer sizes it to its ring (`sized`).
        """
        self.episodes = EpisodeEnds(jnp.zeros((0, 0), jnp.bool_), episode_end, mode)
        self.tree = SumTree(1)

    def sized(self, where: str, storage: RingStorage) -> "Episodic":
        if storage.rows * storage.length > MAX_COUNTED:
            raise ValueError(
                f"{where}: the buffer holds {storage.rows * storage.length} steps in total, "
                f"more than {MAX_COUNTED} (2**24), the largest count of windows drawn exactly "
                "uniformly (the valid windows are counted in float32). Lower `capacity` (or "
                "`max_length_time_axis`)."
            )
        e = self.episodes
        episodes = new_episode_ends(where, storage, e.episode_end, e.mode)
        tree = SumTree(storage.rows * storage.length)
        return eqx.tree_at(lambda r: (r.episodes, r.tree), self, (episodes, tree))

    def row_leaves(self) -> tuple[Array, ...]:
        return (self.episodes.ends,)

    def _rated(
        self,
        storage: RingStorage,
        episodes: EpisodeEnds,
        offsets: Int[Array, " m"],
        window: Window,
        refused: Bool[ArrayLike, ""] = False,
    ) -> "Episodic":
        valid, slots = episodes.validity(storage, offsets, window)
        indices = flat_indices(storage.rows, storage.length, slots)  # (each slot named once)
        values = valid.reshape(-1).astype(jnp.float32)
        tree = self.tree.write(indices, values, mask=unless(refused, values), unique_indices=True)
        return eqx.tree_at(lambda r: (r.episodes, r.tree), self, (episodes, tree))

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Episodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        return self._rated(storage, episodes, offsets, window, appended.refused)

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

    def reference(self, window: Window) -> Any:
        return episode_model(self.episodes, window)

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        key, batch_size, ready, not_ready, where, blocks, _ = request
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
    """A new `Episodic` rule sized for `storage` (arguments checked, errors start with
    `where`)."""
    episode_end = check_episode_end(where, storage.example(), episode_end)
    return Episodic(episode_end, check_mode(where, mode)).sized(where, storage)


class Prioritised(_ByTheCounters, AbstractPrioritisedRule):
    """In proportion to `priority ** alpha` over the windows valid by the counters: a
    `SumTree` with one leaf per window start (`row * length + slot`), holding `p ** alpha`
    while the window is valid and 0 otherwise. New windows enter at the largest priority
    set so far; so does every valid window of a restored ring (`updated(restored=True)`).
    The rule of the `Prioritised*` buffers without episodes.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8,
                                      rule=eb.rules.Prioritised(alpha=1.0),
                                      view=eb.views.ItemView())
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert jnp.allclose(sample.probabilities, 0.25)  # every item at priority 1
        ```
    """

    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(self, alpha: float = 0.6):
        """**Arguments:**

        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over the windows of positive
            priority, 1 fully proportional. Default 0.6 (Schaul et al.).

        The rule holds an empty tree until a buffer sizes it to its ring (`sized`).
        """
        self.tree = SumTree(1)
        self.max_priority = jnp.array(1.0, jnp.float32)
        self.alpha = alpha

    def sized(self, where: str, storage: RingStorage) -> "Prioritised":
        return Prioritised(check_alpha(where, self.alpha)).with_priorities(
            SumTree(storage.rows * storage.length), jnp.array(1.0, jnp.float32)
        )

    def row_leaves(self) -> tuple[Array, ...]:
        return ()

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Prioritised":
        # Every window among the changed starts was incomplete or not held before the add
        # (the counters' rule), so a valid one is new and enters at the largest priority.
        rows, length = storage.rows, storage.length
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        valid = windows_held(storage, offsets, window.length, window.period)
        fresh = self.max_priority**self.alpha
        values = jnp.broadcast_to(jnp.where(valid, fresh, 0.0), (rows, m)).reshape(-1)
        slots = (storage.head - m + jnp.arange(m, dtype=jnp.int32)) % length  # (m <= length)
        indices = flat_indices(rows, length, slots)
        mask = unless(appended.refused, values)
        tree = self.tree.write(indices, values, mask=mask, unique_indices=True)
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

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        no_window = f"{request.where}: no valid window."
        return draw_by_priority(storage, self.tree, request, jnp.array(False), no_window)

    def current(
        self, storage: RingStorage, window: Window, indices: Indices, steps: Steps
    ) -> Bool[Array, " batch"]:
        offset = window_offsets(storage, indices)
        valid = (offset < storage.fill) & windows_held(
            storage, offset, window.length, window.period
        )
        return valid & (start_steps(storage, offset) == steps)

    def with_priorities(self, tree: SumTree, max_priority: Float[Array, ""]) -> "Prioritised":
        return eqx.tree_at(lambda r: (r.tree, r.max_priority), self, (tree, max_priority))


class PrioritisedEpisodic(AbstractPrioritisedRule):
    """In proportion to `priority ** alpha` over the windows valid by the counters and the
    episode rule. A window enters at the largest priority set so far when it becomes valid,
    keeps its priority while it stays valid (in `pad` mode a window cut by an end is valid
    before the steps after the end arrive), and gets 0 when it stops being valid. The rule
    of `PrioritisedEpisodeTrajectoryBuffer` (and of
    `PrioritisedTransitionBuffer(episode_end=...)`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        rule = eb.rules.PrioritisedEpisodic(episode_end="done", alpha=1.0)
        buffer = eb.PrioritisedBuffer({"done": jnp.bool_(False)}, add_batch_size=1,
                                      capacity=16, rule=rule, view=eb.views.PairView())
        buffer = buffer.add({"done": jnp.array([[False, True, False, False]])})
        assert int(buffer.num_valid_windows()) == 2  # pairs 0-1 and 2-3; 1-2 crosses an end
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert jnp.allclose(sample.probabilities, 0.5)
        ```
    """

    episodes: EpisodeEnds
    valid: Bool[Array, "rows length"]
    num_valid: Int[Array, ""]
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(
        self, episode_end: EpisodeEnd = "done", mode: Mode = "never_cross", alpha: float = 0.6
    ):
        """**Arguments:**

        - `episode_end`, `mode`: as for [`equibuffer.rules.Episodic`][].
        - `alpha`: as for [`equibuffer.rules.Prioritised`][] (default 0.6).

        The rule holds empty arrays until a buffer sizes it to its ring (`sized`).
        """
        self.episodes = EpisodeEnds(jnp.zeros((0, 0), jnp.bool_), episode_end, mode)
        self.valid = jnp.zeros((0, 0), jnp.bool_)
        self.num_valid = jnp.array(0, jnp.int32)
        self.tree = SumTree(1)
        self.max_priority = jnp.array(1.0, jnp.float32)
        self.alpha = alpha

    def sized(self, where: str, storage: RingStorage) -> "PrioritisedEpisodic":
        e = self.episodes
        rule = PrioritisedEpisodic(e.episode_end, e.mode, check_alpha(where, self.alpha))
        episodes = new_episode_ends(where, storage, e.episode_end, e.mode)
        valid = jnp.zeros((storage.rows, storage.length), jnp.bool_)
        tree = SumTree(storage.rows * storage.length)
        return eqx.tree_at(lambda r: (r.episodes, r.valid, r.tree), rule, (episodes, valid, tree))

    def row_leaves(self) -> tuple[Array, ...]:
        return (self.episodes.ends, self.valid)

    def _rated(
        self,
        storage: RingStorage,
        episodes: EpisodeEnds,
        offsets: Int[Array, " m"],
        overwritten: Bool[Array, " m"],
        window: Window,
        refused: Bool[ArrayLike, ""] = False,
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
        leaves = jnp.where(valid, jnp.where(kept, old, fresh), 0.0).reshape(-1)
        tree = self.tree.write(indices, leaves, mask=unless(refused, leaves), unique_indices=True)
        # The flags written only after `before` is read: else XLA copies them to keep
        # `before`, which nothing makes it read first (see `read_once`).
        before, valid = read_once(before, valid)
        if refused is not False:  # (a refused add: every flag and count as it was)
            valid = jnp.where(refused, before, valid)
        new_valid = self.valid.at[:, slots].set(
            valid, unique_indices=True, mode="promise_in_bounds"
        )
        num_valid = self.num_valid + jnp.sum(valid, dtype=jnp.int32)
        num_valid = num_valid - jnp.sum(before, dtype=jnp.int32)
        return eqx.tree_at(
            lambda r: (r.episodes, r.valid, r.num_valid, r.tree),
            self,
            (episodes, new_valid, num_valid, tree),
        )

    def added(
        self, storage: RingStorage, appended: Appended, window: Window
    ) -> "PrioritisedEpisodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        overwritten = jnp.arange(m) >= m - appended.keep
        return self._rated(storage, episodes, offsets, overwritten, window, appended.refused)

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

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        no_window = self.episodes.no_window_message(request.where, window)
        return draw_by_priority(storage, self.tree, request, self.num_valid == 0, no_window)

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return self.num_valid

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return self.valid

    def reference(self, window: Window) -> Any:
        return episode_model(self.episodes, window)

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
    """A new `Prioritised` rule sized for `storage` (`alpha` checked)."""
    return Prioritised(check_alpha(where, alpha)).sized(where, storage)


def prioritised_episodic(
    where: str, storage: RingStorage, episode_end: Any, mode: Any, alpha: Any
) -> PrioritisedEpisodic:
    """A new `PrioritisedEpisodic` rule sized for `storage` (arguments checked)."""
    alpha = check_alpha(where, alpha)
    episode_end = check_episode_end(where, storage.example(), episode_end)
    rule = PrioritisedEpisodic(episode_end, check_mode(where, mode), alpha)
    return rule.sized(where, storage)
