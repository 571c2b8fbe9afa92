"""Size arguments, resolved in one place for every buffer.

Every size has one spelling per unit, accepted by every buffer:

- steps held in total: `capacity` (Flashbax's `max_size`; on flat and item buffers also
    Flashbax's `max_length`); steps held per row: `max_length_time_axis`;
- steps before sampling, in total: `min_size` (on flat and item buffers also Flashbax's
    `min_length`); per row: `min_length_time_axis`.

A total that `add_batch_size` does not divide is rounded *up* to whole rows, so a buffer never
holds less than asked for. On trajectory-shaped buffers Flashbax has no `max_length` /
`min_length` (its names there are the `_time_axis` ones and `max_size`), so those spellings are
refused with an error naming what to pass.
"""

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, TypedDict

from .._checks import check_fits, check_positive_int, FLASHBAX_ONLY, flashbax_only_error
from .._custom_types import ExampleTree
from .._frames import Frames
from .._ring import RingStorage, stored_steps


def _one_of(
    where: str,
    flat: bool,
    totals: dict[str, int | None],
    alias: tuple[str, int | None],
    per_row: tuple[str, int | None],
) -> tuple[str, tuple[str, int] | None]:
    """At most one of a size's spellings: in total (`totals`, and Flashbax's `alias` on a
    flat buffer, refused on the others with what to pass) or `per_row`. Returns the
    spellings in total as errors name them, and the one given with its value checked (None
    if none was)."""
    (alias_name, alias_value), (row_name, row_value) = alias, per_row
    first = next(iter(totals))
    if not flat and alias_value is not None:
        raise TypeError(
            f"{where}: `{alias_name}` is not taken here: it is Flashbax's name for a flat or "
            f"item buffer's total, and trajectory buffers count per row. Pass `{row_name}=` "
            f"(steps per row) or `{first}=` (steps in total)."
        )
    aliases = [*list(totals)[1:], *([alias_name] if flat else [])]
    named = f"`{first}`" + (f" (alias {', '.join(f'`{n}`' for n in aliases)})" if aliases else "")
    given = {**totals, row_name: row_value}
    if flat:
        given[alias_name] = alias_value
    chosen = {k: v for k, v in given.items() if v is not None}
    if len(chosen) > 1:
        expected = f"{named}, steps in total, or `{row_name}`, per row"
        raise TypeError(f"{where}: give only one of {expected}, got {chosen}.")
    if not chosen:
        return named, None
    ((name, value),) = chosen.items()
    return named, (name, check_positive_int(where, name, value))


class Sizes(TypedDict, total=False):
    """The size keywords every buffer built on a ring takes, as `**sizes` (give one of the
    first four and at most one of the last three). Steps are items on the item buffers.

    - `capacity`: steps held in total, rounded *up* to whole rows (a buffer never holds less
        than asked for). `max_size` is the same, by Flashbax's name; so is `max_length` on the
        flat-shaped buffers (`TransitionBuffer`, `ItemBuffer` and their prioritised kinds), as
        in Flashbax's flat and item buffers.
    - `max_length_time_axis`: steps held per row instead.
    - `min_size`: steps held in total before `can_sample()` is true, rounded up to whole rows
        (`min_length` on the flat-shaped buffers, as in Flashbax); or `min_length_time_axis`,
        per row. Default and least: the steps one sample spans, per row.

    On the trajectory-shaped buffers (`TrajectoryBuffer`, `EpisodeTrajectoryBuffer`, their
    prioritised kinds, `Queue`, `Buffer`), where Flashbax counts per row, `max_length` and
    `min_length` are refused with an error naming what to pass. A keyword that is no size,
    and none of the constructor's own, is a `TypeError` that lists these.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        sizes: eb.Sizes = {"capacity": 1000, "min_size": 64}
        buffer = eb.TransitionBuffer({"x": jnp.float32(0)}, add_batch_size=8, **sizes)
        assert buffer.capacity == 1000 and buffer.max_length_time_axis == 125
        ```
    """

    capacity: int
    max_size: int
    max_length: int
    max_length_time_axis: int
    min_size: int
    min_length: int
    min_length_time_axis: int


