"""Pixels: frames stored once (issue 46), side by side with stacked observations stored whole
(ours, and Flashbax's flat buffer) in the same run.

1. Memory: the bytes of a buffer of `--memory-steps` transitions (default 10**6, the standard
   Atari replay) of `(84, 84)` uint8 frames stacked by `k = 4`, with an int32 action, a
   float32 reward and a bool done. Ours with `frames=` is allocated and its arrays counted;
   stored whole (ours and Flashbax's flat buffer) the state's shapes are counted without
   allocating it (28 GB). Reported: bytes per transition against one frame plus the other
   leaves (target <= 1.02x), and the largest Atari buffer in 24 GB and in 80 GB.
2. Sampling: batches of 32 and 256 stacks drawn from `--capacity` transitions (default
   300,000: a buffer stored whole is 8.5 GB and two are alive at a time), uniform and
   prioritised, one jitted call per sample and 20 samples inside one `lax.scan`, each
   sample forced into memory. Frames stored once against: the same buffer stacking nothing
   (the stacks stored whole; target <= 1.25x its time), and Flashbax's flat buffer holding
   the stacks (target >= 1.0x: its time / ours).
3. Adding: one step of 8 rows of stacked observations (what the environment returns; ours
   keeps the newest frame after checking the one before it), 20 adds inside one `lax.scan`,
   donated: Flashbax's time / ours (target >= 1.5x).

Each comparison is timed in alternation (`paired_times`): the median over the pairs of the
ratio, and the ratio of the best times. Run: `python -m benchmarks.bench_pixels [--quick]`.
Never fails on speed.
"""

import argparse
import functools
import gc
from typing import Any

import jax
import jax.numpy as jnp

import equibuffer as eb

from ._timing import fmt_time, Held, materialise, paired_times, table


FRAME = (84, 84)
K = 4
ROWS = 8
CHUNK = 1000  # steps per row per fill call
SCAN = 20


def example() -> dict[str, jax.Array]:
    return {
        "obs": jnp.zeros((*FRAME, K), jnp.uint8),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "done": jnp.bool_(False),
    }


def _frames() -> eb.Frames:
    return eb.Frames("obs", k=K, episode_end="done")


def _ours(capacity: int, prioritised: bool, frames: bool) -> Any:
    cls = eb.PrioritisedTransitionBuffer if prioritised else eb.TransitionBuffer
    return cls(
        example(), add_batch_size=ROWS, capacity=capacity, frames=_frames() if frames else None
    )


def _flashbax(capacity: int, prioritised: bool, batch: int) -> Any:
    import flashbax as fbx

    make = fbx.make_prioritised_flat_buffer if prioritised else fbx.make_flat_buffer
    kwargs = {"priority_exponent": 0.6} if prioritised else {}
    return make(
        max_length=capacity,
        min_length=2,
        sample_batch_size=batch,
        add_sequences=True,
        add_batch_size=ROWS,
        **kwargs,
    )


def _batch(t: int | None, stacked: bool) -> dict[str, jax.Array]:
    """`t` steps (None: one) of every row, all frames ones and no episode end: stacked
    observations that agree with what the rows hold (ones), or single frames."""
    lead = (ROWS,) if t is None else (ROWS, t)
    shape = (*FRAME, K) if stacked else FRAME
    return {
        "obs": jnp.ones((*lead, *shape), jnp.uint8),
        "action": jnp.zeros(lead, jnp.int32),
        "reward": jnp.zeros(lead, jnp.float32),
        "done": jnp.zeros(lead, jnp.bool_),
    }


