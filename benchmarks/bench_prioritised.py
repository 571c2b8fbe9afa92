"""Prioritised replay benchmark: SumTree layouts, and the prioritised buffers against our
uniform ones and against Flashbax's prioritised and uniform flat buffers, in the same run.

1. SumTree layouts: a set of 256 random leaves and a stratified sample of 256, for a binary
   tree, wider fan-outs, and a single dense level (prefix sums + `searchsorted`), at several
   capacities. This is what `SumTree`'s default layout was picked from.
2. Buffers: `--capacity` steps (default 500,000) of `(32, 32, 3)` float32 (6 GB per buffer;
   only one buffer alive at a time), transitions, add batch 1, sample batch 256:
   - prioritised sample / uniform sample (ours and Flashbax's);
   - prioritised add of one step / uniform add of one step, under donation;
   - `set_priorities` of 256: Flashbax time / ours.
3. Sample cost against capacity: our prioritised item buffer of small items (4 float32) at
   capacity 10**5 and 10**7: time ratio.

Run: `python -m benchmarks.bench_prioritised [--quick] [--capacity N]`. Never fails on speed.
"""

import argparse
import gc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from equibuffer._buffers._prioritised import PrioritisedItemBuffer, PrioritisedTransitionBuffer
from equibuffer._buffers._transition import TransitionBuffer
from equibuffer._sumtree import SumTree

from ._timing import best_time, fmt_time, table


OBS = (32, 32, 3)
BATCH = 256
FILL_CHUNK = 2000


class _Loop:
    """A zero-argument callable replacing `self.box[0]` by `step(self.box[0])` (donated)."""

    def __init__(self, step: Callable[[Any], Any], state: Any):
        self.step, self.box = step, [state]

    def __call__(self) -> Any:
        self.box[0] = self.step(self.box[0])
        return self.box[0]


_loop = _Loop


def _jit(fn: Callable[..., Any], module: Any, donate: bool) -> Callable[..., Any]:
    """`jax.jit` of `fn(module, *args)` over the module's arrays (its static part closed over),
    so that timings measure the work and not `eqx.filter_jit`'s Python-side dispatch. When
    `donate`, `fn` returns a module of the same type (the updated one)."""
    static = eqx.partition(module, eqx.is_array)[1]

    def run(arrays, *args):
        out = fn(eqx.combine(arrays, static), *args)
        return eqx.partition(out, eqx.is_array)[0] if donate else out

    jitted = jax.jit(run, donate_argnums=0 if donate else ())

    def call(m, *args):
        out = jitted(eqx.partition(m, eqx.is_array)[0], *args)
        return eqx.combine(out, static) if donate else out

    return call


# ------------------------------------------------------------------------ 1. layouts


def bench_layouts(capacities: list[int], repeat: int, inner: int = 50) -> list[dict[str, Any]]:
    """Per-batch cost of `inner` batched sets (fresh random indices each) and `inner` samples
    run inside one `lax.scan`, so that dispatch overhead is amortised."""
    rows = []
    for capacity in capacities:
        layouts: list[tuple[str, int]] = [("binary", 2), ("4-ary", 4), ("8-ary", 8)]
        layouts += [("16-ary", 16), ("32-ary", 32), ("64-ary", 64)]
        if capacity <= 10**6:
            layouts.append(("dense", capacity))
        values = jax.random.uniform(jax.random.key(0), (capacity,))
        for name, fanout in layouts:
            tree = SumTree(capacity, fanout).set(jnp.arange(capacity), values)

            def sets(tree, key):
                def body(tree, key):
                    k1, k2 = jax.random.split(key)
                    i = jax.random.randint(k1, (BATCH,), 0, capacity)  # noqa: B023
                    return tree.set(i, jax.random.uniform(k2, (BATCH,))), None

                return jax.lax.scan(body, tree, jax.random.split(key, inner))[0]

            def samples(tree, key):
                def body(acc, key):
                    return acc + jnp.sum(tree.sample(key, BATCH)), None

                return jax.lax.scan(body, jnp.int32(0), jax.random.split(key, inner))[0]

            key = jax.random.key(1)
            set_ = _jit(sets, tree, donate=True)
            call = _loop(lambda t: set_(t, key), tree)  # noqa: B023
            t_set = best_time(call, repeat=repeat) / inner
            sample = _jit(samples, tree, donate=False)
            t_sample = best_time(lambda: sample(call.box[0], key), repeat=repeat) / inner  # noqa: B023
            rows.append(
                {
                    "capacity": f"{capacity:.0e}",
                    "layout": name,
                    "levels": len(tree.levels),
                    "set 256": fmt_time(t_set),
                    "sample 256": fmt_time(t_sample),
                }
            )
    return rows


