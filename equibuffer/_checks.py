"""Trace-time checks of user input, with messages that name the leaf and what to change."""

import functools
import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


# XLA before jax 0.11 (jax 0.10 is the last release for Python 3.11) removes optimization
# barriers before it fuses, and copies a donated array around a `cond` whose branches update
# it: the few places that keep updates in place differently there test this.
BARRIER_EXPANDED = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)


def keystr(path: Sequence[Any]) -> str:
    """`('obs',)` -> `['obs']`; the empty path (a single-leaf tree) -> `<root>`."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


# The largest size a buffer takes: its positions, counts of windows and draws are int32.
MAX_SIZE = 2**31 - 1


def host_float(value: int | float | np.integer | np.floating) -> float:
    """A Python or NumPy real number as a Python float: an int too large for one (2**1100)
    becomes infinite, and is then refused as such, rather than raising `OverflowError`."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_positive_int(where: str, name: str, value: Any, *, limit: int | None = MAX_SIZE) -> int:
    """`value`, a positive Python or NumPy int of at most `limit` (None: any), as an int;
    refused naming `name` otherwise. Every size a buffer holds or draws is bounded by
    `MAX_SIZE`, before anything is allocated or compiled (a `batch_size` of 2**40 ended the
    process with SIGFPE inside XLA, one of 2**31 failed in the dispatcher naming nothing)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{where}: `{name}` must be an int, got {value!r}.")
    if value < 1:
        raise ValueError(f"{where}: `{name}` must be at least 1, got {value}.")
    if limit is not None and value > limit:
        raise ValueError(
            f"{where}: `{name}`={value} is more than a buffer can index: at most "
            f"2**31 - 1 = {MAX_SIZE} (its positions are int32)."
        )
    return int(value)


def default_device_memory() -> tuple[int, str] | None:
    """The bytes the default device can hold and what it is (for an error message), or None
    where that is not known, or inside a trace: a template built under
    `eqx.filter_eval_shape` (to restore a checkpoint into, or to place with `shard_rows`)
    allocates nothing, so it is never refused for its size."""
    probe = jnp.zeros((), jnp.uint8)
    if isinstance(probe, Tracer):
        return None
    device = next(iter(probe.devices()))
    try:
        stats = device.memory_stats() or {}
    except Exception:  # (a backend that keeps none)
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.device_kind} {device.id}"
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine"
        except (ValueError, OSError):
            return None
    return None


def check_fits(where: str, given: str, rows: int, length: int, structs: Sequence[Any]) -> None:
    """Refuse a ring of `rows` rows of `length` steps (made from the arguments `given`, as
    the user wrote them) of more steps than its int32 positions index, or of more bytes than
    the default device holds, before anything is allocated (before, XLA's allocator said "Out
    of memory allocating N bytes", or an `OverflowError` came later, naming no argument)."""
    steps = rows * length
    if steps > MAX_SIZE:
        raise ValueError(
            f"{where}: {given} make a ring of {rows} rows of {length} steps, {steps} steps in "
            f"all: more than a buffer can index, at most 2**31 - 1 = {MAX_SIZE} (its "
            "positions are int32)."
        )
    step = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in structs)
    memory = default_device_memory()
    if memory is not None and steps * step > memory[0]:
        limit, device = memory
        raise ValueError(
            f"{where}: {given} make a ring of {steps} steps of {step} bytes each, "
            f"{steps * step / 1e9:.3g} GB: more than the {limit / 1e9:.3g} GB {device} holds. "
            "Store fewer steps, or keep them on disk in an `eb.Archive` (docs/archive.md)."
        )


def as_sequence(where: str, name: str, value: Any, one: str) -> tuple:
    """`value` as a tuple, refused naming `name` unless it is a sequence (a tuple, a list, a
    1-d array) of `one` each (a buffer, a share)."""
    try:
        if isinstance(value, str | bytes):
            raise TypeError
        return tuple(value)
    except TypeError:
        simple = value is None or isinstance(value, str | bytes | int | float | np.generic)
        got = repr(value) if simple else f"one {type(value).__name__}"
        raise TypeError(
            f"{where}: `{name}` must be a sequence (a tuple or a list) of {one} each, got "
            f"{got}; for one, pass a tuple of one: `{name}=(x,)`."
        ) from None


