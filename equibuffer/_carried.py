"""How a recorded failure leaves the step it is traced in: a primitive that `checkify` turns
into its carried error, and that is nothing at all everywhere else.

`report(word)` binds `equibuffer_failure`, a primitive with no output and no effect:

- Under `jax.experimental.checkify` (the checked step, `eb.filter_jit`), its rule folds `word`
    into checkify's error value, which checkify threads out of every `scan`, `while_loop`,
    `cond`, `switch`, `jit`, `vmap`, `shard_map`, `custom_jvp`/`custom_vjp` and `remat`
    around it, as it threads its own checks. All of this library's failures share one error
    effect (one `uint32` payload): three scalars carried through a loop, whatever the number
    of checks.
- Anywhere else it lowers to nothing, so XLA drops the computation of `word` when nothing
    else uses it. It has no effect on purpose: `checkify.debug_check`, which would do the
    same, gives the jitted function an error effect, and a function with effects leaves JAX's
    fast C++ dispatch (measured: a jitted `x + 1` from 3.4 to 38 us per call).
- Dead-code elimination keeps it (as it keeps an effect), so a failure inside a gradient or a
    rematerialised function is not dropped for having no used output.

Only JAX's internal `checkify` rules table takes such a rule: where its pieces have moved the
primitive is still nothing outside the checked step, `AVAILABLE` is false, and `eb.filter_jit`
falls back to checking what the step returns (`eb.check` on its output).
"""

import functools
import importlib
import inspect
from typing import Any

import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir, partial_eval as pe
from jaxtyping import Array, UInt32


try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive  # pyright: ignore


# The message format of every carried failure: its one argument is the recorded word.
FORMAT = "equibuffer: recorded failure {0}"

failure_p = Primitive("equibuffer_failure")
failure_p.multiple_results = True  # no output


def report(word: UInt32[Array, "*batch"]) -> None:
    """Carry failure `word` (0: none) out to the checked step around the trace, if any."""
    failure_p.bind(jnp.asarray(word, jnp.uint32))


@failure_p.def_impl
def _impl(word: Any) -> list:
    return []


@failure_p.def_abstract_eval
def _abstract(word: Any) -> list:
    return []


mlir.register_lowering(failure_p, lambda ctx, word: [])


def _batched(args: tuple, dims: tuple) -> tuple[list, list]:
    (word,), (dim,) = args, dims
    failure_p.bind(jnp.max(word, axis=dim))  # any failure of the batch
    return [], []


batching.primitive_batchers[failure_p] = _batched
ad.primitive_jvps[failure_p] = lambda primals, tangents: (failure_p.bind(*primals), [])


def _kept(*args: Any) -> tuple[list[bool], Any]:
    eqn = args[-1]  # (used_outputs, [live_inputs,] eqn): the rule's signature varies
    return [True] * len(eqn.invars), eqn


pe.dce_rules[failure_p] = _kept


def _install() -> bool:
    try:
        checkify = importlib.import_module("jax._src.checkify")
        assert_func, error_checks = checkify.assert_func, checkify.error_checks
        failed, traceback = checkify.FailedCheckError, checkify.get_traceback
    except (ImportError, AttributeError):  # pragma: no cover
        return False
    # jax 0.11 and later pass the rule a context of codes first, and take it back.
    with_context = "ctx" in inspect.signature(assert_func).parameters

    def rule(*args: Any) -> tuple[Any, list]:
        context, (error, enabled, word) = (args[0], args[1:]) if with_context else (None, args)
        if failed not in enabled:
            return error, []
        new = failed(traceback(), FORMAT, word)
        check = functools.partial(assert_func, context) if with_context else assert_func
        return check(error, word != 0, new), []

    error_checks[failure_p] = rule
    return True


AVAILABLE = _install()
