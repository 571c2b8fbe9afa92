"""The value checks inside jit, and how their failures reach the user.

A check is `error_if(x, pred, msg)` (or `branched_error_if`, one of several messages): `x`
is returned unchanged, and the failure `pred` is reported in one of these ways, chosen by
`EQX_ON_ERROR` (Equinox's switch, read once at import):

- **unset (the default): recorded.** Inside a buffer method marked `@recorded` (every
    `add`, `sample`, `set_priorities` of every kind), a traced check costs no conditional
    and no host callback: its message's code is folded into one `uint32` word per call,
    kept in what the method returns (the error word of every buffer's storage,
    `Sample.error` of every sample, whose floating leaves are then NaN; the first failure
    is kept), and carried out of the traced step (`_carried`: `checkify` threads it through
    every loop, branch, `vmap` and `shard_map`). A step compiled with `eb.filter_jit` raises
    it, as an `EquinoxRuntimeError` with the check's message, when the call returns, whether
    or not the step returns what failed. Otherwise it is raised at the next host-side use:
    `eb.check(tree)`, any eager method call on that buffer, `set_priorities` given that
    sample, `Archive.write`. An eager check (concrete values) raises at once. A check that
    guards a write is a refusal: the method writes nothing then.
    Measured on an NVIDIA H200: a conditional whose branch calls back into Python makes the
    device wait for the host at every call (~27 us per check; shared/gpu/README.md).
- `EQX_ON_ERROR=raise`: **immediate**, the debugging mode: each check is Equinox's
    `eqx.error_if`, raised inside the jitted call that failed (at the cost above). On a
    mesh it is raised from every device through `jax.debug.callback(..., partitioned=True)`
    (Equinox's own runs on one device, and the others then wait in the step's next
    collective until XLA aborts); under `shard_map` the predicate is first combined over
    the manual axes.
- `EQX_ON_ERROR=off`: no check at all. `nan` and `breakpoint`: Equinox's own.

A check outside any `@recorded` method (`SumTree.set`/`get` used on their own,
`steps_added()` inside jit) has no carrier for its word and is Equinox's own.
"""

import contextvars
import functools
import importlib
import logging
import os
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import checkify
from jaxtyping import ArrayLike, PyTree

from . import _carried
from ._carried import FORMAT, report


# The pieces of Equinox and JAX that make a runtime error read as `eqx.error_if`'s: where they
# have moved, the checks are Equinox's own.
_eqx_jit: Any = None
_EquinoxRuntimeError: Any = None
traceback_util: Any = None
EQX_ON_ERROR: Any = None
try:
    _eqx_jit = importlib.import_module("equinox._jit")
    _EquinoxRuntimeError = importlib.import_module("equinox._errors")._EquinoxRuntimeError
    EQX_ON_ERROR = importlib.import_module("equinox._config").EQX_ON_ERROR
    traceback_util = importlib.import_module("jax._src.traceback_util")
    _ = _eqx_jit.last_error_info
    traceback_util.register_exclusion(__file__)
    _INTERNALS = True
except (ImportError, AttributeError):  # pragma: no cover
    _INTERNALS = False


