"""The import of a Flashbax Vault (`flashbax.vault.Vault`), read with tensorstore directly:
flashbax itself is not needed, and tensorstore is imported only when a vault is read.

The format (vault version 1.x, as Flashbax 0.1 writes it): a vault is the directory
`rel_dir/vault_name/vault_uid`. Its `metadata.json` holds `version`, the experience tree
twice, as `structure_shape` (each leaf the string of its shape in the buffer,
`"(add_batch_size, max_length_time_axis, *leaf)"`) and `structure_dtype` (each leaf its
dtype's name), and any metadata the user gave, merged at its top. Beside it one OCDBT
database (`manifest.ocdbt`, `d/`) holds a zarr v2 array per leaf, named by the keys of its
path each followed by a dot (`obs.pixels.`; a list index adds the dot alone), shaped
`(add_batch_size, 10**13, *leaf)`: the time axis is allocated to its bound and filled from
its start. The zarr array `vault_index`, of shape `(1,)`, says how many time steps are
written; Flashbax writes the data first and the index after it, so `[0, vault_index)` is
complete and nothing past it is read. A Flashbax buffer resets its environment on the step
after an episode's end, so its done flags stand on each episode's last step, as
`episode_end` does here: they are kept where they are.
"""

import ast
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jaxtyping import Bool, PyTree
from zarr.abc.store import Store

from .._archive._archive import Archive
from .._archive._format import Compression
from .._frames import Frames
from ._source import DEFAULT_MEMORY, import_source, ImportOptions, Source, SourceError


_FORMAT = "flashbax-vault"
_METADATA = "metadata.json"
_INDEX = "vault_index"
# The top-level leaves whose OR is `episode_end` with `episode_end="auto"`, where they exist.
AUTO_EPISODE_ENDS = ("terminals", "truncations", "terminated", "truncated", "done", "dones")

EpisodeEnd = str | Callable[[PyTree[np.ndarray]], Bool[np.ndarray, "rows k"]] | None


def _is_vault(path: pathlib.Path) -> bool:
    return (path / _METADATA).is_file()


def _vault_dir(where: str, vault: str | os.PathLike, vault_uid: str | None) -> pathlib.Path:
    """The vault's own directory: `vault` itself, or the one of its uids (`vault_uid`)."""
    path = pathlib.Path(vault).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(f"{where}: there is no directory {path}.")
    if not path.is_dir():
        raise SourceError(f"{where}: {path} is a file, not a Flashbax vault's directory.")
    uids = sorted(p.name for p in path.iterdir() if p.is_dir() and _is_vault(p))
    if vault_uid is not None:
        if _is_vault(path) and path.name == vault_uid:
            return path
        if _is_vault(path / vault_uid):
            return path / vault_uid
        found = ", ".join(uids) if uids else "none"
        raise SourceError(
            f"{where}: {path} has no vault of vault_uid={vault_uid!r} (a directory holding "
            f"{_METADATA}); the vaults there: {found}."
        )
    if _is_vault(path):
        return path
    if len(uids) == 1:
        return path / uids[0]
    if uids:
        raise SourceError(
            f"{where}: {path} holds several vaults ({', '.join(uids)}): pick one with `vault_uid=`."
        )
    raise SourceError(
        f"{where}: {path} is not a Flashbax vault: it holds no {_METADATA}, nor does any "
        "directory in it (give the vault's directory, rel_dir/vault_name/vault_uid, or "
        "rel_dir/vault_name)."
    )


def _ds_name(path: tuple[Any, ...]) -> str:
    """The name Flashbax gives a leaf's array: each key followed by a dot (an index by the
    dot alone)."""
    return "".join(f"{k.key}." if isinstance(k, jax.tree_util.DictKey) else "." for k in path)


def _shape_of(where: str, name: str, text: Any) -> tuple[int, ...]:
    try:
        shape = ast.literal_eval(text) if isinstance(text, str) else None
    except (ValueError, SyntaxError):
        shape = None
    if not isinstance(shape, tuple) or len(shape) < 2 or not all(isinstance(n, int) for n in shape):
        raise SourceError(
            f"{where}: the vault's {_METADATA} gives leaf {name!r} the shape {text!r}; "
            "expected the string of a tuple (add_batch_size, time, *leaf)."
        )
    return shape


