"""The rank-based prioritised rule (Schaul et al., 2016, the second variant): a window's
probability follows its rank among the valid windows by priority, `rank ** -alpha`, not
the priority itself, which makes it robust to outliers of the priorities' scale.

It keeps the priorities themselves (one per window start), not a sum tree, and shows that a
rule with another priority structure plugs into `eb.PrioritisedBuffer` without touching the
buffer: it implements `draw` and `reprioritised`, and nothing else of a buffer changes."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._custom_types import Indices
from .._ring import Appended, RingStorage
from ._base import AbstractPrioritisedRule, ByTheCounters, unless
from ._by_priority import (
    check_alpha,
    check_draw,
    check_priority_update,
    importance_weights,
    priority_messages,
)
from ._request import Drawn, Request, Update, Window
from ._valid import (
    changed_offsets,
    flat_indices,
    held_starts,
    offset_slots,
    start_steps,
    still_held,
    window_offsets,
    windows_held,
)


class RankPrioritised(ByTheCounters, AbstractPrioritisedRule):
    """Rank-based prioritised replay over the windows valid by the counters: the valid
    windows ranked by priority, largest first (ties by index), and the window of rank `r`
    (from 1) drawn with probability `P = r**-alpha / sum_{k <= n} k**-alpha`, `n` the
    number of valid windows. New windows enter at the largest priority set so far (so at
    the top ranks); importance weights are `(n P) ** -beta` over their largest in the batch.

    Stratified as Schaul et al. describe: the `batch_size` draws come one from each of
    `batch_size` segments of equal probability mass over the ranks. The ranks are sorted at
    every `draw` (`O(N log N)` for `N = add_batch_size * max_length_time_axis` window
    starts), `add` and `set_priorities` write only the entries they name.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8,
                                      rule=eb.rules.RankPrioritised(alpha=1.0),
                                      view=eb.views.ItemView())
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        slots = jnp.arange(4)  # item x in slot x, added at step x
        buffer = buffer.set_priorities(slots, jnp.array([0.1, 9.0, 5.0, 0.2]),
                                       steps=slots.astype(jnp.uint32))
        sample = buffer.sample(jax.random.key(0), batch_size=100)
        # ranks 1 to 4 (items 1, 2, 3, 0) drawn with probabilities 1, 1/2, 1/3, 1/4 over 25/12
        p = {1: 12 / 25, 2: 6 / 25, 3: 4 / 25, 0: 3 / 25}
        x = sample.experience["x"].astype(jnp.int32).tolist()
        assert jnp.allclose(sample.probabilities, jnp.array([p[i] for i in x]))
        ```
    """

    priorities: Float[Array, " windows"]
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(self, alpha: float = 0.7):
        """**Arguments:**

        - `alpha`: the rank exponent, `>= 0`: 0 is uniform over the valid windows, larger
            values favour the top ranks more. Default 0.7 (Schaul et al.'s rank-based
            setting, with `beta` annealed from 0.5).

        The rule holds an empty array until a buffer sizes it to its ring (`sized`).
        """
        self.priorities = jnp.zeros(0, jnp.float32)
        self.max_priority = jnp.array(1.0, jnp.float32)
        self.alpha = alpha

    def sized(self, where: str, storage: RingStorage) -> "RankPrioritised":
        rule = RankPrioritised(check_alpha(where, self.alpha))
        priorities = jnp.zeros(storage.rows * storage.length, jnp.float32)
        return eqx.tree_at(lambda r: r.priorities, rule, priorities)

    def row_leaves(self) -> tuple[Array, ...]:
        return ()

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "RankPrioritised":
        # The window starts an add may have made valid (as for `Prioritised`) enter at the
        # largest priority; validity itself is the counters', read at every draw.
        offsets = changed_offsets(storage, appended.keep, window.length)
        slots = offset_slots(storage, offsets)
        indices = flat_indices(storage.rows, storage.length, slots)
        values = jnp.broadcast_to(self.max_priority, indices.shape)
        mask = unless(appended.refused, values)
        if mask is not None:  # (a refused add: every priority as it was)
            values = jnp.where(mask, values, self.priorities[indices])
        priorities = self.priorities.at[indices].set(values, unique_indices=True)
        return eqx.tree_at(lambda r: r.priorities, self, priorities)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "RankPrioritised":
        if not restored:  # `update` keeps the counters: every window keeps its priority
            return self
        priorities = jnp.full_like(self.priorities, self.max_priority)
        return eqx.tree_at(lambda r: r.priorities, self, priorities)

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        key, batch_size, ready, not_ready, where, blocks, beta = request
        assert beta is not None, "a prioritised draw needs `beta`"
        per = batch_size // blocks
        valid = held_starts(storage, window).reshape(blocks, -1)
        priorities = self.priorities.reshape(blocks, -1)
        keys = jax.random.split(key, blocks)
        local, probabilities, count = jax.vmap(_draw_by_rank, (0, 0, 0, None, None))(
            valid, priorities, keys, per, self.alpha
        )
        width = valid.shape[1]
        indices = (local + (jnp.arange(blocks, dtype=jnp.int32) * width)[:, None]).reshape(-1)
        failure = jnp.where(~ready, 0, jnp.where(jnp.min(count) == 0, 2, 3))
        no_window = f"{where}: no valid window."
        messages = priority_messages(where, not_ready, no_window, blocks)
        indices = check_draw(indices, failure, beta, where, messages)
        weights = importance_weights(probabilities, beta).reshape(-1)
        steps = start_steps(storage, window_offsets(storage, indices))
        return Drawn(indices, steps, probabilities.reshape(-1), weights)

    def reprioritised(
        self, storage: RingStorage, window: Window, update: Update
    ) -> "RankPrioritised":
        indices, steps, new, accepted = check_priority_update(update, self.priorities.shape[0])
        held = windows_held(storage, window_offsets(storage, indices), *window[:2])
        applied = still_held(storage, indices, steps) & held & accepted
        # The last applied update of a repeated window wins, on every platform: each entry
        # marks its position by a scatter-max (whose result does not depend on the order),
        # and only the entry that reads its own mark back writes.
        position = jnp.arange(indices.shape[0], dtype=jnp.int32)
        marks = jnp.full(self.priorities.shape, -1, jnp.int32)
        marks = marks.at[indices].max(jnp.where(applied, position, -1), mode="drop")
        last = applied & (marks.at[indices].get(mode="fill", fill_value=-1) == position)
        target = jnp.where(last, indices, self.priorities.shape[0])
        priorities = self.priorities.at[target].set(new, mode="drop", unique_indices=True)
        top = jnp.maximum(self.max_priority, jnp.max(jnp.where(applied, new, 0.0)))
        return eqx.tree_at(lambda r: (r.priorities, r.max_priority), self, (priorities, top))


def _draw_by_rank(
    valid: Bool[Array, " n"],
    priorities: Float[Array, " n"],
    key: Any,
    batch_size: int,
    alpha: float,
) -> tuple[Indices, Float[Array, " batch"], Int[Array, ""]]:
    """`batch_size` of the `valid` entries drawn by the rank of their priority (largest
    first, ties by index), stratified over the mass `sum_{k <= count} k**-alpha`: their
    indices, probabilities and the number of valid entries."""
    count = jnp.sum(valid, dtype=jnp.int32)
    # Valid entries first, largest priority first; a stable sort keeps ties by index.
    order = jnp.argsort(jnp.where(valid, -priorities, jnp.inf), stable=True).astype(jnp.int32)
    rank = jnp.arange(1, valid.shape[0] + 1, dtype=jnp.float32)
    mass = jnp.where(rank <= count.astype(jnp.float32), rank**-alpha, 0.0)
    running = jnp.cumsum(mass)
    total = running[-1]
    u = jnp.arange(batch_size, dtype=jnp.float32) + jax.random.uniform(
        key, (batch_size,), jnp.float32
    )
    position = jnp.searchsorted(running, u / batch_size * total, side="right")
    position = jnp.minimum(position, jnp.maximum(count - 1, 0)).astype(jnp.int32)
    probabilities = mass[position] / jnp.where(total > 0, total, 1.0)
    return order[position], probabilities, count