def check_shares(
    where: str, name: str, values: Any, count: int, of: str, counted: str | None = None
) -> tuple[float, ...]:
    """`values` checked to be `count` shares (one per `of`, whose number the argument
    `counted` gives, if one does): a sequence of Python or NumPy real numbers, each finite
    and `>= 0`, summing to 1 (within 1e-6); as floats."""
    shares = as_sequence(where, name, values, f"floats, one per {of}")
    if len(shares) != count:
        given = "" if counted is None else f" (`{counted}`={count})"
        raise ValueError(f"{where}: {len(shares)} {name} for {count} {of}s{given}; give one each.")
    for i, p in enumerate(shares):
        if isinstance(p, bool | np.bool_) or not isinstance(
            p, int | float | np.integer | np.floating
        ):
            raise TypeError(f"{where}: {name}[{i}] must be a Python float, got {p!r}.")
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"{where}: {name}[{i}] must be finite and >= 0, got {p}.")
    shares = tuple(float(p) for p in shares)
    if abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(f"{where}: {name} must sum to 1, got {shares} (sum {sum(shares)}).")
    return shares


def check_key(where: str, key: Any) -> Any:
    """`key` checked to be one JAX PRNG key: a typed key of shape `()` (`jax.random.key`) or a
    raw `uint32` key (`jax.random.PRNGKey`), concrete or traced. Returns it unchanged."""
    must = f"{where}: `key` must be one JAX PRNG key, e.g. jax.random.key(0), got"
    if not hasattr(key, "dtype") or not hasattr(key, "shape"):
        got = "None" if key is None else f"{type(key).__name__} {key!r}"
        raise TypeError(must + f" {got} (a seed is not a key).")
    dtype, shape = key.dtype, tuple(key.shape)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and len(shape) >= 1
    if (typed and shape == ()) or (raw and len(shape) == 1):
        return key  # (a raw key's length is checked by jax.random against the PRNG's)
    if typed or raw:
        n = math.prod(shape if typed else shape[:-1])
        raise TypeError(
            must + f" an array of {n} keys (shape {shape}); to draw one sample per key, "
            "jax.vmap over the keys."
        )
    raise TypeError(must + f" {dtype}{list(shape)} (a seed is not a key).")


def check_row_blocks(where: str, row_blocks: Any, sizes: dict[str, int], block: str) -> int:
    """`row_blocks` checked: a positive int dividing each of `sizes` (name -> value; `block`
    says in the message what one block of the sample is drawn from)."""
    row_blocks = check_positive_int(where, "row_blocks", row_blocks)
    for name, n in sizes.items():
        if n % row_blocks:
            raise ValueError(
                f"{where}: row_blocks={row_blocks} must divide {name}={n} ({block} gets "
                "batch_size / row_blocks of the draws)."
            )
    return row_blocks


def check_indices(where: str, indices: Any) -> jax.Array:
    """`indices` as an array, checked at trace time to be 1-d and of an integer dtype (their
    range is checked inside jit, by the caller)."""
    indices = jnp.asarray(indices)
    if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"{where}: `indices` must be a 1-d integer array, got shape {indices.shape} "
            f"and dtype {indices.dtype}."
        )
    return indices


def as_example(example: Any) -> Any:
    """The example a constructor was given with every Python or NumPy number or bool, and
    every NumPy array of them, made a JAX array as `jnp.asarray` takes it (a Python float is
    float32 without x64, as in Flashbax's examples); other leaves (JAX arrays,
    `jax.ShapeDtypeStruct`s, and strings, objects, ... that `as_example_leaf` refuses by
    name) as they are."""

    def convert(path: Sequence[Any], leaf: Any) -> Any:
        numbers = isinstance(leaf, bool | int | float | complex | np.generic | np.ndarray)
        if not numbers or np.asarray(leaf).dtype.kind not in "biufc":
            return leaf
        try:
            return jnp.asarray(leaf)
        except OverflowError:
            raise ValueError(
                f"example leaf {keystr(path)} is {leaf!r}, which JAX's default "
                f"{'int32' if isinstance(leaf, int) else 'dtype'} cannot hold; give the leaf "
                "as an array of the dtype to store (e.g. jnp.int32(0)); its value does not "
                "matter, only its shape and dtype."
            ) from None

    return jax.tree_util.tree_map_with_path(convert, example)


