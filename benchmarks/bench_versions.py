"""This version of the buffers against another, paired in one process: the refactor check.

Another version of the package is imported as `equibuffer_old` from a folder (make one with
`git worktree add /tmp/old <commit> && mkdir /tmp/oldpkg && cp -r /tmp/old/equibuffer
/tmp/oldpkg/equibuffer_old`; the package imports itself relatively only). Every operation runs
`K` times inside one `lax.scan` per jitted call (the way a training step uses a buffer), donated,
and the two versions are timed in ABBA rounds (the second of two back-to-back calls runs
slower here, whichever version it is); the figure is the median over the rounds of old time /
new time (above 1: this version is faster); with `--instances N`, the median of that over N pairs
of fresh buffers built in alternating order (two instances of one version differ by several
percent on a memory-bound add).

Operations: add of one step (batch 1 and 128), add of 16 steps (batch 8), uniform sample of
trajectories and of transitions, prioritised sample and `set_priorities`, each for float32 steps
`(32, 32, 3)` at a 100,000-step capacity (`--quick`: `(8,)` steps, 4,096). And the prioritised
n-step transition buffer of this version (n = 3) against the old prioritised trajectory buffer
of length n + 1, the composition it replaces.

    python -m benchmarks.bench_versions --against /tmp/oldpkg [--quick] [--rounds 15]
"""

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb

from ._timing import materialise, table


K = 20  # operations per jitted call (--k)
BATCH = 256


def _example(shape: tuple[int, ...]) -> dict[str, Any]:
    return {
        "obs": jnp.zeros(shape, jnp.float32),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
    }


def _steps(example: dict[str, Any], rows: int, t: int | None) -> dict[str, Any]:
    lead = (rows,) if t is None else (rows, t)
    return jax.tree.map(lambda x: jnp.ones(lead + x.shape, x.dtype), example)


class _Op:
    """One operation of one version: a donated, jitted `lax.scan` of `K` operations over a
    buffer kept between calls."""

    def __init__(self, buffer: Any, body: Callable[[Any, Any], Any], carry_buffer: bool):
        self.buffer = buffer
        self.carry_buffer = carry_buffer

        if carry_buffer:

            @eqx.filter_jit(donate="all-except-first")
            def run(key: Any, buffer: Any) -> Any:
                keys = jax.random.split(key, K)
                return jax.lax.scan(lambda b, k: (body(b, k), None), buffer, keys)[0]

        else:

            @eqx.filter_jit
            def run(key: Any, buffer: Any) -> Any:
                keys = jax.random.split(key, K)
                return jax.lax.scan(lambda acc, k: (acc + body(buffer, k), None), 0.0, keys)[0]

        self.run = run
        self.key = jax.random.key(0)

    def __call__(self) -> Any:
        out = self.run(self.key, self.buffer)
        if self.carry_buffer:
            self.buffer = out
            return jax.tree.leaves(out)[0]
        return out


