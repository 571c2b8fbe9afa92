"""The pieces the prioritised rules share: checks of `alpha`, `beta` and priorities, the
draw by priority from a `SumTree` (probabilities, importance weights, one folded check), and
the write of new priorities (stale updates dropped, the largest priority seen kept)."""

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._barriers import read_once
from .._checks import check_indices, host_float
from .._custom_types import BoolScalar, Indices, Steps
from .._errors import branched_error_if
from .._ring import RingStorage
from .._sumtree import SumTree
from ._request import Drawn, Request, Update
from ._valid import start_steps, window_offsets


_Tree = TypeVar("_Tree")


@runtime_checkable
class TreeKept(Protocol):
    """A prioritised rule that keeps `priority ** alpha` in a `SumTree`, beside the largest
    priority set so far and the exponent (`Prioritised`, `PrioritisedEpisodic`)."""

    @property
    def tree(self) -> SumTree: ...
    @property
    def max_priority(self) -> Float[Array, ""]: ...
    @property
    def alpha(self) -> float: ...


_Kept = TypeVar("_Kept", bound=TreeKept)


_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def check_alpha(where: str, alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"{where}: `alpha` must be a Python float, got {alpha!r}.")
    alpha = host_float(alpha)
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
    priority = host_float(priority)
    if not (math.isfinite(priority) and priority > 0):
        raise ValueError(
            f"{where}: `priority` must be finite and > 0 (a window of priority 0 is never "
            f"drawn), got {priority}."
        )
    return priority


