"""n-step transitions, computed at sample time from the steps stored once.

Convention (the same for the function and for `TransitionBuffer(n_step=...)`): step `t` holds
the observation seen at `t`, the action taken at `t` and what that action caused: its reward
and the `terminated` / `truncated` flags. A flag is set on the step whose action ended the
episode; the next stored step starts the next episode.
"""

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree, Shaped

from .._checks import check_positive_int, host_float
from .._custom_types import Indices
from .._ring import RingStorage
from ._base import AbstractView, Mask, zero_where_not


class NStepTransition(eqx.Module):
    """An n-step transition from step `t` of one row, each field with leading axis `batch`.

    - `first`: step `t` (a tree like the example).
    - `second`: step `t + steps`: where to bootstrap from. It is the step `n` later when the
        episode goes on, else the step right after the episode's last step (the first step
        of the next episode, which only matters after a truncation: see `last`).
    - `last`: step `t + steps - 1`, the last step whose reward is summed (the step that ended
        the episode, if one did). After a truncation with an auto-resetting environment the
        observation of `second` is the reset observation, not the truncated episode's next
        one: store that in the step (e.g. a `next_obs` leaf) and bootstrap from
        `last["next_obs"]` when `last[truncated]` is set.
    - `reward`: the discounted sum `sum_{k < steps} discount**k * reward[t + k]`.
    - `discount`: the bootstrap discount, `0` when the episode terminated within the `steps`
        steps, `discount**steps` otherwise (a truncation does not zero it).
    - `steps`: the number of steps taken, `n`, or fewer when the episode ended first.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        steps = {"reward": jnp.ones((2, 3)), "terminated": jnp.array([[False] * 3, [True] * 3])}
        t = eb.n_step_transition(steps, n=2, discount=0.5, truncated=None)
        assert isinstance(t, eb.NStepTransition) and t.reward.tolist() == [1.5, 1.0]
        assert t.steps.tolist() == [2, 1] and t.discount.tolist() == [0.25, 0.0]
        assert t.first["reward"].shape == (2,) and t.second["reward"].shape == (2,)
        ```
    """

    first: PyTree[Shaped[Array, "batch ..."]]
    second: PyTree[Shaped[Array, "batch ..."]]
    last: PyTree[Shaped[Array, "batch ..."]]
    reward: Float[Array, " batch"]
    discount: Float[Array, " batch"]
    steps: Int[Array, " batch"]


def check_discount(where: str, discount: Any) -> float:
    if isinstance(discount, bool) or not isinstance(discount, int | float):
        raise TypeError(f"{where}: `discount` must be a Python float, got {discount!r}.")
    discount = host_float(discount)
    if not (math.isfinite(discount) and 0 <= discount <= 1):
        raise ValueError(f"{where}: `discount` must be between 0 and 1, got {discount}.")
    return discount


def check_n_step(where: str, n: Any) -> int:
    return check_positive_int(where, "n_step", n)


def named_leaf(where: str, tree: Any, name: str, arg: str) -> Any:
    """The leaf called `name` (a key of a mapping or an attribute) of the experience tree."""
    try:
        return tree[name] if isinstance(tree, Mapping) else getattr(tree, name)
    except (KeyError, AttributeError):
        raise ValueError(
            f"{where}: the experience has no leaf {name!r}; n-step transitions need the "
            f"rewards and episode-end flags: name the leaf with `{arg}=`."
        ) from None


def check_leaves(
    where: str, example: Any, reward: str, terminated: str, truncated: str | None
) -> None:
    """Check, on one step's tree (leaves shaped like the example), that the named leaves exist:
    a 0-d floating reward and 0-d boolean flags."""
    r = named_leaf(where, example, reward, "reward")
    if not hasattr(r, "dtype") or not jnp.issubdtype(r.dtype, jnp.floating) or r.shape != ():
        raise TypeError(
            f"{where}: leaf {reward!r} (`reward=`) must be a scalar float per step, got "
            f"{getattr(r, 'dtype', type(r).__name__)} of shape {getattr(r, 'shape', None)}."
        )
    for arg, name in (("terminated", terminated), ("truncated", truncated)):
        if name is None:
            continue
        f = named_leaf(where, example, name, arg)
        if not hasattr(f, "dtype") or f.dtype != jnp.bool_ or f.shape != ():
            raise TypeError(
                f"{where}: leaf {name!r} (`{arg}=`) must be a scalar bool per step, got "
                f"{getattr(f, 'dtype', type(f).__name__)} of shape {getattr(f, 'shape', None)}; "
                "store episode ends as booleans (`x.astype(jnp.bool_)`)."
            )


