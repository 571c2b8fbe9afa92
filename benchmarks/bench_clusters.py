"""The clustered prioritised buffer as K grows: one jitted, donated call per operation.

`eb.PrioritisedClusteredBuffer` of K = 4, 16 and 64 clusters of `--capacity` slots each
(default 4,096; 1,024 with `--quick`), every cluster full, items `obs (4,)` float32 and a
float32 reward, `add_batch_size=8`. Operations, each one jitted call with the buffer donated
(the way a training loop steps it):

- `add`: one step of the 8 rows (8 items, routed over the clusters);
- `sample+set`: `sample(key, 256, beta=0.4)` then `set_priorities` of the sample (the
    prioritised training step without the learner);
- `sample+set, row_blocks=4`: the same with `row_blocks=4` (the per-device law).

Each figure is the median over rounds of the time per call in a block of `--calls`
back-to-back calls, the operations rotated round by round. To compare two versions of the
library, run this script in each checkout, alternating the runs, and compare the medians.

    python -m benchmarks.bench_clusters [--quick] [--json PATH]
"""

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb

from ._machine import describe
from ._timing import fmt_time, Held, table


EXAMPLE = {"obs": jnp.zeros(4), "reward": jnp.float32(0)}
ROWS = 8
BATCH = 256
CLUSTERS = (4, 16, 64)


def _buffer(k: int, capacity: int) -> eb.PrioritisedClusteredBuffer:
    """A buffer of `k` full clusters, each item's priority set once (so that the leaves
    differ)."""
    buffer = eb.PrioritisedClusteredBuffer(
        EXAMPLE,
        add_batch_size=ROWS,
        num_clusters=k,
        cluster_capacity=capacity,
        cluster_fn=lambda item: item["obs"][0].astype(jnp.int32) % k,
        alpha=0.6,
    )
    steps = 256
    add = jax.jit(lambda b, x: b.add(x))
    for start in range(0, k * capacity // ROWS, steps):
        ids = start * ROWS + jnp.arange(ROWS * steps, dtype=jnp.float32).reshape(steps, ROWS).T
        obs = jnp.broadcast_to(ids[..., None], (ROWS, steps, 4))
        buffer = add(buffer, {"obs": obs, "reward": ids})
    update = jax.jit(lambda b, key: b.set_priorities(s := b.sample(key, BATCH), s.weights + 0.5))
    for i in range(8):
        buffer = update(buffer, jax.random.key(i))
    return buffer


def _operations() -> dict[str, Callable[[Any, Any], Any]]:
    """Each operation: `(buffer, key) -> buffer`."""
    step = {
        "obs": jnp.arange(ROWS * 4, dtype=jnp.float32).reshape(ROWS, 4),
        "reward": jnp.ones(ROWS),
    }

    def train(row_blocks: int) -> Callable[[Any, Any], Any]:
        def call(buffer: Any, key: Any) -> Any:
            sample = buffer.sample(key, BATCH, beta=0.4, row_blocks=row_blocks)
            return buffer.set_priorities(sample, sample.weights * 0.5 + 0.1)

        return call

    return {
        "add": lambda buffer, key: buffer.add(step),
        "sample+set": train(1),
        "sample+set, row_blocks=4": train(4),
    }


def time_clusters(k: int, capacity: int, rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each operation on a buffer of `k` full clusters."""
    buffer = _buffer(k, capacity)
    keys = list(jax.random.split(jax.random.key(1), calls))
    held, runs = {}, {}
    for name, fn in _operations().items():
        held[name] = Held(jax.tree.map(jnp.copy, buffer))
        runs[name] = held[name].update(fn)
        for key in keys:  # compile and warm up
            runs[name](key)
        jax.block_until_ready(held[name].arrays)
    names = list(runs)
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for key in keys:
                runs[name](key)
            jax.block_until_ready(held[name].arrays)
            per_call[name].append((time.perf_counter() - t0) / calls)
    return {name: float(np.median(times)) for name, times in per_call.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small clusters, few rounds")
    parser.add_argument("--capacity", type=int, default=None, help="slots per cluster")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed block")
    parser.add_argument("--json", default=None, help="write the figures (seconds) here")
    args = parser.parse_args()
    capacity = args.capacity or (1024 if args.quick else 4096)
    rounds = args.rounds or (5 if args.quick else 15)
    print(f"equibuffer from {eb.__file__}; {capacity} slots per cluster, batch {BATCH}")
    rows, figures = [], {}
    for k in CLUSTERS:
        times = time_clusters(k, capacity, rounds, args.calls)
        figures[str(k)] = times
        rows.append({"K": str(k), **{name: fmt_time(t) for name, t in times.items()}})
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe(), "capacity": capacity, "figures": figures}, f)


if __name__ == "__main__":
    main()