def as_example_leaf(path: Sequence[Any], leaf: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one leaf of the example tree given to a constructor (after
    `as_example`)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
            f"example leaf {keystr(path)} is {type(leaf).__name__} {leaf!r}; every leaf must be "
            "a number, a bool or an array of them (e.g. 0.0, jnp.zeros(3), np.int32(0))."
        )
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"example leaf {keystr(path)} is a typed PRNG key ({leaf.dtype}); a buffer stores "
            "arrays of numbers: store the key's data, jax.random.key_data(key) (uint32), and "
            "wrap what you sample back with jax.random.wrap_key_data."
        )
    if not (jnp.issubdtype(leaf.dtype, jnp.number) or jnp.issubdtype(leaf.dtype, jnp.bool_)):
        raise TypeError(
            f"example leaf {keystr(path)} has dtype {np.dtype(leaf.dtype)} ({type(leaf).__name__}"
            "); a buffer stores arrays of numbers or bools: encode strings or objects as "
            "numbers (an index into a table of your own) and store those."
        )
    if 0 in tuple(leaf.shape):
        raise ValueError(
            f"example leaf {keystr(path)} has shape {tuple(leaf.shape)}: a dimension of size 0 "
            "holds nothing; give the leaf the shape of one step (e.g. (3,) for 3 numbers) or "
            "leave it out of the example."
        )
    return jax.ShapeDtypeStruct(tuple(leaf.shape), jnp.dtype(leaf.dtype))


def check_structure(where: str, expected: Any, tree: Any) -> list:
    """Flatten `tree` with paths and check it has the expected structure."""
    got, got_def = jax.tree_util.tree_flatten_with_path(tree)
    if got_def == expected:
        return got
    want = {keystr(p): tuple(p) for p in expected_paths(expected)}
    have = {keystr(p): tuple(p) for p, _ in got}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    detail = []
    # A leaf given as a Python list or tuple (or any container) shows up as a missing leaf
    # with extra leaves under it: say that, not the list of its parts.
    for name in list(missing):
        path = want[name]
        inside = [e for e in extra if have[e][: len(path)] == path]
        if inside:
            missing.remove(name)
            extra = [e for e in extra if e not in inside]
            detail.append(
                f"leaf {name} is a container of {len(inside)} leaves ({inside[0]}, ...), not "
                "an array: pass one array per leaf (e.g. jnp.asarray(...))"
            )
    if missing:
        detail.append("missing leaves " + ", ".join(missing))
    if extra:
        detail.append("unexpected leaves " + ", ".join(extra))
    if not detail:
        detail.append(f"expected structure {expected}, received {got_def}")
    raise ValueError(
        f"{where}: the tree does not match the example the buffer was built from: "
        + "; ".join(detail)
        + "."
    )


def expected_paths(treedef: Any) -> list:
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def check_dtype(where: str, path: Sequence[Any], got: Any, expected: Any) -> None:
    if jnp.dtype(got) != jnp.dtype(expected):
        e = jnp.dtype(expected).name
        raise TypeError(
            f"{where}: leaf {keystr(path)} has dtype {jnp.dtype(got).name}, expected {e} "
            f"(the example's dtype); nothing is cast silently: pass x.astype(jnp.{e})."
        )


