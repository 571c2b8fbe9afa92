"""Prioritised replay benchmark: SumTree layouts, and the prioritised buffers against our
uniform ones and against Flashbax's prioritised and uniform flat buffers, in the same run.

1. SumTree layouts: a set of 256 random leaves and a stratified sample of 256, for a binary
   tree, wider fan-outs, and wide top levels searched densely, at several capacities. This is
   what `SumTree`'s default layout was picked from.
2. Buffers: `--capacity` steps (default 500,000) of `(32, 32, 3)` float32 (6 GB per buffer;
   two alive at a time), transitions, add batch 1, sample batch 256. Each comparison is timed
   in alternation, both buffers filled and alive, and reported as the median over the pairs
   (steady on this noisy machine) and as the ratio of the best times; once with one jitted
   call per operation, once with 20 operations inside one `lax.scan` per call:
   - prioritised sample / uniform sample (ours, then Flashbax's);
   - prioritised add of one step / uniform add of one step, under donation;
   - `set_priorities` of 256: Flashbax time / ours.
3. Sample cost against capacity: a bare `SumTree` and our prioritised item buffer of small
   items (4 float32) at capacity 10**5 and 10**7: time ratio.

Run: `python -m benchmarks.bench_prioritised [--quick] [--capacity N]`. Never fails on speed.

Figures (2 CPU cores, paired medians per round, benchmarks/README.md, 2026-11-25, stop 11),
one jitted call per operation / 20 operations in a `lax.scan`: prioritised/uniform sample 1.12
to 1.13x / 1.04 to 1.07x (target 1.1), prioritised/uniform add 1.37 to 1.43x / 1.27 to 1.32x
(target 1.5), `set_priorities` Flashbax/ours 0.85 to 0.96x / 2.07 to 2.13x (target 1.5; a
single call is mostly dispatch: the module's pytree flatten and a worker-thread hand-off),
buffer sample 1e7/1e5 1.12x of the best times (target 1.5). What dominates:
benchmarks/README.md.
"""

import argparse
import functools
import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from equibuffer._buffers._prioritised import PrioritisedItemBuffer, PrioritisedTransitionBuffer
from equibuffer._buffers._transition import TransitionBuffer
from equibuffer._sumtree import SumTree
from equibuffer._sumtree._layout import node_layout

from ._timing import best_time, fmt_time, Held, materialise, paired_times, table


OBS = (32, 32, 3)
BATCH = 256
FILL_CHUNK = 2000


# ------------------------------------------------------------------------ 1. layouts


def bench_layouts(capacities: list[int], repeat: int, inner: int = 50) -> list[dict[str, Any]]:
    """Per-batch cost of `inner` batched sets (fresh random indices each) and `inner` samples
    run inside one `lax.scan`, so that dispatch overhead is amortised; and the cost of one
    jitted call of each (a set donated), as the buffers' `set_priorities` and `sample` run."""
    rows = []
    for capacity in capacities:
        # (fanout, top): levels of `fanout` children up to a top level of <= `top` nodes,
        # searched densely (every query against its prefix sums); `top >= capacity`: one
        # dense level.
        layouts = [(2, 2), (4, 4), (8, 8), (16, 16), (32, 32), (8, 256), (16, 2048)]
        values = jax.random.uniform(jax.random.key(0), (capacity,))
        for fanout, top in layouts:
            name = f"{fanout}-ary, top <= {top}"
            tree = SumTree(capacity, fanout, top).set(jnp.arange(capacity), values)

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
            held = Held(tree)
            set_, sample = held.update(sets), held.read(samples)
            t_set = best_time(lambda: set_(key), repeat=repeat) / inner  # noqa: B023
            t_sample = best_time(lambda: sample(key), repeat=repeat) / inner  # noqa: B023
            i = jax.random.randint(key, (BATCH,), 0, capacity)
            v = jax.random.uniform(key, (BATCH,))
            set_one = held.update(lambda t, i, v: t.set(i, v))
            sample_one = held.read(lambda t, k: t.sample(k, BATCH))
            t_set_one = best_time(lambda: set_one(i, v), repeat=repeat * 5)  # noqa: B023
            t_sample_one = best_time(lambda: sample_one(key), repeat=repeat * 5)  # noqa: B023
            rows.append(
                {
                    "capacity": f"{capacity:.0e}",
                    "layout": name,
                    "levels": len(node_layout(capacity, fanout, top)[0]),
                    "set 256, in scan": fmt_time(t_set),
                    "sample 256, in scan": fmt_time(t_sample),
                    "set 256, one call": fmt_time(t_set_one),
                    "sample 256, one call": fmt_time(t_sample_one),
                }
            )
    return rows


