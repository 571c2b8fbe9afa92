"""Timing shared by the benchmark scripts: best-of-N wall time of a function whose result is
blocked on, after warm-up (compilation) calls, the alternating timing of two functions,
forcing a sampled batch into memory, a state held across jitted calls (donated), and a
measuring script run in a process of its own. Benchmarks report ratios, never assert speed."""

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


class Held:
    """The array leaves of a state (a module or any pytree: both libraries go through this
    one harness), split from its static part once and kept across calls, so that a timed
    call is one `jax.jit` dispatch of the work (as for Flashbax's plain-pytree state) and not
    a partition/combine in Python each time."""

    def __init__(self, state: Any):
        self.arrays, self.static = eqx.partition(state, eqx.is_array)

    def state(self) -> Any:
        return eqx.combine(self.arrays, self.static)

    def update(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A call running `state = fn(state, *args)` jitted, the arrays donated (in place)."""
        static = self.static

        def run(arrays, *args):
            return eqx.partition(fn(eqx.combine(arrays, static), *args), eqx.is_array)[0]

        jitted = jax.jit(run, donate_argnums=0)

        def call(*args: Any) -> Any:
            self.arrays = jitted(self.arrays, *args)
            return self.arrays

        return call

    def read(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A call returning `fn(state, *args)` jitted (the state is not changed)."""
        static = self.static
        jitted = jax.jit(lambda arrays, *args: fn(eqx.combine(arrays, static), *args))
        return lambda *args: jitted(self.arrays, *args)


def materialise(tree: Any) -> jax.Array:
    """A float32 scalar that depends on every element of `tree` being computed in memory: the
    optimisation barrier stops XLA from fusing a gather into its consumer (or slicing it down
    to the one element read), as a learner's first matmul would."""
    leaves = jax.lax.optimization_barrier(jax.tree.leaves(tree))
    return jnp.stack([leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves]).sum()


def best_time(fn: Callable[[], Any], *, repeat: int = 20, warmup: int = 2) -> float:
    """Best wall time in seconds of `fn()` over `repeat` calls, blocking on its result."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def paired_times(
    a: Callable[[], Any], b: Callable[[], Any], *, repeat: int, warmup: int = 3
) -> dict[str, float]:
    """Time `a` and `b` in alternation, `repeat` pairs after `warmup` calls of each: the best
    wall time of each (`"a"`, `"b"`, seconds) and the median over the pairs of `b`'s time /
    `a`'s (`"ratio"`). On a machine whose speed drifts (this one's memory bandwidth moves by
    2x within minutes) the paired median is the steadier ratio."""
    for _ in range(warmup):
        jax.block_until_ready(a())
        jax.block_until_ready(b())
    times = []
    for _ in range(repeat):
        pair = []
        for fn in (a, b):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            pair.append(time.perf_counter() - t0)
        times.append(pair)
    ta, tb = np.array(times).T
    return {"a": float(ta.min()), "b": float(tb.min()), "ratio": float(np.median(tb / ta))}


def fmt_time(seconds: float) -> str:
    """`1.23 ms`-style formatting."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of dict rows (same keys), for benchmark output."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(keys), line(["-" * w for w in widths]), *map(line, cells)])


def worker_json(
    script: str, args: list[str], env: dict[str, str], timeout: float, what: str
) -> Any:
    """Run the Python `script` with `args` in a fresh process (its own devices and memory,
    from `env`) and return the JSON of the last line it prints; its failure raises, naming
    `what` ran, with the end of its standard error."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
