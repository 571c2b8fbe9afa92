"""The proportional prioritised rule (Schaul et al., 2016): the windows valid by the
counters, drawn in proportion to `priority ** alpha` from a sum tree."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._custom_types import Indices, Steps
from .._ring import Appended, RingStorage
from .._sumtree import SumTree
from ._base import AbstractPrioritisedRule, ByTheCounters, unless
from ._by_priority import check_alpha, draw_by_priority, reprioritised_tree
from ._request import Drawn, Request, Update, Window
from ._valid import (
    changed_offsets,
    flat_indices,
    lookback_offsets,
    offset_slots,
    still_held,
    window_offsets,
    windows_held,
)


class Prioritised(ByTheCounters, AbstractPrioritisedRule):
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
        rule = Prioritised(check_alpha(where, self.alpha))
        return eqx.tree_at(lambda r: r.tree, rule, SumTree(storage.rows * storage.length))

    def row_leaves(self) -> tuple[Array, ...]:
        return ()

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Prioritised":
        # Every window among the changed starts was incomplete or not held before the add
        # (the counters' rule), so a valid one is new and enters at the largest priority.
        rows, length = storage.rows, storage.length
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        slots = (storage.head - m + jnp.arange(m, dtype=jnp.int32)) % length  # (m <= length)
        # With frames, also the starts after the newest step, which an add may have made
        # invalid (their frames written over) but never valid anew: kept, or 0.
        front = lookback_offsets(storage, offsets)
        if front.shape[0]:
            offsets = jnp.concatenate([offsets, front])
            after = (storage.head + jnp.arange(front.shape[0], dtype=jnp.int32)) % length
            slots = jnp.concatenate([slots, after])  # (each slot once)
        valid = windows_held(storage, offsets, window.length, window.period)
        fresh = self.max_priority**self.alpha
        indices = flat_indices(rows, length, slots)
        if offsets.shape[0] == m:
            values = jnp.broadcast_to(jnp.where(valid, fresh, 0.0), (rows, m)).reshape(-1)
        else:
            kept = self.tree.read(indices).reshape(rows, -1)
            new = jnp.arange(offsets.shape[0]) < m
            values = jnp.where(valid, jnp.where(new, fresh, kept), 0.0).reshape(-1)
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

    def reprioritised(self, storage: RingStorage, window: Window, update: Update) -> "Prioritised":
        def current(indices: Indices, steps: Steps) -> Bool[Array, " batch"]:
            # Still the window drawn, and still valid by the counters.
            held = windows_held(storage, window_offsets(storage, indices), *window[:2])
            return still_held(storage, indices, steps) & held

        return reprioritised_tree(self, update, current)


def prioritised(where: str, alpha: Any) -> Prioritised:
    """A new `Prioritised` rule of checked `alpha` (errors start with `where`)."""
    return Prioritised(check_alpha(where, alpha))