# ------------------------------------------------------------------------ 2. buffers


def _peer(name: str, capacity: int) -> dict[str, Any]:
    """How to build, fill, add to, sample and re-prioritise one library's buffer, as
    functions of its state (all timed through `Held`, so in the very same way)."""
    example = {"obs": jnp.zeros(OBS, jnp.float32)}
    if name.startswith("equibuffer"):
        prioritised = name.endswith("prioritised")
        cls = PrioritisedTransitionBuffer if prioritised else TransitionBuffer
        return {
            "make": lambda: cls(example, add_batch_size=1, capacity=capacity),
            "fill": lambda b, x: b.add(x),
            "add": lambda b, x: b.add(x),
            "sample": lambda b, k: b.sample(k, BATCH),
            "set": lambda b, i, st, p: b.set_priorities(i, p, steps=st),
            "steps": lambda s: s.steps,
        }
    import flashbax as fbx

    def make(add_sequences: bool) -> Any:
        if name.endswith("prioritised"):
            return fbx.make_prioritised_flat_buffer(
                max_length=capacity,
                min_length=2,
                sample_batch_size=BATCH,
                add_sequences=add_sequences,
                add_batch_size=1,
                priority_exponent=0.6,
            )
        return fbx.make_flat_buffer(
            max_length=capacity,
            min_length=2,
            sample_batch_size=BATCH,
            add_sequences=add_sequences,
            add_batch_size=1,
        )

    one_step, seq = make(False), make(True)
    return {
        "make": lambda: seq.init(example),
        "fill": seq.add,
        "add": one_step.add,
        "sample": one_step.sample,
        "set": lambda s, i, st, p: one_step.set_priorities(s, i, p),
        "steps": lambda s: jnp.zeros_like(s.indices, jnp.uint32),  # unused by Flashbax
    }


LIBRARIES = ("equibuffer", "flashbax")
KINDS = ("uniform", "prioritised")


