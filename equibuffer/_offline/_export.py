"""`to_minari`: an `Archive` (or a buffer) holding steps in the layout of `_source` out as a
Minari data set, streamed: each row is read in blocks of bounded size, cut into episodes at
`episode_end` (an episode straddling blocks carried over), and the episodes handed to
Minari's storage a batch at a time.

One Minari episode is the steps up to and including an `episode_end`: its `T + 1`
observations are those of its `T + 1` steps, its `T` actions, rewards, terminations and
truncations those of its first `T` steps (the last step holds the final observation and a
zero action). gymnasium and minari are imported when `to_minari` runs (they are not
equibuffer's dependencies)."""

import ast
import dataclasses
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast, TYPE_CHECKING

import jax
import numpy as np
from jaxtyping import Shaped

from .._archive._archive import Archive
from .._archive._format import BufferLike, storage_of
from .._archive._reader import progress_bar
from .._checks import check_positive_int
from .._ring import host_counters
from ._source import DEFAULT_MEMORY, MIN_MEMORY


if TYPE_CHECKING:
    import gymnasium
    import minari
    from gymnasium.envs.registration import EnvSpec

    _Space = gymnasium.Space
    _Env = str | gymnasium.Env | EnvSpec
    _Dataset = minari.MinariDataset
else:  # gymnasium and minari are optional: the annotations are `Any` at run time
    _Space = _Env = _Dataset = Any


ROLES: tuple[str, ...] = (
    "observation",
    "action",
    "reward",
    "terminated",
    "truncated",
    "episode_end",
)
_SCALARS = ("reward", "terminated", "truncated", "episode_end")  # one `()` leaf each
_FLAGS = ("terminated", "truncated", "episode_end")  # boolean
# The keywords of `minari.create_dataset_from_buffers` that `to_minari` passes on as they are.
_MINARI_KEYWORDS = (
    "algorithm_name",
    "author",
    "author_email",
    "code_permalink",
    "description",
    "requirements",
    "eval_env",
    "ref_min_score",
    "ref_max_score",
    "expert_policy",
    "num_episodes_average_score",
    "data_format",
)
# The share of `memory` of a block read (one row), and again of the episodes waiting to be
# handed to Minari; the rest covers the episodes cut from a block (copies) while Minari
# writes a batch.
_SHARE = 0.25
# Minari's advice when a metadata field is left out (one warning per field, and for a data
# set without an env spec): the fields are documented by `to_minari`, which records the
# ones given; the advice is not repeated at every export.
_MINARI_ADVICE = (r"`\w+` is set to None", r"env_spec is None")

Path = tuple[str | int, ...]  # a leaf's keys: dict keys and attributes (str), indices (int)
# A key of `jax.tree_util.keystr`'s spelling: `['a']`, `[0]` or `.a`.
_KEY = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def _parsed(where: str, path: str) -> Path:
    """A leaf path as `keystr` spells it, as its keys."""
    keys: list[str | int] = []
    at = 0
    while at < len(path):
        match = _KEY.match(path, at)
        if match is None:
            raise ValueError(
                f"{where}: the leaf {path} is not reached by dict keys, tuple indices and "
                "attributes only, which is what a Minari space nests (Dict and Tuple)."
            )
        keys.append(ast.literal_eval(match[1]) if match[1] is not None else match[2])
        at = match.end()
    return tuple(keys)


def _path_of(keys: Any) -> Path:
    """A leaf path of `jax.tree_util.tree_flatten_with_path` as its keys."""
    out: list[str | int] = []
    for k in keys:
        if isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        else:
            out.append(str(k))
    return tuple(out)


def _spelled(path: Path) -> str:
    """A path as `keystr` spells dict keys and indices: `['observation']['pos']`."""
    return "".join(f"[{k!r}]" for k in path)