def _flag(x: np.ndarray) -> np.ndarray:
    """`(rows, k, *agents)` flags as `(rows, k)` booleans: any one set."""
    x = x if x.dtype == np.bool_ else x != 0
    return np.asarray(x.reshape(*x.shape[:2], int(np.prod(x.shape[2:]))).any(axis=-1))


def _is_flag(example: Any) -> bool:
    return isinstance(example, np.ndarray) and example.dtype.kind in "biuf"


class VaultSource(Source):
    """The steps `[0, vault_index)` of a Flashbax vault, leaf by leaf as the vault holds them,
    plus the boolean `episode_end` (see `from_vault`), read with tensorstore."""

    def __init__(
        self,
        vault: str | os.PathLike,
        *,
        vault_uid: str | None = None,
        episode_end: EpisodeEnd = "auto",
        where: str = "from_vault()",
    ):
        self.where = where
        self.path = path = _vault_dir(where, vault, vault_uid)
        try:
            import tensorstore as ts  # pyright: ignore[reportMissingImports] (not a dependency)
        except ImportError:
            raise ImportError(
                f"{where}: reading a Flashbax vault needs tensorstore: `pip install tensorstore`."
            ) from None
        text = (path / _METADATA).read_text()
        try:
            meta = json.loads(text)
            stored = json.loads(text, parse_constant=str)  # NaN kept as JSON can hold it
        except json.JSONDecodeError as error:
            raise SourceError(f"{where}: {path / _METADATA} is not JSON: {error}.") from None
        if not isinstance(meta, dict) or not {"structure_shape", "structure_dtype"} <= set(meta):
            raise SourceError(
                f"{where}: {path / _METADATA} is not a Flashbax vault's metadata (no "
                "`structure_shape` and `structure_dtype`)."
            )
        version = meta.get("version")
        if not isinstance(version, int | float) or int(version) != 1:
            raise SourceError(
                f"{where}: the vault at {path} is of version {version!r}; this import reads "
                "Flashbax vaults of version 1.x."
            )
        leaves = jax.tree_util.tree_leaves(meta["structure_shape"])
        if not isinstance(meta["structure_shape"], dict) or not leaves:
            raise SourceError(
                f"{where}: the vault at {path} holds an experience that is not a dict of "
                f"leaves ({meta['structure_shape']!r}); this import reads a dict (a dict or "
                "a dataclass of arrays in the Flashbax buffer), beside which it can add "
                "`episode_end`."
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(meta["structure_shape"])
        try:
            dtypes = treedef.flatten_up_to(meta["structure_dtype"])
        except (ValueError, TypeError):
            raise SourceError(
                f"{where}: the vault's {_METADATA} gives `structure_shape` and "
                "`structure_dtype` different trees."
            ) from None
        context = ts.Context()

        def opened(name: str) -> Any:
            spec = {
                "driver": "zarr",
                "kvstore": {
                    "driver": "ocdbt",
                    "base": {"driver": "file", "path": str(path) + "/"},
                    "path": name,
                },
            }
            try:
                return ts.open(spec, open=True, read=True, context=context).result()
            except ValueError as error:
                raise SourceError(
                    f"{where}: the vault at {path} has no readable array {name!r}: {error}"
                ) from None

        names = [_ds_name(p) for p, _ in flat]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SourceError(
                f"{where}: the vault at {path} stores several leaves in one array ({twice}: "
                "Flashbax names a list's items alike), so they cannot be read apart."
            )
        index = opened(_INDEX)
        self.steps = steps = int(np.asarray(index.read().result()).reshape(-1)[0])
        self._stores, examples, rows = [], [], set()
        for (_, text_shape), dtype, name in zip(flat, dtypes, names, strict=True):
            want = _shape_of(where, name, text_shape)
            store = opened(name)
            got = np.dtype(store.dtype.numpy_dtype)
            shape = tuple(int(n) for n in store.shape)
            if got.name != dtype:
                raise SourceError(
                    f"{where}: leaf {name!r} is stored as {got.name}; the vault's {_METADATA} "
                    f"says {dtype}."
                )
            if len(shape) != len(want) or shape[0] != want[0] or shape[2:] != want[2:]:
                raise SourceError(
                    f"{where}: leaf {name!r} is stored with shape {shape}; the vault's "
                    f"{_METADATA} says {want} (add_batch_size, time, *leaf)."
                )
            if shape[1] < steps:
                raise SourceError(
                    f"{where}: leaf {name!r} holds {shape[1]} time steps; the vault's index "
                    f"says {steps} are written."
                )
            self._stores.append(store)
            examples.append(np.zeros(shape[2:], got))
            rows.add(shape[0])
        if len(rows) > 1:
            raise SourceError(f"{where}: the vault's leaves have different rows: {sorted(rows)}.")
        self._treedef = treedef
        self.rows = rows.pop()
        experience = treedef.unflatten(examples)
        self._ends, said = self._episode_ends(experience, episode_end)
        if said is not None:
            experience = {**experience, "episode_end": np.zeros((), np.bool_)}
        self.example = experience
        name, uid = path.parent.name, path.name
        self.metadata = {
            "format": _FORMAT,
            "vault_name": name,
            "vault_uid": uid,
            "episode_end": said,
            "vault": stored,
        }
        self.identity = {
            "format": _FORMAT,
            "location": str(path),
            "steps": steps,
            "rows": self.rows,
            "episode_end": said,
        }
        if callable(episode_end):
            self.read(0, min(steps, 1))  # the function's result checked before any write

    def _episode_ends(self, experience: dict, episode_end: Any) -> tuple[Any, Any]:
        """What `episode_end` is made of: the top-level leaves to OR (a tuple), a function, or
        None for no leaf; and how the metadata says it (a list of names, the function's
        name, or None)."""
        where = self.where
        auto = isinstance(episode_end, str) and episode_end == "auto"
        if episode_end is None:
            return None, None
        if "episode_end" in experience:
            raise SourceError(
                f"{where}: the vault's experience has an `episode_end` leaf already: pass "
                "`episode_end=None` to keep it as it is."
            )
        if auto:
            found = tuple(k for k in AUTO_EPISODE_ENDS if _is_flag(experience.get(k)))
            return (found, list(found)) if found else (None, None)
        if isinstance(episode_end, str):
            if not _is_flag(experience.get(episode_end)):
                there = [k for k, x in experience.items() if isinstance(x, np.ndarray)]
                what = "is not" if episode_end not in experience else "is no boolean or number"
                raise SourceError(
                    f"{where}: episode_end={episode_end!r}: that leaf {what} at the top of the "
                    f"vault's experience; its top-level leaves: {', '.join(there)}."
                )
            return (episode_end,), [episode_end]
        if callable(episode_end):
            name = getattr(episode_end, "__qualname__", type(episode_end).__qualname__)
            return episode_end, f"{getattr(episode_end, '__module__', '')}.{name}"
        raise SourceError(
            f"{where}: `episode_end` must be 'auto', the name of a top-level leaf, a function "
            f"of the steps, or None; got {episode_end!r}."
        )

    def read(self, start: int, stop: int) -> PyTree[np.ndarray]:
        if not 0 <= start <= stop <= self.steps:
            raise IndexError(
                f"{self.where}: steps [{start}, {stop}) asked; the vault holds [0, {self.steps})."
            )
        pending = [store[:, start:stop].read() for store in self._stores]
        steps = self._treedef.unflatten([np.asarray(p.result()) for p in pending])
        ends = self._ends
        if ends is None:
            return steps
        if isinstance(ends, tuple):
            flag = np.zeros((self.rows, stop - start), np.bool_)
            for name in ends:
                flag |= _flag(steps[name])
            return {**steps, "episode_end": flag}
        flag = np.asarray(ends(steps))
        want = (self.rows, stop - start)
        if flag.shape != want or flag.dtype != np.bool_:
            raise SourceError(
                f"{self.where}: the `episode_end` function returned {flag.dtype}{list(flag.shape)}"
                f" for steps [{start}, {stop}); expected bool{list(want)} (rows, steps)."
            )
        return {**steps, "episode_end": flag}

    def close(self) -> None:
        self._stores = []


def from_vault(
    vault: str | os.PathLike,
    store: str | os.PathLike | Store,
    *,
    vault_uid: str | None = None,
    episode_end: EpisodeEnd = "auto",
    memory: int = DEFAULT_MEMORY,
    like: Any = None,
    progress: bool = True,
    compression: Compression = "zstd",
    chunk_steps: int | None = None,
    shard_steps: int | None = None,
    storage_options: dict[str, Any] | None = None,
    frames: Frames | None = None,
) -> Archive:
    """Import a Flashbax Vault (written by `flashbax.vault.Vault`) into an
    [`equibuffer.Archive`][]: its rows (`add_batch_size`), its experience tree (the leaf
    names and nesting as the vault has them) and its dtypes, bit for bit, over the steps
    written (`[0, vault_index)`), plus a boolean top-level leaf `episode_end`. The vault is
    read with tensorstore, in blocks of time, so neither flashbax nor the memory to hold
    the vault is needed. An import stopped part way (killed, interrupted) carries on from
    where it stopped when it is run again with the same arguments.

    Flashbax resets an environment on the step after an episode's end, so its done flags
    stand on each episode's last step: `episode_end` is true there, as the archive's
    readers (`ArchiveLoader(..., episode_end="episode_end")`) expect.

    **Arguments:**

    - `vault`: the vault's directory, `rel_dir/vault_name/vault_uid`, or
        `rel_dir/vault_name`: then the one vault in it, or the one `vault_uid` names.
    - `store`: where the archive goes (as for [`equibuffer.Archive`][]).
    - `vault_uid`: which vault of `rel_dir/vault_name` to import (needed where there are
        several).
    - `episode_end`: how the `episode_end` leaf is made. `"auto"` (the default): the OR of
        whichever of the top-level leaves `terminals`, `truncations`, `terminated`,
        `truncated`, `done` and `dones` exist (boolean or numeric, non-zero counting as
        true; a leaf with more axes, such as OG-MARL's per-agent flags, is true where any
        of them is); where none exists, no `episode_end` leaf is added. A string: that
        top-level leaf (reduced the same way). A function: called with the steps of each
        block (the experience tree of NumPy arrays `(rows, k, *leaf)`), it returns the flags
        as a bool array `(rows, k)`. None: no `episode_end` leaf. The experience must be a
        dict with no `episode_end` of its own for one to be added.
    - `memory`: the bound, in bytes, on what the import stages at once (1 GiB by default).
    - `like`: a buffer whose steps the data set must match exactly (leaves, shapes, dtypes,
        `episode_end` included): checked before anything is written.
    - `progress`: show a progress bar.
    - `compression`, `chunk_steps`, `shard_steps`, `storage_options`: the archive's (see
        [`equibuffer.Archive`][]).
    - `frames`: an [`equibuffer.Frames`][], to store one frame per step of an observation
        leaf that holds stacked frames (each stack checked against the previous step's
        frames); `eb.ArchiveLoader(..., frames=)` returns the stacks (see
        [Pixels](../pixels.md)). Its episode ends default to the `episode_end` leaf.

    **Returns:**

    The archive, opened read-only. Its `metadata` holds `"format": "flashbax-vault"`,
    `vault_name`, `vault_uid`, the leaves `episode_end` was made of, and the vault's own
    `metadata.json` under `"vault"`.

    A directory that does not exist raises `FileNotFoundError`; one that is not a vault, a
    leaf named by `episode_end` that is not there, or steps that differ from `like` raise
    [`equibuffer.SourceError`][], all before anything is written.

    !!! example

        ```python
        import equibuffer as eb, flashbax as fbx, jax.numpy as jnp, numpy as np, tempfile
        from flashbax.vault import Vault

        fbx_buffer = fbx.make_trajectory_buffer(
            add_batch_size=2, max_length_time_axis=16, min_length_time_axis=1,
            sample_batch_size=1, sample_sequence_length=1, period=1)
        state = fbx_buffer.init({"obs": jnp.zeros(3), "done": jnp.bool_(False)})
        rel_dir = tempfile.mkdtemp()
        vault = Vault(vault_name="run", experience_structure=state.experience,
                      rel_dir=rel_dir, vault_uid="seed0")
        for _ in range(3):
            done = jnp.zeros((2, 5), bool).at[:, -1].set(True)  # episodes of 5 steps
            state = fbx_buffer.add(state, {"obs": jnp.ones((2, 5, 3)), "done": done})
            vault.write(state)

        archive = eb.from_vault(rel_dir + "/run", tempfile.mkdtemp() + "/run.zarr",
                                progress=False)
        assert len(archive) == 15 and archive.rows == 2
        steps = archive.read()
        assert np.array_equal(steps["episode_end"], steps["done"])
        assert archive.metadata["vault_uid"] == "seed0"
        ```
    """
    source = VaultSource(vault, vault_uid=vault_uid, episode_end=episode_end)
    options = ImportOptions(
        memory=memory,
        like=like,
        progress=progress,
        compression=compression,
        chunk_steps=chunk_steps,
        shard_steps=shard_steps,
        frames=frames,
        storage_options=storage_options,
    )
    return import_source(source, store, options)