def _filled(name: str, capacity: int) -> tuple[dict[str, Any], Held]:
    """One library's buffer (`name`), filled with `capacity` steps."""
    peer = _peer(name, capacity)
    held = Held(peer["make"]())
    fill = held.update(peer["fill"])
    chunk = {"obs": jnp.ones((1, FILL_CHUNK, *OBS), jnp.float32)}
    for _ in range(-(-capacity // FILL_CHUNK)):
        fill(chunk)
    return peer, held


def _free(*helds: Held) -> None:
    for held in helds:
        held.arrays = None
    gc.collect()


def _in_scan(peer: dict[str, Any], k: int) -> dict[str, Callable[..., Any]]:
    """The peer's add, sample and set_priorities, each run `k` times inside one `lax.scan`
    (as inside a jitted training step: no dispatch per operation); samples forced into
    memory (an optimisation barrier), each with its own key; each set_priorities with its own
    priorities."""

    def add(state: Any, x: Any) -> Any:
        return jax.lax.scan(lambda st, _: (peer["add"](st, x), None), state, None, length=k)[0]

    def sample(state: Any, key: Any) -> Any:
        def body(acc: Any, key: Any) -> Any:
            return acc + materialise(peer["sample"](state, key)), None

        return jax.lax.scan(body, jnp.float32(0), jax.random.split(key, k))[0]

    def set_(state: Any, i: Any, st: Any, p: Any) -> Any:
        def body(state: Any, j: Any) -> Any:
            return peer["set"](state, i, st, p + j.astype(jnp.float32) * 1e-3), None

        return jax.lax.scan(body, state, jnp.arange(k))[0]

    return {"add": add, "sample": sample, "set": set_}


def bench_pairs(capacity: int, repeat: int, k: int | None = None) -> dict[str, dict[str, float]]:
    """Prioritised against uniform (add of one step, donated; sample of 256) for each library,
    both buffers filled and alive, timed in alternation (`"a"`: uniform, `"b"`: prioritised);
    then `set_priorities` of 256 (donated), the same way (`"a"`: ours, `"b"`: Flashbax's, so
    the ratio is Flashbax's time / ours). Two 6 GB buffers alive at a time. Each timed call
    is one operation (one jitted call, dispatch included), or with `k` a `lax.scan` of `k`
    operations (the work inside a jitted training step); times are per call."""
    out: dict[str, dict[str, float]] = {}
    one = {"obs": jnp.ones((1, *OBS), jnp.float32)}
    key = jax.random.key(0)
    ops = (lambda peer: peer) if k is None else (lambda peer: {**peer, **_in_scan(peer, k)})
    for library in LIBRARIES:
        (pu, hu), (pp, hp) = (_filled(f"{library} {kind}", capacity) for kind in KINDS)
        pu, pp = ops(pu), ops(pp)
        add_u, add_p = hu.update(pu["add"]), hp.update(pp["add"])
        out[f"{library} add"] = paired_times(
            functools.partial(add_u, one), functools.partial(add_p, one), repeat=repeat * 5
        )
        sample_u, sample_p = hu.read(pu["sample"]), hp.read(pp["sample"])
        out[f"{library} sample"] = paired_times(
            functools.partial(sample_u, key), functools.partial(sample_p, key), repeat=repeat
        )
        _free(hu, hp)
    prio = jnp.asarray(np.random.default_rng(0).random(BATCH, np.float32) + 0.1)
    sets = []
    for library in LIBRARIES:
        peer, held = _filled(f"{library} prioritised", capacity)
        s = held.read(peer["sample"])(key)
        indices, steps = s.indices, peer["steps"](s)
        setp = held.update(ops(peer)["set"])
        sets.append((held, functools.partial(setp, indices, steps, prio)))
    out["set_priorities"] = paired_times(sets[0][1], sets[1][1], repeat=repeat * 5)
    _free(*(held for held, _ in sets))
    return out


def bench_buffers(capacity: int, repeat: int, rounds: int, k: int | None = None) -> None:
    how = "one jitted call per operation" if k is None else f"{k} operations per lax.scan"
    print(
        f"\n## Buffers: {capacity:,} steps of {OBS} float32, add batch 1, sample {BATCH}, {how}\n"
    )
    per_round = []
    for i in range(rounds):
        per_round.append(bench_pairs(capacity, repeat, k))
        print(f"  round {i + 1}/{rounds} done", flush=True)
    rows = []
    for library, set_side in zip(LIBRARIES, ("a", "b"), strict=True):
        for kind, side in zip(KINDS, ("a", "b"), strict=True):
            row = {"buffer": f"{library} {kind}"}
            for op in ("add", "sample"):
                row[op] = fmt_time(min(r[f"{library} {op}"][side] for r in per_round) / (k or 1))
            row["set_priorities"] = (
                fmt_time(min(r["set_priorities"][set_side] for r in per_round) / (k or 1))
                if kind == "prioritised"
                else "-"
            )
            rows.append(row)
    print("Best times over the rounds, per operation:\n")
    print(table(rows))
    labels = {
        "equibuffer sample": "ours prio/uniform sample (target <= 1.1)",
        "flashbax sample": "fbx prio/uniform sample",
        "equibuffer add": "ours prio/uniform add (target <= 1.5)",
        "flashbax add": "fbx prio/uniform add",
        "set_priorities": "set_priorities fbx/ours (target >= 1.5)",
    }
    print("\n## Ratios: median over alternating pairs, per round; and of the best times\n")
    out_rows = []
    for key, label in labels.items():
        row = {"ratio": label}
        for i, r in enumerate(per_round):
            row[f"round {i + 1}"] = f"{r[key]['ratio']:.2f}x"
        a = min(r[key]["a"] for r in per_round)
        b = min(r[key]["b"] for r in per_round)
        row["best times"] = f"{b / a:.2f}x"
        out_rows.append(row)
    print(table(out_rows))


# ------------------------------------------------------------------------ 3. scaling


def bench_scaling(capacities: list[int], repeat: int, rounds: int) -> None:
    """Sample of 256 (and set of 256) against capacity: a bare `SumTree`, and a prioritised
    item buffer of small items (4 float32). A buffer of 10**7 steps of (32, 32, 3) float32
    would be 123 GB, so the buffer-level check uses small items (the tree is the same)."""
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, min(capacities), BATCH).astype(np.int32))
    val = jnp.asarray(rng.random(BATCH, np.float32))
    times: dict[tuple[str, int], list[float]] = {}

    def record(what: str, capacity: int, fn: Callable[[], Any]) -> None:
        times.setdefault((what, capacity), []).append(best_time(fn, repeat=repeat * 5))

    for _ in range(rounds):
        for capacity in capacities:
            held = Held(SumTree(capacity).set(jnp.arange(capacity), jnp.ones(capacity)))
            tree_sample = held.read(lambda t, k: t.sample(k, BATCH))
            record("tree sample", capacity, lambda: tree_sample(key))  # noqa: B023
            tree_set = held.update(lambda t, i, v: t.set(i, v))
            record("tree set", capacity, lambda: tree_set(idx, val))  # noqa: B023
            example = {"x": jnp.zeros(4)}
            held = Held(PrioritisedItemBuffer(example, add_batch_size=1, capacity=capacity))
            fill = held.update(lambda b, x: b.add(x))
            chunk = min(capacity, 10**6)
            for _ in range(-(-capacity // chunk)):
                fill({"x": jnp.ones((1, chunk, 4))})
            buffer_sample = held.read(lambda b, k: b.sample(k, BATCH))
            record("buffer sample", capacity, lambda: buffer_sample(key))  # noqa: B023
            held.arrays = None
            gc.collect()
    lo, hi = min(capacities), max(capacities)
    print(f"\n## Against capacity ({lo:.0e} and {hi:.0e}): batch {BATCH}, items of 4 float32\n")
    rows = []
    for what in ("tree sample", "tree set", "buffer sample"):
        a, b = times[(what, lo)], times[(what, hi)]
        rows.append(
            {
                "op": what,
                f"{lo:.0e}": fmt_time(min(a)),
                f"{hi:.0e}": fmt_time(min(b)),
                "ratio per round": " ".join(f"{y / x:.2f}x" for x, y in zip(a, b, strict=True)),
                "ratio of best (target <= 1.5)": f"{min(b) / min(a):.2f}x",
            }
        )
    print(table(rows))


# ------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--capacity", type=int, default=None, help="steps held (buffers)")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of sections 2 and 3")
    parser.add_argument("--skip-layouts", action="store_true")
    parser.add_argument("--skip-buffers", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args()
    quick = args.quick
    repeat = 5 if quick else 20
    capacity = args.capacity or (5_000 if quick else 500_000)
    print(f"devices: {jax.devices()}", flush=True)
    if not args.skip_layouts:
        layout_caps = [10**3, 10**4] if quick else [10**3, 10**4, 10**5, 10**6, 10**7]
        rows = bench_layouts(layout_caps, repeat)
        print("\n## SumTree layouts (batch 256)\n")
        print(table(rows))
    if not args.skip_buffers:
        bench_buffers(capacity, repeat, args.rounds)
        bench_buffers(capacity, repeat, args.rounds, k=5 if quick else 20)
    if not args.skip_scaling:
        bench_scaling([10**3, 10**5] if quick else [10**5, 10**7], repeat, args.rounds)


if __name__ == "__main__":
    main()