def _nest(paths: list[Path], values: list[Any]) -> Any:
    """The values as a tree of dicts (str keys) and tuples (int keys, in order) reached by
    their paths; a single value at the empty path is itself."""
    if len(paths) == 1 and not paths[0]:
        return values[0]
    groups: dict[str | int, tuple[list[Path], list[Any]]] = {}
    for path, value in zip(paths, values, strict=True):
        sub = groups.setdefault(path[0], ([], []))
        sub[0].append(path[1:])
        sub[1].append(value)
    nested = {k: _nest(*v) for k, v in groups.items()}
    if all(isinstance(k, int) for k in nested) and sorted(nested) == list(range(len(nested))):
        return tuple(nested[i] for i in range(len(nested)))
    return {str(k): v for k, v in nested.items()}


# --------------------------------------------------------------------------- the steps


@dataclasses.dataclass
class _Steps:
    """What the export reads: the leaves (paths, shapes, dtypes) of the steps, `rows`, the
    steps per row, where each row's episodes may have lost their start (`cuts`: the steps
    before were never kept), the metadata, and `read(row, start, stop)`: one array
    `(stop - start, *leaf)` a leaf."""

    kind: str  # "archive" or "buffer", for messages
    paths: list[Path]
    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    rows: int
    length: int
    cuts: list[int]
    metadata: dict[str, Any]
    read: Callable[[int, int, int], list[np.ndarray]]

    def row_bytes(self) -> int:
        """Bytes of one step of one row."""
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))


def _archive_steps(where: str, archive: Archive) -> _Steps:
    # The leaves' paths: `read` on an archive opened without `like` names leaves by their
    # zarr array name only, which does not say how they nest.
    leaves = archive._reader.layout.leaves
    names = [leaf.name for leaf in leaves]
    length = len(archive)

    def read(row: int, start: int, stop: int) -> list[np.ndarray]:
        out = archive.read(start, stop, rows=[row])
        if isinstance(out, dict) and set(out) == set(names):
            flat = [out[name] for name in names]
        else:  # opened with `like`: its tree, whose leaves come in the layout's order
            flat = jax.tree.leaves(out)
        return [np.asarray(x[0]) for x in flat]

    cuts = []
    if length:
        for a, _ in archive.segments:  # a segment after a gap, or steps lost before the first
            if a > 0 or archive.source_step(0) > 0:
                cuts.append(a)
    return _Steps(
        "archive",
        [_parsed(where, leaf.path) for leaf in leaves],
        [tuple(leaf.shape) for leaf in leaves],
        [np.dtype(leaf.dtype) for leaf in leaves],
        archive.rows,
        length,
        cuts,
        archive.metadata,
        read,
    )


def _buffer_steps(where: str, buffer: Any) -> _Steps:
    storage = storage_of(buffer, where)
    head, fill, added = host_counters(storage)
    flat, _ = jax.tree_util.tree_flatten_with_path(storage.data)
    host = jax.device_get([x for _, x in flat])  # the ring, copied to host once
    slots = (head - fill + np.arange(fill)) % storage.length  # oldest held step first

    def read(row: int, start: int, stop: int) -> list[np.ndarray]:
        return [np.asarray(x[row, slots[start:stop]]) for x in host]

    return _Steps(
        "buffer",
        [_path_of(keys) for keys, _ in flat],
        [tuple(x.shape[2:]) for _, x in flat],
        [np.dtype(x.dtype) for _, x in flat],
        storage.rows,
        fill,
        [0] if added > fill else [],  # the ring overwrote older steps
        {},
        read,
    )


@dataclasses.dataclass
class _Plan:
    """Which leaves make each role: their indices in the steps' leaves and their paths below
    the role's name (empty for a role that is one array)."""

    leaves: dict[str, list[int]]
    below: dict[str, list[Path]]

    def nest(self, role: str, values: list[np.ndarray]) -> Any:
        return _nest(self.below[role], [values[i] for i in self.leaves[role]])