# ------------------------------------------------------------------------ 2. buffers


def _ours(prioritised: bool, capacity: int):
    example = {"obs": jnp.zeros(OBS, jnp.float32)}
    cls = PrioritisedTransitionBuffer if prioritised else TransitionBuffer
    return cls(example, add_batch_size=1, capacity=capacity)


def _fill_ours(buffer, capacity: int):
    add = _jit(lambda b, x: b.add(x), buffer, donate=True)
    chunk = {"obs": jnp.ones((1, FILL_CHUNK, *OBS), jnp.float32)}
    for _ in range(-(-capacity // FILL_CHUNK)):
        buffer = add(buffer, chunk)
    return buffer


def bench_ours(prioritised: bool, capacity: int, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    buffer = _fill_ours(_ours(prioritised, capacity), capacity)
    one = {"obs": jnp.ones((1, *OBS), jnp.float32)}
    add = _jit(lambda b, x: b.add(x), buffer, donate=True)
    call = _loop(lambda b: add(b, one), buffer)
    buffer = None
    out["add"] = best_time(call, repeat=repeat * 3)
    sample = _jit(lambda b, k: b.sample(k, BATCH), call.box[0], donate=False)
    key = jax.random.key(0)
    out["sample"] = best_time(lambda: sample(call.box[0], key), repeat=repeat)
    if prioritised:
        s = sample(call.box[0], key)
        prio = jnp.asarray(np.random.default_rng(0).random(BATCH, np.float32))
        setp = _jit(lambda b, s, p: b.set_priorities(s, p), call.box[0], donate=True)
        call = _loop(lambda b: setp(b, s, prio), call.box[0])
        out["set_priorities"] = best_time(call, repeat=repeat * 3)
    call.box.clear()
    gc.collect()
    return out


def bench_flashbax(prioritised: bool, capacity: int, repeat: int) -> dict[str, float]:
    import flashbax as fbx

    def make(add_sequences: bool):
        common = dict(
            max_length=capacity,
            min_length=2,
            sample_batch_size=BATCH,
            add_sequences=add_sequences,
            add_batch_size=1,
        )
        if prioritised:
            return fbx.make_prioritised_flat_buffer(**common, priority_exponent=0.6)
        return fbx.make_flat_buffer(**common)

    one_step, seq = make(False), make(True)
    out: dict[str, float] = {}
    state = seq.init({"obs": jnp.zeros(OBS, jnp.float32)})
    fill = jax.jit(seq.add, donate_argnums=0)
    chunk = {"obs": jnp.ones((1, FILL_CHUNK, *OBS), jnp.float32)}
    for _ in range(-(-capacity // FILL_CHUNK)):
        state = fill(state, chunk)
    one = {"obs": jnp.ones((1, *OBS), jnp.float32)}
    add = jax.jit(one_step.add, donate_argnums=0)
    call = _loop(lambda s: add(s, one), state)
    state = None
    out["add"] = best_time(call, repeat=repeat * 3)
    sample = jax.jit(one_step.sample)
    key = jax.random.key(0)
    out["sample"] = best_time(lambda: sample(call.box[0], key), repeat=repeat)
    if prioritised:
        indices = sample(call.box[0], key).indices
        prio = jnp.asarray(np.random.default_rng(0).random(BATCH, np.float32))
        setp = jax.jit(one_step.set_priorities, donate_argnums=0)
        call = _loop(lambda s: setp(s, indices, prio), call.box[0])
        out["set_priorities"] = best_time(call, repeat=repeat * 3)
    call.box.clear()
    gc.collect()
    return out


# ------------------------------------------------------------------------ 3. scaling


def bench_scaling(capacities: list[int], repeat: int) -> dict[int, float]:
    out = {}
    key = jax.random.key(0)
    for capacity in capacities:
        buffer = PrioritisedItemBuffer({"x": jnp.zeros(4)}, add_batch_size=1, capacity=capacity)
        add = _jit(lambda b, x: b.add(x), buffer, donate=True)
        chunk = min(capacity, 10**6)
        for _ in range(-(-capacity // chunk)):
            buffer = add(buffer, {"x": jnp.ones((1, chunk, 4))})
        sample = _jit(lambda b, k: b.sample(k, BATCH), buffer, donate=False)
        box = [buffer]
        out[capacity] = best_time(lambda: sample(box[0], key), repeat=repeat)  # noqa: B023
        box.clear()
        buffer = None
        gc.collect()
    return out


# ------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--capacity", type=int, default=None, help="steps held (buffers)")
    parser.add_argument("--skip-layouts", action="store_true")
    args = parser.parse_args()
    quick = args.quick
    repeat = 5 if quick else 20
    capacity = args.capacity or (5_000 if quick else 500_000)
    print(f"devices: {jax.devices()}")

    if not args.skip_layouts:
        layout_caps = [10**3, 10**4] if quick else [10**3, 10**4, 10**5, 10**6, 10**7]
        rows = bench_layouts(layout_caps, repeat)
        print("\n## SumTree layouts (batch 256)\n")
        print(table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]))

    print(f"\n## Buffers: {capacity:,} steps of {OBS} float32, add batch 1, sample {BATCH}\n")
    results = {
        "equibuffer uniform": bench_ours(False, capacity, repeat),
        "equibuffer prioritised": bench_ours(True, capacity, repeat),
        "flashbax uniform": bench_flashbax(False, capacity, repeat),
        "flashbax prioritised": bench_flashbax(True, capacity, repeat),
    }
    print(
        table(
            [
                {"buffer": name, **{k: fmt_time(v) for k, v in r.items()}}
                for name, r in results.items()
                if "set_priorities" in r
            ]
            + [
                {"buffer": name, **{k: fmt_time(v) for k, v in r.items()}, "set_priorities": "-"}
                for name, r in results.items()
                if "set_priorities" not in r
            ]
        )
    )
    ours_u, ours_p = results["equibuffer uniform"], results["equibuffer prioritised"]
    fbx_u, fbx_p = results["flashbax uniform"], results["flashbax prioritised"]
    print("\n## Ratios\n")
    print(
        table(
            [
                {
                    "ratio": "prioritised sample / uniform sample",
                    "equibuffer": f"{ours_p['sample'] / ours_u['sample']:.2f}x",
                    "flashbax": f"{fbx_p['sample'] / fbx_u['sample']:.2f}x",
                },
                {
                    "ratio": "prioritised add / uniform add (1 step)",
                    "equibuffer": f"{ours_p['add'] / ours_u['add']:.2f}x",
                    "flashbax": f"{fbx_p['add'] / fbx_u['add']:.2f}x",
                },
                {
                    "ratio": "set_priorities 256: flashbax / equibuffer",
                    "equibuffer": f"{fbx_p['set_priorities'] / ours_p['set_priorities']:.2f}x",
                    "flashbax": "-",
                },
            ]
        )
    )

    caps = [10**3, 10**5] if quick else [10**5, 10**7]
    scaling = bench_scaling(caps, repeat)
    lo, hi = caps
    print(f"\n## Prioritised sample of {BATCH} (items of 4 float32) against capacity\n")
    print(
        table(
            [{"capacity": f"{c:.0e}", "sample": fmt_time(t)} for c, t in scaling.items()]
            + [{"capacity": f"{hi:.0e} / {lo:.0e}", "sample": f"{scaling[hi] / scaling[lo]:.2f}x"}]
        )
    )


if __name__ == "__main__":
    main()
