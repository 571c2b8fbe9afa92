"""The interface every sampling rule implements (`AbstractRule`), the uniform and the
prioritised kinds of rule, and the pieces of a rule whose windows are valid by the counters
alone."""

import abc
from typing import Any, TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._custom_types import Indices, IntScalar
from .._ring import Appended, RingStorage
from ._request import Drawn, Request, Update, Window
from ._valid import count_held, held_starts


_Rule = TypeVar("_Rule", bound="AbstractRule")


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


class ByTheCounters:
    """The methods of a rule whose windows are valid by the counters alone (held, complete,
    on the period): no episodes, every valid window a candidate."""

    def mask(self, storage: RingStorage, indices: Indices, window: Window) -> None:
        return None

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return count_held(storage, window)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return held_starts(storage, window)


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
    """A rule that draws its valid windows by priority, with probabilities and importance
    weights, and owns its priorities: the rule of an [`equibuffer.PrioritisedBuffer`][]. What
    it must say besides an [`equibuffer.rules.AbstractRule`][]'s:

    - `draw`: `request.batch_size` windows by priority, with their probabilities and
        importance weights of exponent `request.beta`;
    - `reprioritised`: the rule after `set_priorities` (the new priorities checked, the
        updates of windows no longer held dropped, the largest priority kept);
    - `max_priority`, the largest priority set so far, at which new windows enter, and
        `alpha`, the priority exponent.

    The buffer knows nothing else of how the priorities are kept: the proportional rules
    ([`equibuffer.rules.Prioritised`][], [`equibuffer.rules.PrioritisedEpisodic`][]) keep a
    [`equibuffer.SumTree`][] of `priority ** alpha`, the rank-based one
    ([`equibuffer.rules.RankPrioritised`][]) the priorities themselves.

    !!! example

        ```python
        import equibuffer as eb

        assert isinstance(eb.rules.Prioritised(alpha=0.6), eb.rules.AbstractPrioritisedRule)
        assert isinstance(eb.rules.PrioritisedEpisodic(), eb.rules.AbstractPrioritisedRule)
        assert isinstance(eb.rules.RankPrioritised(), eb.rules.AbstractPrioritisedRule)
        ```
    """

    max_priority: eqx.AbstractVar[Float[Array, ""]]
    alpha: eqx.AbstractVar[float]

    @abc.abstractmethod
    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        """Draw `request.batch_size` valid windows by priority, with probabilities and
        importance weights of exponent `request.beta`; with `blocks > 1`, by block of rows
        as the uniform rules do."""

    @abc.abstractmethod
    def reprioritised(self: _Rule, storage: RingStorage, window: Window, update: Update) -> _Rule:
        """The rule with the priorities of an [`equibuffer.rules.Update`][] applied: every
        priority checked (non-negative and finite, indices in range; inside jit a failure is
        recorded and the whole update refused, as it is when `update.failed`), the updates
        of windows that no longer start at `update.steps` or are no longer valid dropped,
        the last of repeated updates winning, and `max_priority` raised to the largest
        priority applied. The buffer's `set_priorities` is this one call."""