def _planned(where: str, steps: _Steps, keys: dict[str, str] | None) -> _Plan:
    """The leaves of each role, checked: every role there, the scalars `()` arrays, the flags
    boolean, every dtype one a Minari data set holds."""
    names: dict[str, str] = {r: r for r in ROLES}
    if keys is not None:
        if not isinstance(keys, dict):
            raise TypeError(f"{where}: `keys` must be a dict, got {type(keys).__name__}.")
        unknown = [k for k in keys if k not in ROLES]
        if unknown:
            raise ValueError(
                f"{where}: `keys` has {', '.join(map(repr, unknown))}, not among the roles "
                f"{', '.join(ROLES)} (a role maps to the name of its leaf)."
            )
        for role, name in keys.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: `keys[{role!r}]` must be a str, got {name!r}.")
        names.update(keys)
    tops = list(dict.fromkeys(str(p[0]) for p in steps.paths if p))
    if any(not p for p in steps.paths):
        raise ValueError(
            f"{where}: the {steps.kind}'s steps are one array, not a dict of "
            f"{', '.join(ROLES)}: see eb.to_minari's layout."
        )
    leaves = {r: [i for i, p in enumerate(steps.paths) if p[0] == names[r]] for r in ROLES}
    missing = [r for r in ROLES if not leaves[r]]
    if missing:
        said = ", ".join(repr(names[r]) + ("" if names[r] == r else f" (the {r})") for r in missing)
        raise ValueError(
            f"{where}: the {steps.kind} has no leaf {said}; its leaves are "
            f"{', '.join(map(repr, tops))}. Name each role's leaf with `keys=` (e.g. "
            f"keys={{{missing[0]!r}: {tops[0]!r}}})."
        )
    for role in _SCALARS:
        (i, *more) = leaves[role]
        shape, dtype = steps.shapes[i], steps.dtypes[i]
        if more or steps.paths[i] != (names[role],) or shape != ():
            what = "several leaves" if more else f"a leaf of shape {shape}"
            raise ValueError(
                f"{where}: the {role} {names[role]!r} is {what}; expected one value a step, "
                "an array of shape ()."
            )
        if role in _FLAGS and dtype != np.bool_:
            said = {
                "terminated": "Minari's terminations",
                "truncated": "Minari's truncations",
                "episode_end": "true on the last step of each episode",
            }[role]
            raise ValueError(
                f"{where}: the {role} {names[role]!r} has dtype {dtype}; expected bool ({said}): "
                "cast it, e.g. `steps[...] != 0`."
            )
        if role == "reward" and dtype.kind not in "iuf":
            raise ValueError(
                f"{where}: the reward {names[role]!r} has dtype {dtype}; expected a number."
            )
    for role in ("observation", "action"):
        for i in leaves[role]:
            dtype = steps.dtypes[i]
            if dtype.kind not in "biufc" or not dtype.isnative:  # bfloat16, float8, ...
                raise ValueError(
                    f"{where}: the {steps.kind}'s leaf {_spelled(steps.paths[i])} has dtype "
                    f"{dtype}, which a Minari data set does not hold (NumPy's bool, int, uint, "
                    "float and complex): cast it before the export."
                )
    below = {r: [steps.paths[i][1:] for i in leaves[r]] for r in ROLES}
    return _Plan(leaves, below)


# --------------------------------------------------------------------------- the spaces


