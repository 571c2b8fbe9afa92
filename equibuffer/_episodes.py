"""What marks the last step of an episode (`episode_end`: a bool leaf's name, or a function of
one step), checked once against an example, and read from any batch of steps: shared by the
episode rules and by frame stacking, which both ask where an episode ends."""

from collections.abc import Callable, Mapping
from typing import Any, cast, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, PyTree, Shaped

from ._checks import keystr


# A leaf name, or `step -> 0-d bool` (its output is checked at construction, with a message).
EpisodeEnd: TypeAlias = str | Callable[[PyTree[Shaped[Array, "..."]]], Any]


def check_episode_end_kind(where: str, episode_end: Any) -> EpisodeEnd:
    """`episode_end`, checked to be a leaf's name or a function (what a rule is built from;
    `check_episode_end` checks it against the example when a buffer sizes the rule)."""
    if not isinstance(episode_end, str) and not callable(episode_end):
        raise TypeError(
            f"{where}: `episode_end` must be the name of a boolean leaf or a function "
            f"`step -> bool`, got {episode_end!r}."
        )
    return cast(EpisodeEnd, episode_end)


def check_episode_end(where: str, example: Any, episode_end: Any) -> EpisodeEnd:
    """Validate `episode_end` against the example (a tree of `jax.ShapeDtypeStruct`s)."""
    episode_end = check_episode_end_kind(where, episode_end)
    if isinstance(episode_end, str):
        found = top_level(example, episode_end)
        if found is None:
            leaves = jax.tree_util.tree_flatten_with_path(example)[0]
            names = ", ".join(keystr(p) for p, _ in leaves)
            raise ValueError(
                f"{where}: `episode_end={episode_end!r}` names no top-level leaf of the example "
                f"(its leaves are {names}). Name a boolean 0-d leaf (a key of a dict example, "
                "or an attribute), or pass a function `step -> bool`, e.g. "
                "`lambda s: s['terminated'] | s['truncated']`."
            )
        leaf = found[2]
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        if shape != () or dtype != jnp.bool_:
            raise TypeError(
                f"{where}: the episode-end leaf [{episode_end!r}] must be a 0-d bool "
                f"(e.g. jnp.bool_(False)), got shape {shape} and dtype {dtype.name}. Store "
                "`terminated | truncated` as a bool, or pass a function `step -> bool`."
            )
        return episode_end
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


def ends_of(
    episode_end: EpisodeEnd, steps: Any, batch_dims: int
) -> Bool[Array | np.ndarray, "..."]:
    """The episode-end flag of every step of `steps`, a tree of leaves
    `(*batch, *leaf)` with `batch_dims` batch axes (`episode_end` checked already): JAX
    arrays, or NumPy ones on the host (an import's)."""
    if isinstance(episode_end, str):
        return steps[episode_end] if isinstance(steps, Mapping) else getattr(steps, episode_end)
    fn = episode_end
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(steps)


def top_level(tree: Any, name: str) -> tuple[int, Any, Any] | None:
    """`(position among the flattened leaves, path, leaf)` of the top-level leaf `name` of
    `tree` (a dict's key, or an attribute), None if there is none: how `episode_end` and
    `Frames.leaf` find the leaf they name."""
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        if len(path) == 1 and getattr(path[0], "key", getattr(path[0], "name", None)) == name:
            return i, path, leaf
    return None