class Peer:
    """One buffer to time: its state held across calls, and its add and samples."""

    def __init__(self, name: str, capacity: int, prioritised: bool):
        self.name = name
        if name == "flashbax":
            one, b32, b256 = (_flashbax(capacity, prioritised, b) for b in (32, 32, 256))
            self.held = Held(one.init(jax.tree.map(lambda x: x, example())))
            self.fill = self.held.update(one.add)
            self._sample = {32: b32.sample, 256: b256.sample}
            self._add = one.add
            step = lambda x: jax.tree.map(lambda leaf: leaf[:, None], x)  # noqa: E731
            self._one = step
        else:
            buffer = _ours(capacity, prioritised, frames=name == "frames")
            self.held = Held(buffer)
            self.fill = self.held.update(lambda b, x: b.add(x))
            self._sample = {n: functools.partial(_sample_ours, n) for n in (32, 256)}
            self._add = lambda b, x: b.add(x)
            self._one = lambda x: x
        stacked = name != "frames"
        for _ in range(-(-capacity // (ROWS * CHUNK))):
            self.fill(_batch(CHUNK, stacked))

    def sample(self, batch: int, scan: bool) -> Any:
        fn = self._sample[batch]
        if not scan:
            return self.held.read(lambda s, key: materialise(fn(s, key)))

        def many(state: Any, key: Any) -> Any:
            def body(acc: Any, key: Any) -> Any:
                return acc + materialise(fn(state, key)), None

            return jax.lax.scan(body, jnp.float32(0), jax.random.split(key, SCAN))[0]

        return self.held.read(many)

    def adds(self) -> Any:
        one = self._one

        def many(state: Any, x: Any) -> Any:
            return jax.lax.scan(
                lambda s, _: (self._add(s, one(x)), None), state, None, length=SCAN
            )[0]

        return self.held.update(many)

    def free(self) -> None:
        self.held.arrays = None
        gc.collect()


def _sample_ours(batch: int, buffer: Any, key: Any) -> Any:
    return buffer.sample(key, batch)


def bench_memory(steps: int) -> None:
    print(f"\n## Memory: {steps:,} transitions of {FRAME} uint8 frames, k={K}\n")
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    once = _ours(steps, prioritised=False, frames=True)  # allocated
    measured = sum(x.nbytes for x in jax.tree.leaves(once.storage.data))
    once = None
    gc.collect()
    whole = jax.eval_shape(lambda: _ours(steps, prioritised=False, frames=False).storage.data)
    fbx_state = jax.eval_shape(lambda: _flashbax(steps, False, 32).init(example()))
    frame_plus = FRAME[0] * FRAME[1] + 4 + 4 + 1
    rows = []
    for name, b in (
        ("frames stored once (allocated)", measured),
        ("stacks stored whole (ours)", nbytes(whole)),
        ("Flashbax flat buffer", nbytes(fbx_state.experience)),
    ):
        per = b / steps
        rows.append(
            {
                "buffer": name,
                "GB": f"{b / 1e9:.2f}",
                "bytes per transition": f"{per:,.0f}",
                "x (one frame + other leaves)": f"{per / frame_plus:.3f}x",
                "fits in 24 GB": f"{24e9 / per / 1e6:.2f} M",
                "fits in 80 GB": f"{80e9 / per / 1e6:.2f} M",
            }
        )
    print(table(rows))


def bench_speed(capacity: int, repeat: int) -> None:
    print(
        f"\n## Sampling and adding: {capacity:,} transitions, {ROWS} rows; times per "
        f"operation (in a scan: per operation of {SCAN})\n"
    )
    key = jax.random.key(0)
    rows = []
    for prioritised in (False, True):
        kind = "prioritised" if prioritised else "uniform"
        frames = Peer("frames", capacity, prioritised)
        for other in ("whole", "flashbax"):
            peer = Peer(other, capacity, prioritised)
            for scan in (False, True):
                for batch in (32, 256):
                    a, b = frames.sample(batch, scan), peer.sample(batch, scan)
                    r = paired_times(lambda: a(key), lambda: b(key), repeat=repeat)  # noqa: B023
                    per = SCAN if scan else 1
                    rows.append(
                        {
                            "op": f"{kind} sample {batch}" + (" (scan)" if scan else ""),
                            "against": other,
                            "frames once": fmt_time(r["a"] / per),
                            "other": fmt_time(r["b"] / per),
                            "other/ours median": f"{r['ratio']:.2f}x",
                            "best": f"{r['b'] / r['a']:.2f}x",
                        }
                    )
            if not prioritised:
                a, b = frames.adds(), peer.adds()
                x = _batch(None, stacked=True)
                r = paired_times(lambda: a(x), lambda: b(x), repeat=repeat)  # noqa: B023
                rows.append(
                    {
                        "op": f"add {ROWS} stacked (scan)",
                        "against": other,
                        "frames once": fmt_time(r["a"] / SCAN),
                        "other": fmt_time(r["b"] / SCAN),
                        "other/ours median": f"{r['ratio']:.2f}x",
                        "best": f"{r['b'] / r['a']:.2f}x",
                    }
                )
            peer.free()
            print(f"  {kind} against {other} done", flush=True)
        frames.free()
    print(
        "\nTargets: sample against whole >= 0.80x (ours within 1.25x), against Flashbax "
        ">= 1.0x; add against Flashbax >= 1.5x.\n"
    )
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--capacity", type=int, default=None)
    parser.add_argument("--memory-steps", type=int, default=None)
    args = parser.parse_args()
    capacity = args.capacity or (16_000 if args.quick else 300_000)
    steps = args.memory_steps or (16_000 if args.quick else 10**6)
    repeat = 5 if args.quick else 30
    print(f"# Pixels: frames stored once (jax {jax.__version__}, {jax.devices()[0].platform})")
    bench_memory(steps)
    bench_speed(capacity, repeat)


if __name__ == "__main__":
    main()