def n_step_values(
    reward: Float[Array, "batch n"],
    terminated: Bool[Array, "batch n"],
    truncated: Bool[Array, "batch n"] | None,
    discount: float,
) -> tuple[Int[Array, " batch"], Float[Array, " batch"], Float[Array, " batch"]]:
    """`(steps, reward, bootstrap discount)` of n-step transitions from the rewards and flags
    of their first `n` steps."""
    n = reward.shape[1]
    end = terminated if truncated is None else terminated | truncated
    # Step k counts when no end happened at steps 0..k-1.
    before = jnp.cumsum(end, axis=1, dtype=jnp.int32) - end.astype(jnp.int32)
    alive = before == 0
    steps = jnp.sum(alive, axis=1, dtype=jnp.int32)
    powers = jnp.asarray(discount, reward.dtype) ** jnp.arange(n, dtype=reward.dtype)
    total = jnp.sum(jnp.where(alive, reward * powers[None, :], 0), axis=1)
    last_terminated = jnp.take_along_axis(terminated, (steps - 1)[:, None], axis=1)[:, 0]
    bootstrap = jnp.where(
        last_terminated, 0, jnp.asarray(discount, reward.dtype) ** steps.astype(reward.dtype)
    ).astype(reward.dtype)
    return steps, total, bootstrap


def n_step_transition(
    experience: PyTree[Shaped[Array, "batch sequence ..."]],
    n: int,
    discount: float,
    *,
    reward: str = "reward",
    terminated: str = "terminated",
    truncated: str | None = "truncated",
) -> NStepTransition:
    """n-step transitions from sampled sequences of `n + 1` steps (e.g. a
    [`equibuffer.TrajectoryBuffer`][] with `sequence_length=n + 1`), cut at episode ends.

    Rewards and flags of the step whose action ended an episode are the last ones read:
    nothing past an end enters the sum. See [`equibuffer.NStepTransition`][] for the fields
    and the bootstrap convention (0 after a termination, `discount**steps` after a
    truncation).

    **Arguments:**

    - `experience`: a tree (mapping or module) with leaves `(batch, n + 1, *leaf)`.
    - `n`: the number of steps, at least 1.
    - `discount`: the per-step discount, between 0 and 1.
    - `reward`, `terminated`, `truncated`: the names of the reward leaf (float) and of the
        episode-end leaves (bool, set on the step whose action ended the episode).
        `truncated=None` when there is no such leaf.

    **Returns:**

    An [`equibuffer.NStepTransition`][] with leading axis `batch`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        steps = {"obs": jnp.arange(4.0)[None], "reward": jnp.ones((1, 4)),
                 "terminated": jnp.array([[False, True, False, False]]),
                 "truncated": jnp.zeros((1, 4), bool)}
        out = eb.n_step_transition(steps, n=3, discount=0.5)
        assert out.reward.tolist() == [1.5] and out.discount.tolist() == [0.0]
        assert out.steps.tolist() == [2] and out.second["obs"].tolist() == [2.0]
        ```
    """
    where = "n_step_transition()"
    n = check_n_step(where, n)
    discount = check_discount(where, discount)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), experience)
    check_leaves(where, one, reward, terminated, truncated)
    for path, x in jax.tree_util.tree_flatten_with_path(experience)[0]:
        if x.ndim < 2 or x.shape[1] != n + 1:
            raise ValueError(
                f"{where}: leaf {jax.tree_util.keystr(path)} has shape {x.shape}, expected "
                f"(batch, n + 1 = {n + 1}, ...): sample sequences of sequence_length={n + 1}."
            )
    r = named_leaf(where, experience, reward, "reward")[:, :n]
    term = named_leaf(where, experience, terminated, "terminated")[:, :n]
    trunc = (
        None if truncated is None else named_leaf(where, experience, truncated, "truncated")[:, :n]
    )
    steps, total, bootstrap = n_step_values(r, term, trunc, discount)

    def at(offset: Int[Array, " batch"]) -> Any:
        return jax.tree.map(
            lambda x: jnp.take_along_axis(
                x, offset.reshape(-1, *(1,) * (x.ndim - 1)), axis=1, mode="promise_in_bounds"
            )[:, 0],
            experience,
        )

    return NStepTransition(
        first=jax.tree.map(lambda x: x[:, 0], experience),
        second=at(steps),
        last=at(steps - 1),
        reward=total,
        discount=bootstrap,
        steps=steps,
    )


