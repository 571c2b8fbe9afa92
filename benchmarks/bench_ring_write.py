"""How to write `T` steps into a ring (the core add of more than one step), per platform.

Times 20 writes per `lax.scan` (8 rows, 32 steps of 256 float32 into a ring of 64 steps, the
write head moving by 32 each time, so every other write wraps), each way paired with the
`lax.cond` that `RingStorage.write` uses on a CPU (a block copy, or a scatter when the block
runs past the ring's end):

- `scatter`: the scatter for every write (what `RingStorage.write` uses off the CPU);
- `block copy`: `dynamic_update_slice` only (wrong when the block wraps; the floor);
- `two runs`: two block copies, branch-free and wrap-safe (checked against NumPy first);
- `error_if + block copy`: the cost of an `eqx.error_if` in the loop body.

Run: `python -m benchmarks.bench_ring_write [--quick]`. Figures (CPU and H100):
benchmarks/README.md. Never fails on speed.
"""

import argparse
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._timing import paired_times


ROWS, LENGTH, T, OBS, K = 8, 64, 32, 256, 20


def two_runs(data: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write `new` (`(rows, keep, ...)`) at `start` of the ring `data` with two block copies:
    one at `min(start, length - keep)` and one at 0, each keeping what it covers outside the
    written steps."""
    keep, length = new.shape[1], data.shape[1]
    j = jnp.arange(keep, dtype=jnp.int32).reshape((1, keep) + (1,) * (new.ndim - 2))
    a = jnp.minimum(start, length - keep)
    d = start - a
    w = jnp.maximum(start + keep - length, 0)
    pad = jnp.zeros_like(new)
    first = jax.lax.dynamic_slice_in_dim(jnp.concatenate([pad, new], 1), keep - d, keep, 1)
    old = jax.lax.dynamic_slice_in_dim(data, a, keep, 1)
    data = jax.lax.dynamic_update_slice_in_dim(data, jnp.where(j >= d, first, old), a, 1)
    second = jax.lax.dynamic_slice_in_dim(jnp.concatenate([new, pad], 1), keep - w, keep, 1)
    old = jax.lax.dynamic_slice_in_dim(data, 0, keep, 1)
    return jax.lax.dynamic_update_slice_in_dim(data, jnp.where(j < w, second, old), 0, 1)


def _slots(start: jax.Array) -> jax.Array:
    return (start + jnp.arange(T, dtype=jnp.int32)) % LENGTH


def scatter(data: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return data.at[:, _slots(start)].set(new, unique_indices=True, mode="promise_in_bounds")


def block_copy(data: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(data, new, start, axis=1)


def cond(data: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return jax.lax.cond(start + T <= LENGTH, block_copy, scatter, data, new, start)


def checked_block_copy(data: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    return block_copy(data, new, eqx.error_if(start, start < 0, "negative start"))


def _check_two_runs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(1, 20))
        keep, start = int(rng.integers(1, length + 1)), int(rng.integers(0, length))
        data = rng.normal(size=(2, length, 3)).astype(np.float32)
        new = rng.normal(size=(2, keep, 3)).astype(np.float32)
        want = data.copy()
        want[:, (start + np.arange(keep)) % length] = new
        got = two_runs(jnp.asarray(data), jnp.asarray(new), jnp.int32(start))
        np.testing.assert_array_equal(np.asarray(got), want)


def main() -> None:
    parser = argparse.ArgumentParser(description="Ways to write T steps into a ring.")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    repeat = 5 if parser.parse_args().quick else 30
    _check_two_runs()
    print(f"devices: {jax.devices()}")
    new = jnp.ones((ROWS, T, OBS))

    def looped(write):
        @functools.partial(jax.jit, donate_argnums=0)
        def run(data, new):
            def body(carry, _):
                data, head = carry
                return (write(data, new, head), (head + T) % LENGTH), None

            return jax.lax.scan(body, (data, jnp.int32(0)), None, length=K)[0][0]

        box = [jnp.zeros((ROWS, LENGTH, OBS))]

        def call():
            box[0] = run(box[0], new)
            return box[0]

        return call

    base = looped(cond)
    ways = {
        "scatter": scatter,
        "block copy": block_copy,
        "two runs": two_runs,
        "error_if + block copy": checked_block_copy,
    }
    for name, write in ways.items():
        r = paired_times(base, looped(write), repeat=repeat)
        print(
            f"{name:22s} / cond {r['ratio']:.2f}  best per write: cond {r['a'] / K * 1e6:.2f} us,"
            f" {name} {r['b'] / K * 1e6:.2f} us",
            flush=True,
        )


if __name__ == "__main__":
    main()