def _inferred(where: str, role: str, node: Any, path: str = "") -> "_Space":
    """The space of a role's example: Box(-inf, inf) for floats, Box of the dtype's range for
    ints, Box(0, 1) for bools (of their dtype and shape); Dict and Tuple of the parts."""
    from gymnasium import spaces

    if isinstance(node, dict):
        return spaces.Dict(
            {k: _inferred(where, role, v, f"{path}[{k!r}]") for k, v in node.items()}
        )
    if isinstance(node, tuple):
        return spaces.Tuple([_inferred(where, role, v, f"{path}[{i}]") for i, v in enumerate(node)])
    dtype, shape = node.dtype, node.shape
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return spaces.Box(-np.inf, np.inf, shape, dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return spaces.Box(int(info.min), int(info.max), shape, dtype)
    if dtype.kind == "b":
        return spaces.Box(0, 1, shape, dtype)
    raise ValueError(
        f"{where}: no `{role}_space` was given, the archive's metadata holds none and no `env` "
        f"gives one, and the {role}{path} (dtype {dtype}) has no Box to infer: pass "
        f"`{role}_space=`."
    )


def _checked_space(where: str, role: str, space: Any, node: Any, path: str = "") -> None:
    """`space` describes the role's example: the same Dict keys and Tuple length, Box shape
    and dtype, integer Discrete and MultiDiscrete, MultiBinary of the shape."""
    from gymnasium import spaces

    def wrong(what: str) -> ValueError:
        return ValueError(
            f"{where}: the {role} space {space} does not match the data: its {role}{path} is "
            f"{what}. Give a space of the data's structure, shapes and dtypes (or none, to "
            "infer one)."
        )

    if isinstance(space, spaces.Dict):
        if not isinstance(node, dict) or set(node) != set(space.spaces):
            got = f"a dict of {sorted(node)}" if isinstance(node, dict) else _what(node)
            raise wrong(got + f", not a dict of {sorted(space.spaces)}")
        for k, s in space.spaces.items():
            _checked_space(where, role, s, node[k], f"{path}[{k!r}]")
        return
    if isinstance(space, spaces.Tuple):
        if not isinstance(node, tuple) or len(node) != len(space.spaces):
            raise wrong(_what(node) + f", not a tuple of {len(space.spaces)}")
        for i, s in enumerate(space.spaces):
            _checked_space(where, role, s, node[i], f"{path}[{i}]")
        return
    if isinstance(node, (dict, tuple)):
        raise wrong(_what(node) + f", not one array as a {type(space).__name__} holds")
    shape, dtype = node.shape, node.dtype
    if isinstance(space, spaces.Box):
        if shape != space.shape or dtype != space.dtype:
            raise wrong(f"{dtype}{list(shape)}, not the Box's {space.dtype}{list(space.shape)}")
    elif isinstance(space, spaces.Discrete):
        if shape != () or dtype.kind not in "iu":
            raise wrong(f"{dtype}{list(shape)}, not one integer")
    elif isinstance(space, spaces.MultiDiscrete):
        if shape != space.shape or dtype.kind not in "iu":
            raise wrong(f"{dtype}{list(shape)}, not integers of shape {list(space.shape)}")
    elif isinstance(space, spaces.MultiBinary):
        if shape != space.shape or dtype.kind not in "biu":
            raise wrong(f"{dtype}{list(shape)}, not bits of shape {list(space.shape)}")


def _what(node: Any) -> str:
    if isinstance(node, dict):
        return f"a dict of {sorted(node)}"
    if isinstance(node, tuple):
        return f"a tuple of {len(node)}"
    return f"an array {node.dtype}{list(node.shape)}"


def _stored_space(where: str, role: str, metadata: dict[str, Any]) -> "_Space | None":
    """The space an import from Minari recorded (Minari's JSON), or None."""
    text = metadata.get(f"{role}_space")
    if text is None:
        return None
    from minari.serialization import deserialize_space

    try:
        return deserialize_space(text)
    except Exception as error:
        raise ValueError(
            f"{where}: the archive's metadata holds an {role} space Minari cannot read back "
            f"({error}): pass `{role}_space=`."
        ) from None


def _env_spec_json(where: str, env: Any, metadata: dict[str, Any]) -> tuple[str | None, Any]:
    """The env spec to record (Minari's JSON, or None) and the env whose spaces stand in for
    those not given (an `Env`, a spec or an id; None)."""
    import gymnasium as gym
    from gymnasium.envs.registration import EnvSpec

    if env is None:
        text = metadata.get("env_spec")
        if text is None:
            return None, None
        try:
            _spec_of(text)
        except Exception as error:
            raise ValueError(
                f"{where}: the archive's metadata holds an env spec gymnasium cannot read "
                f"({error}): pass `env=` (an id, a gymnasium.Env or an EnvSpec)."
            ) from None
        return text, None
    if isinstance(env, str):
        spec = gym.spec(env)
    elif isinstance(env, EnvSpec):
        spec = env
    elif isinstance(env, gym.Env):
        spec = env.spec
    else:
        raise TypeError(
            f"{where}: `env` must be an environment id, a gymnasium.Env or an EnvSpec, got "
            f"{type(env).__name__}."
        )
    if spec is None:
        return None, env
    try:
        return spec.to_json(), env
    except TypeError as error:
        warnings.warn(
            f"{where}: the env spec of {spec.id} is not serializable ({error}): the data set "
            "records none, so `recover_environment` cannot rebuild it.",
            UserWarning,
            stacklevel=3,
        )
        return None, env


def _spec_of(text: str) -> Any:
    """An env spec from Minari's JSON, read as Minari reads it (a spec written by gymnasium
    0.x has keys that 1.x refuses)."""
    from gymnasium.envs.registration import EnvSpec

    return EnvSpec.from_json(
        text.replace('"order_enforce": true,', "")
        .replace('"apply_api_compatibility": false,', "")
        .replace('"autoreset": false, ', "")
    )


def _env_spaces(env: Any) -> tuple["_Space", "_Space"]:
    import gymnasium as gym

    made = env if isinstance(env, gym.Env) else gym.make(env)
    return made.observation_space, made.action_space


# --------------------------------------------------------------------------- streaming


def _ranges(length: int, cuts: list[int], size: int) -> Iterator[tuple[int, int, bool]]:
    """Blocks `[a, b)` of at most `size` steps that never cross a cut, and whether a block
    starts at one."""
    bounds = sorted({0, length, *(c for c in cuts if 0 <= c < length)})
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        for a in range(lo, hi, size):
            yield a, min(hi, a + size), a == lo and lo in cuts


@dataclasses.dataclass
class _Left:
    """What an export leaves out, per reason."""

    tails: list[int]  # per row: steps after its last episode end
    cut: int = 0  # steps of episodes whose start was lost
    empty: int = 0  # episodes of one step (no action)

    def warning(self, where: str) -> str | None:
        said = []
        if any(self.tails):
            rows = ", ".join(f"row {r}: {n}" for r, n in enumerate(self.tails) if n)
            said.append(
                f"{sum(self.tails)} steps after the last episode end of their row, an "
                f"unfinished episode ({rows})"
            )
        if self.cut:
            said.append(
                f"{self.cut} steps of episodes whose start (or end) was lost: steps overwritten "
                "by the ring before they were kept"
            )
        if self.empty:
            said.append(
                f"{self.empty} episode{'s' if self.empty > 1 else ''} of one step (a final "
                "observation, no action), which a Minari data set cannot hold"
            )
        if not said:
            return None
        return f"{where}: left out " + "; ".join(said) + "."


def _episodes(
    steps: _Steps, row: int, size: int, end: int, left: _Left, bar: Any
) -> Iterator[list[np.ndarray]]:
    """Row `row`'s whole episodes, each its steps (one array a leaf), read in blocks of
    `size` steps; `end` is the index of the `episode_end` leaf."""
    carry: list[list[np.ndarray]] = []  # the pieces of an episode begun in earlier blocks
    skip = False  # until the next episode end: the steps of an episode whose start was lost
    for a, b, cut in _ranges(steps.length, steps.cuts, size):
        if cut:
            left.cut += sum(len(p[0]) for p in carry)
            carry, skip = [], True
        block = steps.read(row, a, b)
        s = 0
        for last in np.flatnonzero(block[end]):
            e = int(last) + 1  # the episode's steps are [s, e) of the block
            if skip:
                left.cut += e - s
                skip, s = False, e
                continue
            pieces = [*carry, [x[s:e] for x in block]]
            carry, s = [], e
            episode = [np.concatenate(p) for p in zip(*pieces, strict=True)]
            if len(episode[end]) == 1:
                left.empty += 1
            else:
                yield episode
        if skip:
            left.cut += b - a - s
        elif s < b - a:
            carry.append([x[s:].copy() for x in block])  # a copy: the block is let go
        bar.update(b - a)
    left.tails[row] = sum(len(p[0]) for p in carry)


def _episode_buffer(plan: _Plan, episode: list[Shaped[np.ndarray, "steps ..."]]) -> Any:
    """A Minari `EpisodeBuffer` of one episode's `T + 1` steps: every observation, the
    first `T` actions, rewards and flags."""
    from minari.data_collector.episode_buffer import EpisodeBuffer

    first = [x[:-1] for x in episode]
    return EpisodeBuffer(
        observations=plan.nest("observation", episode),
        actions=plan.nest("action", first),
        rewards=cast(Any, plan.nest("reward", first)),
        terminations=cast(Any, plan.nest("terminated", first)),
        truncations=cast(Any, plan.nest("truncated", first)),
    )


def to_minari(
    source: Archive | BufferLike,
    dataset_id: str,
    *,
    observation_space: "_Space | None" = None,
    action_space: "_Space | None" = None,
    env: "_Env | None" = None,
    keys: dict[str, str] | None = None,
    memory: int = DEFAULT_MEMORY,
    progress: bool = True,
    jpeg_encoding: bool = False,
    **metadata: Any,
) -> "_Dataset":
    """Export an `Archive` (or the steps a buffer holds) as a Minari data set, which
    `minari.load_dataset(dataset_id)` opens: the inverse of `eb.from_minari`, streamed.

    The steps must be in the layout the imports write: each a dict `{"observation",
    "action", "reward", "terminated", "truncated", "episode_end"}` (observation and action
    any pytree of dicts and tuples of arrays; the others one value a step, the flags
    boolean), the episodes back to back along each row's time axis. An episode of `T`
    actions is `T + 1` steps, the last holding its final observation (its action, reward
    and flags are not exported) with `episode_end` true; it becomes one Minari episode of
    `T + 1` observations and `T` actions, rewards, `terminations` and `truncations`, in the
    data's dtypes and shapes (dicts as Minari's Dict values, tuples as Tuple values). Each
    row is its own stream of episodes: row 0's are exported first, then row 1's, and so on.
    Leaves beside the six are not exported; nor are episode infos and seeds (there are none).

    What is left out is said in one `UserWarning`: the steps after the last `episode_end`
    of a row (an unfinished episode), episodes cut by steps never kept (steps the ring
    overwrote before the archive, or the buffer, kept them: a gap of lost steps, or a ring
    that wrapped; the first episode end after them may close an episode begun in them, so
    the steps up to it are left out), and episodes of one step (no action). Minari's own
    advice for each metadata field left out is not repeated.

    **Arguments:**

    - `source`: an `eb.Archive` (read in blocks), or a buffer or `RingStorage` (the steps
        it holds, oldest first, copied to host once).
    - `dataset_id`: the new data set's id, in Minari's syntax
        `(namespace/)name-v(version)`, e.g. `"cartpole/equibuffer-v0"`; it goes under
        `MINARI_DATASETS_PATH` (by default `~/.minari/datasets`). An id that exists there is
        refused.
    - `observation_space`, `action_space`: the data set's spaces. By default the ones an
        import from Minari recorded in `archive.metadata`, else those of `env`, else
        inferred from the data: `Box(-inf, inf)` for floats, a Box of the dtype's range for
        integers, `Box(0, 1)` for bools (of the leaf's shape and dtype), `Dict` for dicts
        and `Tuple` for tuples. A space given or recorded must match the data (structure,
        shapes, dtypes).
    - `env`: the environment (an id, a `gymnasium.Env` or an `EnvSpec`) whose spec the data
        set records, so that `dataset.recover_environment()` rebuilds it. By default the
        spec an import from Minari recorded, else none.
    - `keys`: the names of the leaves, where they are not the roles' own: e.g.
        `{"observation": "obs", "episode_end": "last"}`.
    - `memory`: the bound, in bytes, of what is staged in memory: a block of steps read and
        the episodes waiting to be handed to Minari; an episode is staged whole (Minari
        writes an episode at a time), and a buffer's ring is copied to host. At least 1 MiB.
    - `progress`: a tqdm progress bar.
    - `jpeg_encoding`: Minari's option to store image observations (uint8 Boxes of at least
        32 x 32) as JPEG, lossy; off by default, so that the data set holds exactly the
        data.
    - `**metadata`: what `minari.create_dataset_from_buffers` records: `algorithm_name`,
        `author`, `author_email`, `code_permalink`, `description`, `requirements`,
        `eval_env`, `ref_min_score`, `ref_max_score`, `expert_policy`,
        `num_episodes_average_score`; and `data_format` (`"hdf5"`, Minari's default, or
        `"arrow"` and `"parquet"` with Minari's arrow extra).

    **Returns:**

    The `minari.MinariDataset`. A missing or misshapen leaf, a space that does not match
    the data or cannot be inferred, a malformed or taken id raise before anything is
    created (`ValueError`, `TypeError`); a failure while writing removes what was written.

    !!! example

        ```python
        import os, tempfile

        os.environ["MINARI_DATASETS_PATH"] = tempfile.mkdtemp()
        import equibuffer as eb, jax.numpy as jnp, minari, numpy as np

        example = {"observation": jnp.zeros(2), "action": jnp.int32(0),
                   "reward": jnp.float32(0), "terminated": jnp.bool_(False),
                   "truncated": jnp.bool_(False), "episode_end": jnp.bool_(False)}
        buffer = eb.TrajectoryBuffer(example, add_batch_size=1, max_length_time_axis=8,
                                     sequence_length=2)
        # One episode of 2 actions that terminates: 3 steps, the last its final observation.
        buffer = buffer.add({
            "observation": jnp.arange(6.0).reshape(1, 3, 2),
            "action": jnp.array([[1, 0, 0]], jnp.int32),
            "reward": jnp.array([[0.5, 1.0, 0.0]], jnp.float32),
            "terminated": jnp.array([[False, True, False]]),
            "truncated": jnp.zeros((1, 3), bool),
            "episode_end": jnp.array([[False, False, True]]),
        })
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            archive.write(buffer)
            eb.to_minari(archive, "toy/equibuffer-v0", author="me", progress=False)
        dataset = minari.load_dataset("toy/equibuffer-v0")
        assert dataset.total_episodes == 1 and dataset.total_steps == 2
        (episode,) = dataset.iterate_episodes()
        assert episode.observations.shape == (3, 2) and episode.actions.tolist() == [1, 0]
        assert episode.terminations.tolist() == [False, True]
        assert dataset.action_space.dtype == np.int32  # a Box of int32's range
        ```
    """
    where = "eb.to_minari()"
    try:
        import gymnasium  # noqa: F401
        import minari
    except ImportError as error:
        raise ImportError(
            f"{where} needs minari and gymnasium, which equibuffer does not install: "
            f"`pip install minari` ({error})."
        ) from None
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.storage.datasets_root_dir import get_dataset_path

    unknown = [k for k in metadata if k not in _MINARI_KEYWORDS]
    if unknown:
        raise TypeError(
            f"{where}: unexpected keyword {', '.join(map(repr, unknown))}: the data set's "
            f"metadata keywords are {', '.join(_MINARI_KEYWORDS)}."
        )
    memory = check_positive_int(where, "memory", memory, limit=None)
    if not isinstance(dataset_id, str):
        raise TypeError(f"{where}: `dataset_id` must be a str, got {type(dataset_id).__name__}.")
    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):
        raise ValueError(
            f"{where}: {dataset_id!r} is not a Minari data set id: one is "
            "`(namespace/)name-v(version)`, a namespace and a name of at least two letters, "
            "digits, '-' or '_', e.g. 'cartpole/equibuffer-v0'."
        ) from None
    path = get_dataset_path(dataset_id)
    if os.path.exists(path):
        raise ValueError(
            f"{where}: a Minari data set {dataset_id!r} exists already, at {path}: choose "
            "another id (or version), or remove it first "
            f"(`minari.delete_dataset({dataset_id!r})`)."
        )

    if isinstance(source, Archive):
        steps = _archive_steps(where, source)
    else:
        steps = _buffer_steps(where, source)
    plan = _planned(where, steps, keys)
    example = [
        np.broadcast_to(np.zeros((), d), s) for s, d in zip(steps.shapes, steps.dtypes, strict=True)
    ]
    spec_json, spec_env = _env_spec_json(where, env, steps.metadata)
    spaces: dict[str, Any] = {"observation": observation_space, "action": action_space}
    for role in spaces:
        if spaces[role] is None:
            spaces[role] = _stored_space(where, role, steps.metadata)
    if spec_env is not None and (spaces["observation"] is None or spaces["action"] is None):
        made = _env_spaces(spec_env)
        spaces = {r: made[i] if spaces[r] is None else spaces[r] for i, r in enumerate(spaces)}
    for role in spaces:
        node = plan.nest(role, example)
        if spaces[role] is None:
            spaces[role] = _inferred(where, role, node)
        else:
            _checked_space(where, role, spaces[role], node)

    row_bytes = steps.row_bytes()
    need = max(MIN_MEMORY, math.ceil(row_bytes / _SHARE))
    if memory < need:
        raise ValueError(
            f"{where}: memory={memory} bytes is too small: a step of a row is {row_bytes} bytes, "
            f"and the export needs at least {need} bytes to stage one."
        )
    size = max(1, int(memory * _SHARE) // row_bytes)
    batch_bytes = int(memory * _SHARE)
    scored = metadata.get("ref_max_score") is not None or metadata.get("expert_policy") is not None
    if spec_json is not None and scored and "eval_env" not in metadata:
        # Minari scores the reference policies on the env it records, and the data set is
        # created without one (its spec is recorded afterwards).
        metadata["eval_env"] = _spec_of(spec_json)

    left = _Left([0] * steps.rows)
    shown = source.progress if isinstance(source, Archive) else None
    try:  # (Minari makes the data set's directory first, then checks the rest)
        with warnings.catch_warnings():
            for advice in _MINARI_ADVICE:
                warnings.filterwarnings("ignore", advice, UserWarning)
            storage = minari.create_dataset_from_buffers(
                dataset_id,
                [],
                observation_space=spaces["observation"],
                action_space=spaces["action"],
                jpeg_encoding=bool(jpeg_encoding),
                **metadata,
            ).storage
        if spec_json is not None:  # created without an env: Minari would make one
            storage.update_metadata({"env_spec": spec_json})
        if isinstance(source, Archive):
            source.progress = False  # one bar, this one
        end = plan.leaves["episode_end"][0]
        with progress_bar()(
            total=steps.rows * steps.length,
            unit="step",
            unit_scale=True,
            desc=where,
            disable=not progress,
            leave=False,
        ) as bar:
            batch, held = [], 0
            for row in range(steps.rows):
                for episode in _episodes(steps, row, size, end, left, bar):
                    batch.append(_episode_buffer(plan, episode))
                    held += sum(x.nbytes for x in episode)
                    if held >= batch_bytes:
                        storage.update_episodes(batch)
                        batch, held = [], 0
            if batch:
                storage.update_episodes(batch)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # it did not exist: checked above
        raise
    finally:
        if isinstance(source, Archive) and shown is not None:
            source.progress = shown
    said = left.warning(where)
    if said is not None:
        warnings.warn(said, UserWarning, stacklevel=2)
    return minari.MinariDataset(storage)
