"""The value checks inside jit: Equinox's `error_if`, raised from every device of a mesh.

`eqx.error_if` raises from a host callback that XLA runs on one device; on a mesh the other
devices then wait for its result (or in the step's next collective) until XLA aborts the
process. `error_if` and `branched_error_if` here keep Equinox's behaviour, messages and switch
(`EQX_ON_ERROR`), and raise through `jax.debug.callback(..., partitioned=True)`, which runs on
every device: each device fails its own part of the step, and the error surfaces at once. Under
`shard_map` the predicate is first combined over the manual mesh axes, so every device raises
even when only one device's rows are at fault.

Where that cannot be done (another `EQX_ON_ERROR` than `raise`, a TPU, whose runtime cannot
raise from a callback, an Equinox whose internals have moved, or a predicate known at trace
time) the check is Equinox's own, unchanged. It is Equinox's own too in a process with one
device, where no mesh can be (but inside `shard_map`, where Equinox's check does not trace): a
debug callback is an effect, which takes every jitted call that holds one off JAX's fast C++
dispatch (measured on the CPU: a jitted `sample` of 32 from Python
67 -> 508 us per call, `set_priorities` 35 -> 298 us; inside a scan, `set_priorities` 0.44x).
"""

import importlib
import logging
import traceback
import types
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, PyTree


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


def error_if(x: PyTree, pred: ArrayLike, msg: str) -> PyTree:
    """`eqx.error_if(x, pred, msg)`, raised from every device of a mesh (see the module)."""
    return branched_error_if(x, pred, 0, [msg])


def branched_error_if(x: PyTree, pred: ArrayLike, index: ArrayLike, msgs: Sequence[str]) -> PyTree:
    """`eqx.branched_error_if(x, pred, index, msgs)`, raised from every device of a mesh."""
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