class SizeArgs(NamedTuple):
    """The size arguments a buffer's constructor received (None: not given)."""

    capacity: int | None = None
    max_size: int | None = None
    max_length: int | None = None
    max_length_time_axis: int | None = None
    min_size: int | None = None
    min_length: int | None = None
    min_length_time_axis: int | None = None

    @classmethod
    def of(cls, where: str, sizes: Mapping[str, Any]) -> "SizeArgs":
        """The size keywords a constructor received as `**sizes` ([`equibuffer.Sizes`][]),
        checked by name: a Flashbax factory argument equibuffer does not take gets the
        spelling to pass instead, any other unknown keyword a `TypeError` listing the sizes.
        Every buffer's constructor reads its sizes this one way."""
        for name in sorted(sizes.keys() - set(cls._fields), key=lambda n: n not in FLASHBAX_ONLY):
            if name in FLASHBAX_ONLY:
                raise flashbax_only_error(where, name)
            raise TypeError(
                f"{where}: unexpected keyword argument '{name}': besides its own arguments it "
                f"takes the sizes {', '.join(cls._fields)} (see equibuffer.Sizes)."
            )
        return cls(**sizes)

    def storage(
        self,
        where: str,
        example: ExampleTree,
        add_batch_size: int,
        *,
        flat: bool,
        frames: Frames | None = None,
    ) -> RingStorage:
        """The ring of `add_batch_size` rows, sized by the arguments (stacking `frames`)."""
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        (name, value), length = self._ring_length(where, rows, flat)
        # Refused by the user's names before the ring refuses them by its own.
        given = f"`add_batch_size`={rows} and `{name}`={value}"
        check_fits(where, given, rows, length, stored_steps(where, example, frames)[1])
        return RingStorage(example, rows, length, frames=frames)

    def _ring_length(self, where: str, rows: int, flat: bool) -> tuple[tuple[str, int], int]:
        """The size argument given (exactly one) and the steps it holds per row.

        `flat` marks buffers whose Flashbax counterpart is flat or item-shaped, where
        `max_length` means the total.
        """
        totals, chosen = _one_of(
            where,
            flat,
            {"capacity": self.capacity, "max_size": self.max_size},
            ("max_length", self.max_length),
            ("max_length_time_axis", self.max_length_time_axis),
        )
        if chosen is None:
            raise TypeError(
                f"{where}: give the buffer's size: {totals}, steps in total, or "
                "`max_length_time_axis`, steps per row."
            )
        name, value = chosen
        return chosen, value if name == "max_length_time_axis" else math.ceil(value / rows)

    def min_length_time_axis_for(
        self, where: str, storage: RingStorage, window: int, window_name: str, *, flat: bool
    ) -> int:
        """Check that a window of `window` steps (named `window_name` in errors) fits a row,
        and return the steps per row before sampling."""
        if window > storage.length:
            raise ValueError(
                f"{where}: {window_name} is larger than the ring (max_length_time_axis="
                f"{storage.length} steps per row); raise capacity (or max_length_time_axis) or "
                "shorten the window."
            )
        return self._min_length_time_axis(where, storage.rows, storage.length, window, flat)

    def _min_length_time_axis(
        self, where: str, rows: int, length: int, needs: int, flat: bool
    ) -> int:
        """The steps per row before sampling: from at most one minimum argument, never fewer
        than the `needs` steps one sample spans (the default), never more than `length`."""
        _, chosen = _one_of(
            where,
            flat,
            {"min_size": self.min_size},
            ("min_length", self.min_length),
            ("min_length_time_axis", self.min_length_time_axis),
        )
        if chosen is None:
            return needs
        name, value = chosen
        if name == "min_length_time_axis":
            if not needs <= value <= length:
                raise ValueError(
                    f"{where}: min_length_time_axis={value} is out of range: a row must hold "
                    f"at least the {needs} steps one sample spans and at most the "
                    f"{length} steps it keeps (max_length_time_axis)."
                )
            return value
        if value > rows * length:
            raise ValueError(
                f"{where}: {name}={value} is more than the buffer holds ({rows * length} "
                f"steps: {rows} rows of {length})."
            )
        return max(needs, math.ceil(value / rows))