def _real(x: Any) -> bool:
    """Whether `x` has a dtype of real numbers (integer or floating, not bool)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )


def check_beta(where: str, beta: Any) -> Float[Array, ""]:
    """`beta` (a Python float or int, or a 0-d array of real numbers: a traced schedule) as a
    0-d float32 array; a Python number must be finite and >= 0 (a traced one is checked
    inside jit, with the draw)."""
    if isinstance(beta, int | float) and not isinstance(beta, bool):
        # (finite as the float32 it is drawn with: 3.5e38 would become infinite)
        if not 0 <= beta <= _FLOAT32_MAX:
            raise ValueError(f"{where}: `beta` must be finite and >= 0, got {beta}.")
    elif not _real(beta):
        raise TypeError(
            f"{where}: `beta` must be a float (or a 0-d array of one), the importance-sampling "
            f"exponent, e.g. 0.4 annealed to 1; got {beta!r} of type {type(beta).__name__}."
        )
    exponent = jnp.asarray(beta, jnp.float32)
    if exponent.shape != ():
        raise ValueError(f"{where}: `beta` must be a scalar, got shape {exponent.shape}.")
    return exponent


def draw_by_priority(
    storage: RingStorage, tree: SumTree, request: Request, none_valid: BoolScalar, no_window: str
) -> Drawn:
    """Draw `request.batch_size` leaves of `tree` in proportion to their values (stratified),
    with probabilities and importance weights (exponent `request.beta`). One check for the
    four ways to fail: not `request.ready`; every valid window at priority 0; `none_valid`
    (raising `no_window`); a bad `beta`.

    With `blocks > 1` the leaves are cut into that many equal blocks (the rows' blocks) and
    the `b`-th `batch_size / blocks` draws are made inside block `b`, in proportion to the
    values there: probabilities and weights are those of the block (its total, its smallest
    drawn probability), and a block of total 0 fails as a tree of total 0 does."""
    key, batch_size, ready, not_ready, where, blocks, beta = request
    assert beta is not None, "a prioritised draw needs `beta`"
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
    indices, leaves, totals = read_once(indices, leaves, totals, blocks=blocks)
    total = jnp.min(totals)
    failure = jnp.where(total > 0, 3, jnp.where(none_valid, 2, 1))
    failure = jnp.where(~ready, 0, failure)
    indices = check_draw(
        indices, failure, beta, where, priority_messages(where, not_ready, no_window, blocks)
    )
    probabilities = leaves / totals
    weights = importance_weights(probabilities, beta)
    indices, probabilities, weights = (x.reshape(-1) for x in (indices, probabilities, weights))
    steps = start_steps(storage, window_offsets(storage, indices))
    return Drawn(indices, steps, probabilities, weights)


def as_priorities(where: str, priorities: Any) -> Array:
    """`priorities` as an array, refused by name unless it holds real numbers (integer or
    floating: not bool, complex, strings, objects, None): nothing is cast in silence."""
    try:
        new = None if isinstance(priorities, str) else jnp.asarray(priorities)
    except (TypeError, ValueError):  # (None, objects, strings: JAX refuses them its own way)
        new = None
    if new is None or not _real(new):
        got = f" of dtype {new.dtype}" if new is not None else ""
        raise TypeError(
            f"{where}: `priorities` must be real numbers, one per sampled window (for "
            f"example `jnp.abs(td_error) + 1e-6`); got {type(priorities).__name__}{got}."
        )
    return new


def check_priority_update(
    update: Update, capacity: int, bound: str = "add_batch_size * max_length_time_axis"
) -> tuple[Indices, Steps, Float[Array, " batch"], Bool[Array, ""]]:
    """The arguments of `set_priorities`, checked: shapes and dtypes at trace time, values
    (indices in range `[0, capacity)`, named `bound` in the error; priorities non-negative
    and finite) inside jit. Also returns whether the update may be applied (0-d bool): not
    when a value check fails, nor for a sample that holds a failure (`update.failed`). A
    refused update changes no priority: the caller masks every entry with it. Every
    prioritised rule's `reprioritised` starts here."""
    where = update.where
    indices = jnp.asarray(update.indices)
    steps = jnp.asarray(update.steps)
    new = as_priorities(where, update.priorities)
    indices = check_indices(where, indices)
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
    bad = out_of_range | jnp.any((new < 0) | ~jnp.isfinite(new))
    new = branched_error_if(
        new,
        bad,
        jnp.where(out_of_range, 0, 1),
        [
            f"{where}: every index must be in [0, {bound}={capacity}); pass `sample.indices`.",
            f"{where}: every priority must be non-negative and finite (a negative, NaN or "
            "infinite priority was given).",
        ],
    )
    return indices, steps, new, ~(bad | update.failed)


def set_by_priority(
    write: Callable[[Float[Array, " batch"], Bool[Array, " batch"]], _Tree],
    max_priority: Float[Array, ""],
    alpha: float,
    new: Float[Array, " batch"],
    current: Bool[Array, " batch"],
) -> tuple[_Tree, Float[Array, ""]]:
    """Write `new ** alpha` at the `current` entries (the others are dropped) with
    `write(values, mask)` (a `SumTree`'s, or a clustered buffer's `SumTrees`'), and raise
    the largest priority seen by the largest applied."""
    values = jnp.where(new > 0, new**alpha, 0.0)
    tree = write(values, current)
    applied = jnp.max(jnp.where(current, new, 0.0))
    return tree, jnp.maximum(max_priority, applied)


def reprioritised_tree(
    rule: _Kept,
    update: Update,
    current: Callable[[Indices, Steps], Bool[Array, " batch"]],
) -> _Kept:
    """`reprioritised` of a rule that keeps `priority ** alpha` in a `SumTree` (`rule.tree`)
    beside `rule.max_priority` and `rule.alpha`: the update checked, the entries that are
    not `current(indices, steps)` (still the window drawn, and valid) dropped."""
    tree = rule.tree
    indices, steps, new, accepted = check_priority_update(update, tree.capacity)
    tree, max_priority = set_by_priority(
        lambda values, mask: tree.write(indices, values, mask=mask),
        rule.max_priority,
        rule.alpha,
        new,
        current(indices, steps) & accepted,
    )
    return eqx.tree_at(lambda r: (r.tree, r.max_priority), rule, (tree, max_priority))


def importance_weights(
    scaled: Float[Array, "*blocks batch"], beta: Float[Array, ""]
) -> Float[Array, "*blocks batch"]:
    """The importance weights `(N P(i))^-beta / max_j (N P(j))^-beta` of draws whose
    `scaled` probabilities are `N P(i)` (any positive multiple of them along the last axis:
    one batch, or one per block), written so that they neither over- nor underflow: every
    drawn probability is positive, and the ratio to the smallest is at least 1."""
    return (scaled / jnp.min(scaled, axis=-1, keepdims=True)) ** -beta


def check_draw(
    x: Int[Array, "*batch"],
    failure: Int[Array, ""],
    beta: Float[Array, ""],
    where: str,
    messages: Sequence[str],
) -> Int[Array, "*batch"]:
    """`x`, raising `messages[failure]` where `failure < len(messages)` (each a way a draw by
    priority fails; `len(messages)`: it did not), and a message of its own for a `beta` that
    is negative or not finite: one check for every way to fail."""
    return branched_error_if(
        x,
        (failure < len(messages)) | (beta < 0) | ~jnp.isfinite(beta),
        failure,
        [*messages, f"{where}: `beta` must be finite and >= 0."],
    )


def priority_messages(
    where: str, not_ready: str, no_window: str, blocks: int = 1
) -> tuple[str, str, str]:
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
    )