def _ops(lib: Any, shape: tuple[int, ...], capacity: int, new_api: bool) -> dict[str, Any]:
    """Builders of every operation's buffer and body for one version (`lib`)."""
    ex = _example(shape)

    # The batch first: it is kept (reused), the buffer donated.
    add = eqx.filter_jit(lambda batch, buffer: buffer.add(batch), donate="all-except-first")

    def filled(make: Callable[[], Any], rows: int) -> Any:
        buffer = make()
        chunk = max(1, min(64, buffer.storage.length))
        batch = _steps(ex, rows, chunk)
        for _ in range(-(-buffer.storage.length // chunk)):
            buffer = add(batch, buffer)
        return buffer

    def traj(rows: int) -> Any:
        return lib.TrajectoryBuffer(ex, add_batch_size=rows, capacity=capacity, sequence_length=8)

    def trans(rows: int) -> Any:
        return lib.TransitionBuffer(ex, add_batch_size=rows, capacity=capacity)

    def ptraj(rows: int, length: int = 8) -> Any:
        return lib.PrioritisedTrajectoryBuffer(
            ex, add_batch_size=rows, capacity=capacity, sequence_length=length
        )

    def sample(buffer: Any, key: Any) -> Any:
        return materialise(buffer.sample(key, BATCH).experience)

    def psample(buffer: Any, key: Any) -> Any:
        return materialise(buffer.sample(key, BATCH, beta=0.4).experience)

    def set_priorities(buffer: Any, key: Any) -> Any:
        s = buffer.sample(key, BATCH, beta=0.4)
        return buffer.set_priorities(s, jax.random.uniform(key, (BATCH,)) + 0.1)

    one, batched, seq = _steps(ex, 1, None), _steps(ex, 128, None), _steps(ex, 8, 16)
    ops: dict[str, Any] = {
        "add 1 step, batch 1, trajectory": (lambda: traj(1), lambda b, k: b.add(one), True),
        "add 1 step, batch 128, trajectory": (lambda: traj(128), lambda b, k: b.add(batched), True),
        "add 16 steps, batch 8, trajectory": (lambda: traj(8), lambda b, k: b.add(seq), True),
        "add 1 step, batch 128, transition": (
            lambda: trans(128),
            lambda b, k: b.add(batched),
            True,
        ),
        "add 1 step, batch 128, prioritised": (
            lambda: ptraj(128),
            lambda b, k: b.add(batched),
            True,
        ),
        "sample, trajectory": (lambda: filled(lambda: traj(8), 8), sample, False),
        "sample, transition": (lambda: filled(lambda: trans(8), 8), sample, False),
        "sample, prioritised trajectory": (lambda: filled(lambda: ptraj(8), 8), psample, False),
        "set_priorities 256, prioritised trajectory": (
            lambda: filled(lambda: ptraj(8), 8),
            set_priorities,
            True,
        ),
    }
    # The new prioritised n-step buffer (n = 3) against the old composition it replaces, a
    # prioritised trajectory buffer of n + 1 = 4 steps.
    if new_api:
        nstep = lambda: lib.PrioritisedTransitionBuffer(  # noqa: E731
            ex, add_batch_size=8, capacity=capacity, n_step=3, discount=0.99
        )
    else:
        nstep = lambda: ptraj(8, 4)  # noqa: E731
    versus = "(old: prioritised trajectory of 4)"
    ops[f"n-step sample {versus}"] = (lambda: filled(nstep, 8), psample, False)
    ops[f"n-step add 16 steps {versus}"] = (nstep, lambda b, k: b.add(seq), True)
    ops[f"n-step set_priorities {versus}"] = (lambda: filled(nstep, 8), set_priorities, True)
    return ops


def abba(a: Callable[[], Any], b: Callable[[], Any], rounds: int) -> dict[str, float]:
    """`a` and `b` timed in ABBA order, `rounds` times after warm-up: the second of two
    back-to-back calls runs measurably slower here (10 to 15% on a 0.3 ms call, the same
    version timed against itself), so each round runs both orders. Returns the best time of
    each and the median over rounds of `a`'s time / `b`'s (above 1: `b` is faster)."""
    for fn in (a, b, a, b):
        jax.block_until_ready(fn())

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    ta, tb = [], []
    for _ in range(rounds):
        a1, b1, b2, a2 = timed(a), timed(b), timed(b), timed(a)
        ta.append(a1 + a2)
        tb.append(b1 + b2)
    ratio = float(np.median(np.array(ta) / np.array(tb)))
    return {"a": min(ta) / 2, "b": min(tb) / 2, "a/b": ratio}


def main() -> None:
    global K
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a folder holding `equibuffer_old`")
    parser.add_argument("--quick", action="store_true", help="small steps and capacity")
    parser.add_argument("--rounds", type=int, default=15, help="timed pairs per operation")
    parser.add_argument("--only", default="", help="run the operations whose name has this")
    parser.add_argument("--k", type=int, default=20, help="operations per jitted call")
    parser.add_argument(
        "--instances", type=int, default=1, help="fresh buffer pairs per operation (median)"
    )
    args = parser.parse_args()
    K = args.k
    sys.path.insert(0, args.against)
    old = importlib.import_module("equibuffer_old")
    shape, capacity = ((8,), 4096) if args.quick else ((32, 32, 3), 100_000)
    new_ops = _ops(eb, shape, capacity, new_api=True)
    old_ops = _ops(old, shape, capacity, new_api=False)
    rows = []
    for name, (make, body, carry) in new_ops.items():
        if args.only not in name:
            continue
        old_make, old_body, _ = old_ops[name]
        results = []
        for i in range(args.instances):
            # Fresh buffers for each instance pair, built in alternating order: two instances
            # of one version can differ by several percent (where their memory lands).
            if i % 2 == 0:
                new_op = _Op(make(), body, carry)
                old_op = _Op(old_make(), old_body, carry)
            else:
                old_op = _Op(old_make(), old_body, carry)
                new_op = _Op(make(), body, carry)
            results.append(abba(old_op, new_op, args.rounds))
            del new_op, old_op
        rows.append(
            {
                f"operation (x K={K} in a scan)": name,
                "old": f"{min(t['a'] for t in results) * 1e3:.3g} ms",
                "new": f"{min(t['b'] for t in results) * 1e3:.3g} ms",
                "old / new": f"{float(np.median([t['a/b'] for t in results])):.2f}x",
                "per instance pair": " ".join(f"{t['a/b']:.2f}" for t in results),
            }
        )
        print(table(rows[-1:]) if len(rows) == 1 else table(rows).splitlines()[-1], flush=True)
    print()
    print(f"steps {shape} float32, capacity {capacity}, sample batch {BATCH}, K={K}")
    print(table(rows))


if __name__ == "__main__":
    main()