def n_step_from_storage(
    storage: Any,
    indices: Int[Array, " batch"],
    n: int,
    discount: float,
    reward: str,
    terminated: str,
    truncated: str | None,
    within: Bool[Array, "batch window"] | None = None,
) -> NStepTransition:
    """n-step transitions from the windows of `n + 1` steps starting at flat `indices` of a
    `RingStorage`. Only the reward and flag leaves are read over the `n` steps; every other
    leaf is read at the three steps returned (`first`, `last`, `second`).

    `within` (an episode rule's pad mask, true up to the episode's last step) cuts each sum at
    the episode's end even where the `terminated`/`truncated` leaves do not flag it (an
    `episode_end` of its own): the last step inside counts as a truncation, so no reward past
    it, nor of a slot the row has not written, is summed."""
    where = "TransitionBuffer.sample()"
    length = storage.length
    row, slot = indices // length, indices % length

    def flat(offset: Int[Array, "..."]) -> Int[Array, "..."]:
        shape = (-1,) + (1,) * (offset.ndim - 1)
        return row.reshape(shape) * length + (slot.reshape(shape) + offset) % length

    def take(leaf: Array, at: Int[Array, "..."]) -> Array:
        return leaf.reshape(-1, *leaf.shape[2:]).at[at].get(mode="promise_in_bounds")

    window = flat(jnp.arange(n, dtype=jnp.int32)[None, :])
    r = take(named_leaf(where, storage.data, reward, "reward"), window)
    term = take(named_leaf(where, storage.data, terminated, "terminated"), window)
    trunc = None
    if truncated is not None:
        trunc = take(named_leaf(where, storage.data, truncated, "truncated"), window)
    if within is not None:
        cut = within[:, :n] & ~within[:, 1 : n + 1]
        trunc = cut if trunc is None else trunc | cut
    steps, total, bootstrap = n_step_values(r, term, trunc, discount)
    at_first, at_second, at_last = flat(jnp.zeros_like(steps)), flat(steps), flat(steps - 1)
    return NStepTransition(
        first=storage.take(at_first),
        second=storage.take(at_second),
        last=storage.take(at_last),
        reward=total,
        discount=bootstrap,
        steps=steps,
    )


class NStepView(AbstractView):
    """n-step transitions ([`equibuffer.NStepTransition`][]) from `n + 1` consecutive steps,
    cut at episode ends (see [`equibuffer.n_step_transition`][] for the convention): the
    view of `TransitionBuffer(n_step=n)`. Nothing is stored twice: the sums are computed
    from the stored steps at sample time.

    **Arguments:** `n` (at least 1), `discount` (in `[0, 1]`), and the names of the float
    `reward` leaf and the bool `terminated` and `truncated` leaves (`truncated=None` when
    there is none), checked against the example when a buffer is built.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"reward": jnp.float32(0), "terminated": jnp.bool_(False)}
        view = eb.views.NStepView(n=2, discount=0.5, truncated=None)
        buffer = eb.Buffer(example, add_batch_size=1, capacity=8, view=view)
        buffer = buffer.add({"reward": jnp.ones((1, 4)), "terminated": jnp.zeros((1, 4), bool)})
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert jnp.allclose(sample.experience.reward, 1 + 0.5)
        ```
    """

    n: int = eqx.field(static=True)
    discount: float = eqx.field(static=True)
    reward: str = eqx.field(static=True, default="reward")
    terminated: str = eqx.field(static=True, default="terminated")
    truncated: str | None = eqx.field(static=True, default="truncated")

    def checked(self, where: str, storage: RingStorage) -> "NStepView":
        n, discount = check_n_step(where, self.n), check_discount(where, self.discount)
        check_leaves(where, storage.example(), self.reward, self.terminated, self.truncated)
        return NStepView(n, discount, self.reward, self.terminated, self.truncated)

    @property
    def window_length(self) -> int:
        return self.n + 1

    def gather(self, storage: RingStorage, indices: Indices, mask: Mask | None) -> Any:
        names = (self.reward, self.terminated, self.truncated)
        return n_step_from_storage(storage, indices, self.n, self.discount, *names, within=mask)

    def padded(self, experience: Any, mask: Bool[Array, "batch window"]) -> Any:
        # The sums stop at an end already; `second` (the step after the last one summed) lies
        # past the end when the episode ended within the n steps: zero, as the mask says.
        inside = jnp.take_along_axis(mask, experience.steps[:, None], axis=1)[:, 0]
        return eqx.tree_at(
            lambda e: e.second, experience, zero_where_not(inside, experience.second)
        )

    @property
    def window_name(self) -> str:
        return f"n_step + 1 = {self.n + 1} steps"

    def needs(self, steps: int) -> str:
        return (
            f"at least {steps} steps per row (n_step + 1 = {self.n + 1} make one n-step transition)"
        )