class _QuietFailedCheck(logging.Filter):
    """Drop JAX's log of a check raised from a debug callback (one per device, each with a
    traceback): the error itself is what reaches the user, as with `eqx.error_if`."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (_INTERNALS and isinstance(error, _EquinoxRuntimeError))


logging.getLogger("jax._src.debugging").addFilter(_QuietFailedCheck())


# "record" unless `EQX_ON_ERROR` is set (Equinox's own default, "raise", is then the debugging
# mode of immediate errors).
MODE: str = os.environ.get("EQX_ON_ERROR", "record")

# The messages of the checks traced in this process: a recorded word is an index into it
# (0: no failure). Messages are registered at trace time, so the words of a program compiled
# in this process read back as its own messages.
_MESSAGES: list[str] = [""]
_CODES: dict[str, int] = {}
# The words of the checks traced inside the outermost `@recorded` method being traced.
_COLLECTED: contextvars.ContextVar[list[jax.Array] | None] = contextvars.ContextVar(
    "equibuffer_checks", default=None
)


def _code(msg: str) -> int:
    code = _CODES.get(msg)
    if code is None:
        code = _CODES[msg] = len(_MESSAGES)
        _MESSAGES.append(msg)
    return code


def _traced(*xs: Any) -> bool:
    return any(isinstance(x, Tracer) for x in xs)


def error_if(x: PyTree, pred: ArrayLike, msg: str) -> PyTree:
    """A check of `pred` (fail when true) with one message; returns `x` (see the module)."""
    return branched_error_if(x, pred, 0, [msg])


def branched_error_if(x: PyTree, pred: ArrayLike, index: ArrayLike, msgs: Sequence[str]) -> PyTree:
    """A check of `pred` with the message `msgs[index]`; returns `x` (see the module)."""
    if MODE == "record":
        if not _traced(pred, index):
            if bool(np.any(np.asarray(pred))):
                raise eqx.EquinoxRuntimeError(msgs[int(np.max(np.asarray(index)))])
            return x
        collected = _COLLECTED.get()
        if collected is not None:
            codes = jnp.asarray([_code(m) for m in msgs], jnp.uint32)
            which = jnp.asarray(index, jnp.int32)
            word = jnp.where(jnp.asarray(pred), codes[which], jnp.uint32(0))
            collected.append(jnp.max(word) if word.ndim else word)
            return x
    if (
        not _INTERNALS
        or EQX_ON_ERROR != "raise"
        or isinstance(pred, bool)
        or jax.default_backend() == "tpu"
        or not (several_devices() or _manual_axes())
    ):
        return eqx.branched_error_if(x, pred, index, msgs)
    return _check(x, pred, index, tuple(msgs))


def several_devices() -> bool:
    """Whether the process has more than one device, so that a step may run on a mesh: only
    then is a check raised from every device (at its cost per call; see the module)."""
    return jax.device_count() > 1


def _stack() -> list[bytes | str]:
    """The frames the check is called from, innermost first, as `eqx.filter_jit` prints them
    above the message (the ids of the `filter_jit` calls crossed mark where to stop)."""
    stack: list[bytes | str] = []
    for frame, line in traceback.walk_stack(None):
        jit_id = frame.f_locals.get("__equinox_jit_id__")
        if isinstance(jit_id, bytes):
            stack.append(jit_id)
        if traceback_util.include_frame(frame):
            tb = types.TracebackType(None, frame, frame.f_lasti, line)
            stack.append("".join(traceback.format_tb(tb)))
    return stack


def _manual_axes() -> tuple[str, ...]:
    """The mesh axes that the code being traced runs per device over (inside `shard_map`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


@eqx.filter_jit
def _check(x: PyTree, pred: ArrayLike, index: ArrayLike, msgs: tuple[str, ...]) -> PyTree:
    stack = _stack()
    pred = eqx.internal.unvmap_any(jnp.asarray(pred))
    which: jax.Array = eqx.internal.unvmap_max(jnp.asarray(index, jnp.int32))
    axes = _manual_axes()
    if axes:  # every device raises, with the largest index among the devices that raise
        which = jax.lax.pmax(jnp.where(pred, which, -1), axes)
        pred = which >= jnp.int32(0)

    def fail(i: Any) -> None:
        msg = msgs[int(i)]
        _eqx_jit.last_error_info = (msg, stack)  # what `eqx.filter_jit` reports
        raise _EquinoxRuntimeError(
            f"{msg}\n\n(Raised inside a jitted function: wrap it in `equinox.filter_jit` "
            "rather than `jax.jit` for a report of where the check was called from.)"
        )

    def failed(dynamic: PyTree, index: jax.Array) -> PyTree:
        jax.debug.callback(fail, index, partitioned=True)
        return dynamic

    dynamic, static = eqx.partition(x, eqx.is_array)
    dynamic = _on_error(dynamic, pred, which, failed)
    return eqx.combine(dynamic, static)


@eqx.filter_custom_jvp
def _on_error(dynamic: PyTree, pred: jax.Array, index: jax.Array, failed: Any) -> PyTree:
    # The condition stays outside differentiation, as in Equinox: a tangent passes unchanged.
    return jax.lax.cond(pred, failed, lambda d, _: d, dynamic, index)


@_on_error.def_jvp
def _on_error_jvp(primals: tuple, tangents: tuple, **kwargs: Any) -> tuple:
    dynamic, pred, index, failed = primals
    return _on_error(dynamic, pred, index, failed), tangents[0]


# ---------------------------------------------------------------------- recorded failures

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _carries(x: Any) -> bool:
    """A ring (its error word) or a sample (`error`): what a recorded failure is kept in."""
    return hasattr(type(x), "with_error")


def recorded(method: _Method) -> _Method:
    """Mark a buffer method whose traced checks are recorded (see the module): the words of
    every check traced inside it, and inside the methods it calls, are folded into one and
    kept in what it returns (the first ring of a returned buffer, every returned sample).
    Called eagerly on a buffer holding a recorded failure, it raises that failure first."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if MODE != "record" or _COLLECTED.get() is not None:
            return method(self, *args, **kwargs)
        check(self, traced_ok=True)
        token = _COLLECTED.set([])
        try:
            out = method(self, *args, **kwargs)
            words = _COLLECTED.get()
        finally:
            _COLLECTED.reset(token)
        if not words:
            return out
        word = _fold(words)
        report(word)  # carried out of the step to `filter_jit` (nothing elsewhere: `_carried`)
        return _attach(out, word)

    return wrapper  # pyright: ignore[reportReturnType]


def record(word: jax.Array) -> None:
    """Fold an already recorded word (a sample's `error`, passed back to `set_priorities`)
    into the checks of the method being traced; an eager one raises at once."""
    if MODE != "record":
        return
    if not _traced(word):
        raise_recorded(int(np.max(np.asarray(word))))
        return
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(jnp.asarray(word, jnp.uint32))


def failure_in(fn: Callable[[], Any]) -> jax.Array:
    """The first failure recorded by the checks traced inside `fn()` (0 when none failed,
    and wherever nothing is recorded: outside a `@recorded` method, or when `EQX_ON_ERROR`
    is set); what `fn` returns is dropped. The failures stay recorded for the method being
    traced. (How a `Mixer` learns that one source refused an update, so that every source
    refuses it.)"""
    collected = _COLLECTED.get()
    start = 0 if collected is None else len(collected)
    fn()
    if collected is None or len(collected) == start:
        return jnp.uint32(0)
    return first_failure(*collected[start:])


def first_failure(*words: ArrayLike) -> jax.Array:
    """The first nonzero (failed) word among `words`, in their order (0 when none failed): a
    failure already recorded is kept."""
    word = jnp.asarray(words[0])
    for w in words[1:]:
        word = jnp.where(word != 0, word, w)
    return word


def cleared(words: ArrayLike, code: int) -> jax.Array:
    """`words` with failure `code` cleared (0) where recorded; another failure stays."""
    words = jnp.asarray(words, jnp.uint32)
    return jnp.where(words == jnp.uint32(code), jnp.uint32(0), words)


def _fold(words: list[jax.Array]) -> jax.Array:
    """The first failure among `words` (in the order checked), one word for every batch
    element under `vmap` and for every device under `shard_map`."""
    word = first_failure(*words)
    # Unbatched under vmap, as the counters it joins (so `can_sample()` stays unbatched).
    word = eqx.internal.unvmap_max(word)
    axes = _manual_axes()
    if axes:
        word = jax.lax.pmax(word, axes)
    return word


def _attach(out: Any, word: jax.Array) -> Any:
    """`out` with failure `word` recorded in every buffer and sample it holds (a sample's
    floating leaves are then NaN, so that a loss computed from it shows the failure)."""
    kept = [False]

    def put(x: Any) -> Any:
        if not _carries(x):
            return x
        kept[0] = True
        return x.with_error(word)

    out = jax.tree.map(put, out, is_leaf=_carries)
    if not kept[0]:  # a failure must never be dropped: a method marked wrongly
        raise TypeError(f"internal: a @recorded method returned no buffer or sample: {out!r}")
    return out


def poisoned(tree: PyTree, word: jax.Array) -> PyTree:
    """`tree` with every floating leaf NaN where failure `word` is recorded (nonzero): what a
    sample drawn from a state that cannot be sampled holds, as Equinox's `EQX_ON_ERROR=nan`
    makes of a failed check's output."""

    def nan(x: Any) -> Any:
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.where(word != 0, jnp.array(jnp.nan, x.dtype), x)
        return x

    return jax.tree.map(nan, tree)


# ------------------------------------------------------------- failures under `filter_jit`


def _raise_checked(error: Any, output: Any) -> None:
    """Raise the failure that the checked call's `checkify` error holds (read on the host,
    one copy), with `output` (what the call returned) as the exception's `output`."""
    error = jax.device_get(error)
    exc = error.get_exception()
    if exc is None:
        return
    mapping = getattr(exc, "error_mapping", None)  # under shard_map: one error per device
    if mapping:
        exc = next(iter(mapping.values()))
    if getattr(exc, "fmt_string", None) == FORMAT:
        code = int(np.max(np.asarray(exc.args[0])))
        failure = _recorded_error(code, checked=True)
        output = _acknowledged(output, code)
    else:  # a user's own `checkify.check`, raised as checkify raises it
        failure = checkify.JaxRuntimeError(str(exc))
    failure.output = output  # pyright: ignore[reportAttributeAccessIssue]
    raise failure


def _acknowledged(tree: PyTree, code: int) -> PyTree:
    """`tree` with failure `code`, raised now, cleared from every buffer that recorded it:
    the operation it refused changed nothing, so the user who caught the error goes on with
    those buffers (writes them to an `Archive`, uses them eagerly) without it raised again.
    A sample keeps its failure: its floating leaves are NaN. Another failure stays."""

    def ring(x: Any) -> bool:
        return hasattr(type(x), "without_error")

    return jax.tree.map(lambda x: x.without_error(code) if ring(x) else x, tree, is_leaf=ring)


def raise_recorded(code: int) -> None:
    """Raise the failure of recorded word `code` (a Python int), if any."""
    if code:
        raise _recorded_error(code)


def _recorded_error(code: int, *, checked: bool = False) -> Exception:
    """The error of recorded word `code` (nonzero): one found by the checked step around the
    call (`checked`), or one recorded in a buffer or sample."""
    msg = _MESSAGES[code] if code < len(_MESSAGES) else f"(failure {code} of another process)"
    how = (
        "Raised when the checked step (`eb.filter_jit`) returned; `error.output` holds what it "
        "returned"
        if checked
        else "Recorded inside a jitted call and raised at the first use outside jit"
    )
    return eqx.EquinoxRuntimeError(
        f"{msg}\n\n({how}; run with EQX_ON_ERROR=raise to raise inside the call that failed.)"
    )


def check(tree: PyTree[Any], *, traced_ok: bool = False) -> None:
    """Raise the first failure that a check recorded inside jit in any buffer or sample of
    `tree`; return `None` when there is none.

    Inside a jitted step, a failed check (sampling a buffer that `can_sample()` says is not
    ready, a negative priority, a full `Queue`, ...) does not stop the device: it is
    recorded in what the method returns, every buffer's storage (`buffer.storage.error`)
    and sample (`sample.error`; a failed sample's floating leaves are also NaN), at the cost
    of a few scalar operations and no wait for the host; a refused write changed no data.
    `check` reads those words with one copy to the host and raises the first failure as an
    `equinox.EquinoxRuntimeError` with the check's own message. Call it on what a step
    compiled with plain `eqx.filter_jit` or `jax.jit` returns (a train state, a sample, any
    pytree holding them), when you log. It sees only what the step returns: a sample used
    inside the step and not returned shows its failure only as NaN. A step compiled with
    [`equibuffer.filter_jit`][] raises every failure anywhere inside it when the call
    returns, returned or not: prefer it. An eager call raises at once, and an eager method
    of a buffer holding a failure raises it before doing anything.

    **Arguments:**

    - `tree`: any pytree; its buffers and samples are checked (other leaves are ignored).
    - `traced_ok`: what to do when `tree`'s words are traced (inside jit): nothing when
        true; by default a `TypeError` (the words are only known on the host).

    **Returns:**

    `None`. Raises `equinox.EquinoxRuntimeError` with the first recorded failure's message.

    !!! example

        ```python
        import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
        sample = eqx.filter_jit(lambda b, k: b.sample(k, 4))(buffer, jax.random.key(0))
        try:
            eb.check(sample)  # nothing was added: the sample recorded why it is not valid
        except eqx.EquinoxRuntimeError as error:
            assert "cannot be sampled yet" in str(error)
        else:
            raise AssertionError("not raised")
        eb.check(buffer.add({"x": jnp.ones((1, 2))}))  # nothing recorded: no error
        ```
    """
    words = [x.error for x in jax.tree.leaves(tree, is_leaf=_carries) if _carries(x)]
    if not words:
        return
    if _traced(*words):
        if traced_ok:
            return
        raise TypeError(
            "eb.check() reads the recorded failures on the host: call it outside jit, on what "
            "a jitted step returns."
        )
    for word in jax.device_get(words):
        raise_recorded(int(np.max(word)))


def filter_jit(fun: Callable[..., Any] | None = None, *, donate: str = "none") -> Any:
    """`equinox.filter_jit`, checked: every failure recorded by a check anywhere in the step
    is raised when the call returns, with the check's own message.

    Everywhere means at the top level of the step and inside the bodies of `lax.scan`,
    `fori_loop` and `while_loop`, the branches of `lax.cond` and `lax.switch`, under `vmap`
    and `shard_map`, and in samples, epochs and buffers whether or not the step returns them
    (a sample that only feeds the loss included). The failures are carried out of the step
    as values (`jax.experimental.checkify` carries this library's checks as it carries its
    own), so the compiled program holds no host callback, and the host reads one small value
    per call, after it. A step that runs many iterations per call (a `lax.scan` over
    environment steps) pays that read once per call.

    The exception is an `equinox.EquinoxRuntimeError` (for a `checkify.check` of your own in
    the step, `checkify`'s own error), and its `output` attribute holds what the call
    returned: a refused operation (an add over unread `Queue` steps, a NaN priority, ...)
    changed no data, so under `donate="all"`, where the arguments are gone, every step is
    still there, and the buffers there go on: the failure raised is cleared from them (it
    would otherwise be raised again at their next eager use, by `Archive.write` and by
    [`equibuffer.check`][]); a sample there keeps its failure (its floating leaves are NaN).
    Plain `jax.jit` and `eqx.filter_jit` record failures without raising: see
    [`equibuffer.check`][] and [Troubleshooting](../troubleshooting.md).

    With `EQX_ON_ERROR=off` this is `equinox.filter_jit` itself: no check at all.

    **Arguments:**

    - `fun`: the function to compile (or nothing, to use `filter_jit(donate=...)` as a
        decorator).
    - `donate`: as in `equinox.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"`.

    **Returns:**

    The compiled, checked function, with `equinox.filter_jit`'s interface (`.lower(...)` for
    the compiled program, which returns the carried failure beside the step's output).

    !!! example

        ```python
        import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

        @eb.filter_jit(donate="all")
        def step(buffer, key):
            buffer = buffer.add({"x": jnp.ones((1, 2))})
            loss = jnp.mean(buffer.sample(key, 4).experience["x"])  # the sample is not returned
            return buffer, loss

        buffer = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
        buffer, loss = step(buffer, jax.random.key(0))  # checked: nothing failed
        assert float(loss) == 1.0

        @eb.filter_jit
        def too_early(buffer, key):
            return jnp.mean(buffer.sample(key, 4).experience["x"])

        empty = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
        try:
            too_early(empty, jax.random.key(0))
        except eqx.EquinoxRuntimeError as error:
            assert "cannot be sampled yet" in str(error)
            assert jnp.isnan(error.output)  # what the call returned: the loss of a failed draw
        else:
            raise AssertionError("not raised")
        ```
    """
    if fun is None:
        return functools.partial(filter_jit, donate=donate)
    if MODE == "off":
        return eqx.filter_jit(fun, donate=donate)  # pyright: ignore[reportArgumentType]
    if not _carried.AVAILABLE:  # checkify's rules moved: check what the step returns only
        return _checking_outputs(fun, donate)

    @functools.wraps(fun)
    def carried(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
        returned: list[Any] = []

        def arrays_only(dynamic: Any) -> Any:
            args, kwargs = eqx.combine(dynamic, static)
            out_dynamic, out_static = eqx.partition(fun(*args, **kwargs), eqx.is_array)
            returned.append(out_static)
            return out_dynamic

        error, out = checkify.checkify(arrays_only, errors=checkify.user_checks)(dynamic)
        # The error value's leaves as a plain tuple (its pytree of dicts costs the call from
        # Python to flatten and rebuild), its structure kept aside, at trace time.
        leaves, structure = jax.tree.flatten(error)
        return _failed(error), tuple(leaves), structure, eqx.combine(out, returned[0])

    jitted = eqx.filter_jit(carried, donate=donate)  # pyright: ignore[reportArgumentType]

    @functools.wraps(fun)
    def checked(*args: Any, **kwargs: Any) -> Any:
        failed, leaves, structure, out = jitted(*args, **kwargs)
        if isinstance(failed, Tracer):  # called inside another trace: passed outwards
            _pass_on(jax.tree.unflatten(structure, leaves))
        elif np.asarray(failed):  # the one read per call (the whole error only on failure)
            _raise_checked(jax.tree.unflatten(structure, leaves), out)
        return out

    # eqx.filter_jit's `lower`, for the compiled program (neither is typed as having one)
    checked.lower = jitted.lower  # pyright: ignore[reportAttributeAccessIssue, reportFunctionMemberAccess]
    return checked


def _checking_outputs(fun: Callable[..., Any], donate: str) -> Callable[..., Any]:
    """`eqx.filter_jit(fun)` with [`equibuffer.check`][] on every call's output: what the
    checked step falls back to where the failure cannot be carried out of the step (a JAX
    whose `checkify` no longer takes the library's rule, see `_carried`)."""
    jitted = eqx.filter_jit(fun, donate=donate)  # pyright: ignore[reportArgumentType]

    @functools.wraps(fun)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = jitted(*args, **kwargs)
        check(out, traced_ok=True)
        return out

    checked.lower = jitted.lower  # pyright: ignore[reportAttributeAccessIssue, reportFunctionMemberAccess]
    return checked


def _failed(error: Any) -> jax.Array:
    """Whether `checkify`'s carried `error` holds a failure (0-d bool, on the device): what
    the host reads after every checked call. Reading the whole error value costs about 45 us
    per call from Python (`jax.device_get` of its leaves, measured on this 2-core CPU), one
    scalar about 1."""
    preds = getattr(error, "_pred", None)
    if preds is None:  # pragma: no cover (where checkify keeps its predicates elsewhere)
        return jnp.array(True)
    failed = jnp.array(False)
    for pred in preds.values():
        failed = failed | jnp.any(pred)
    return failed


def _pass_on(error: Any) -> None:
    """Hand a checked step's carried failure to the trace it is called in (to a checked step
    around it; nothing under plain `jit`)."""
    _check_error = getattr(importlib.import_module("jax._src.checkify"), "_check_error", None)
    if _check_error is not None:
        _check_error(error, debug=True)