def check_representable(where: str, path: Sequence[Any], x: Any, dtype: Any) -> None:
    """NumPy data `x` that enters JAX as `dtype` (narrower: int64 -> int32, float64 ->
    float32 without `jax_enable_x64`, as at a jit boundary) refused, naming the leaf, where a
    value would not survive the conversion: an integer out of the range of `dtype`, or a
    finite float past its largest value (which would become infinite). Inside jit JAX has
    converted the data before any check sees it; here, where the library still sees the
    user's NumPy array (an eager `add`), nothing is truncated in silence. (`Archive.append`
    takes the archive's dtypes exactly.)"""
    if not isinstance(x, np.ndarray | np.generic) or x.dtype == dtype or x.size == 0:
        return
    x = np.asarray(x)
    if jnp.issubdtype(dtype, jnp.integer) and np.issubdtype(x.dtype, np.integer):
        info, low, high = jnp.iinfo(dtype), int(x.min()), int(x.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(
                f"{where}: leaf {keystr(path)} holds {bad}, which {jnp.dtype(dtype).name} (the "
                f"stored dtype, as JAX converts {x.dtype.name}) cannot hold: it would be "
                f"truncated. Store it in a wider leaf (an int64 example needs "
                f"jax_enable_x64), or pass values in [{info.min}, {info.max}]."
            )
    elif jnp.issubdtype(dtype, jnp.floating) and np.issubdtype(x.dtype, np.floating):
        flat = np.ravel(x)
        finite = flat[np.isfinite(flat)]
        largest = float(jnp.finfo(dtype).max)
        if finite.size and float(np.max(np.abs(finite))) > largest:
            value = float(finite[np.argmax(np.abs(finite))])
            raise ValueError(
                f"{where}: leaf {keystr(path)} holds {value!r}, past the "
                f"largest {jnp.dtype(dtype).name} ({largest:.4g}, the stored dtype, as JAX "
                f"converts {x.dtype.name}): it would become infinite. Scale it, or store it "
                "in a wider leaf."
            )


# Flashbax's factory arguments that equibuffer has no constructor argument for, and what to pass
# instead. A ported call that keeps one gets this, not Python's bare "unexpected keyword".
FLASHBAX_ONLY = {
    "sample_batch_size": (
        "pass the batch size to each call instead: `buffer.sample(key, batch_size)`"
    ),
    "sample_sequence_length": "pass `sequence_length=` (on the trajectory buffers and the Queue)",
    "add_sequences": (
        "drop it: `add` takes one step `(add_batch_size, *leaf)` or `T` steps "
        "`(add_batch_size, T, *leaf)`, told apart by the batch's rank (`ItemBuffer` and "
        "`PrioritisedItemBuffer` take it, as Flashbax's item buffer does)"
    ),
    "add_batches": (
        "drop it: every `add` has the leading `add_batch_size` axis "
        "(`add_batch_size=1` and `x[None]` for a single stream; `ItemBuffer` and "
        "`PrioritisedItemBuffer` take it, as Flashbax's item buffer does)"
    ),
    "priority_exponent": "pass `alpha=` (on the prioritised buffers)",
    "device": "drop it: one sum tree runs on every platform",
}

_Params = ParamSpec("_Params")


def flashbax_only_error(owner: str, name: str) -> TypeError:
    """The error for `name`, a Flashbax factory argument (`FLASHBAX_ONLY`) given to `owner`."""
    return TypeError(
        f"{owner}: `{name}` is a Flashbax factory argument that equibuffer does not take: "
        f"{FLASHBAX_ONLY[name]}."
    )


def refuse_flashbax_only(init: Callable[_Params, None]) -> Callable[_Params, None]:
    """Decorate a constructor so that a Flashbax-only keyword it does not take (`FLASHBAX_ONLY`)
    raises a `TypeError` naming what to pass instead."""
    taken = inspect.signature(init).parameters.keys()
    refused = FLASHBAX_ONLY.keys() - taken

    @functools.wraps(init)
    def checked(*args: _Params.args, **kwargs: _Params.kwargs) -> None:
        for name in sorted(refused & kwargs.keys()):
            owner = f"{type(args[0]).__name__}()" if args else init.__qualname__
            raise flashbax_only_error(owner, name)
        init(*args, **kwargs)

    return checked
