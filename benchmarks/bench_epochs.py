"""An epoch without replacement against the same number of `sample` calls (`nox -s bench --
epochs`; `--quick` for small sizes).

One jitted call plans an epoch of a full `TransitionBuffer` (`buffer.epoch`) and runs every
batch of it in a `lax.fori_loop` (`buffer.epoch_batch`), each batch forced into memory; the
other runs as many `sample` calls of the same batch size in the same loop. The ratio (paired
median, epoch / sample) is what an epoch costs over drawing with replacement: the plan (a
shuffle of every candidate window) and the check that no planned window was overwritten.
Ratios only, never pass/fail."""

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import equibuffer as eb

from ._timing import fmt_time, materialise, paired_times, table


def _buffer(capacity: int, rows: int, obs: int) -> eb.TransitionBuffer:
    example = {"obs": jnp.zeros(obs), "reward": jnp.float32(0)}
    buffer = eb.TransitionBuffer(example, add_batch_size=rows, capacity=capacity)
    length = capacity // rows
    steps = {
        "obs": jnp.ones((rows, length, obs)),
        "reward": jnp.ones((rows, length), jnp.float32),
    }
    return buffer.add(steps)


def measure(capacity: int, batch_size: int, rows: int, obs: int, repeat: int) -> dict:
    """One row of the table: a whole epoch against as many `sample` calls, paired."""
    buffer = _buffer(capacity, rows, obs)
    count = int(buffer.num_valid_windows())
    batches = -(-count // batch_size)

    @jax.jit
    def epoch(buffer, key):
        plan = buffer.epoch(key, batch_size)

        def body(i, total):
            sample, valid = buffer.epoch_batch(plan, i)
            return total + materialise(sample.experience) + valid[0].astype(jnp.float32)

        return lax.fori_loop(0, plan.num_batches(), body, jnp.float32(0))

    @jax.jit
    def sampled(buffer, key):
        def body(i, total):
            sample = buffer.sample(jax.random.fold_in(key, i), batch_size)
            return total + materialise(sample.experience)

        return lax.fori_loop(0, batches, body, jnp.float32(0))

    key = jax.random.key(0)
    times = paired_times(lambda: sampled(buffer, key), lambda: epoch(buffer, key), repeat=repeat)
    eb.check(buffer)
    return {
        "capacity": capacity,
        "windows": count,
        "batches": batches,
        "sample x batches": fmt_time(times["a"]),
        "epoch": fmt_time(times["b"]),
        "epoch / sample": f"{times['ratio']:.2f}x",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    capacities = [2**14] if args.quick else [2**16, 2**20]
    repeat = 3 if args.quick else 10
    batch_size, rows, obs = 256, 8, 16
    rows_out = [measure(c, batch_size, rows, obs, repeat) for c in capacities]
    print(f"device: {jax.devices()[0].device_kind}; batch_size={batch_size}, obs={obs}")
    print(table(rows_out))


if __name__ == "__main__":
    main()
