"""One jitted call from Python, the way a host-side loop steps a buffer: the per-call cost.

Small steps (`obs (4,)` float32 and a float32 reward, one row, 1,000 steps), so the call's
dispatch is the whole cost: flattening the arguments, the executable's launch, rebuilding the
result. Three sides, each timed in blocks of `--calls` back-to-back calls, the sides rotated
round by round: Flashbax's function under `jax.jit` (its documented spelling), equibuffer's
method under `jax.jit` (the docs' spelling for one call per step, see getting_started.md) and
under `eqx.filter_jit` (the spelling for a whole train state). Figures are the median time per
call over the rounds; ratios Flashbax / equibuffer (above 1: equibuffer faster).

    python -m benchmarks.bench_calls [--quick] [--json PATH]
"""

import argparse
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flashbax as fbx
import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb

from ._machine import describe
from ._timing import fmt_time, table


EXAMPLE = {"obs": jnp.zeros(4), "reward": jnp.float32(0)}
STEP = {"obs": jnp.ones((1, 4)), "reward": jnp.ones(1)}
SEQ_STEP = {"obs": jnp.ones((1, 1, 4)), "reward": jnp.ones((1, 1))}
CAPACITY = 1_000
BATCH = 32


def _filled(add: Callable[[Any, Any], Any], state: Any, step: Any) -> Any:
    for _ in range(16):
        state = add(state, step)
    return state


# Each case: name -> side -> (make the state, one call: state -> state). A call that does not
# change the state (sample) returns it unchanged, so every side runs as `state = call(state)`.
def _cases() -> dict[str, dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]]:
    key = jax.random.key(0)
    traj = fbx.make_trajectory_buffer(
        add_batch_size=1, sample_batch_size=BATCH, sample_sequence_length=2, period=1,
        min_length_time_axis=2, max_length_time_axis=CAPACITY,
    )  # fmt: skip
    flat = fbx.make_flat_buffer(
        max_length=CAPACITY, min_length=2, sample_batch_size=BATCH, add_batch_size=1
    )
    prio = fbx.make_prioritised_flat_buffer(
        max_length=CAPACITY, min_length=2, sample_batch_size=BATCH, add_batch_size=1
    )
    ours_traj = lambda: eb.TrajectoryBuffer(  # noqa: E731
        EXAMPLE, add_batch_size=1, capacity=CAPACITY, sequence_length=2
    )
    ours_flat = lambda: eb.TransitionBuffer(EXAMPLE, add_batch_size=1, capacity=CAPACITY)  # noqa: E731
    ours_prio = lambda: eb.PrioritisedTransitionBuffer(  # noqa: E731
        EXAMPLE, add_batch_size=1, capacity=CAPACITY
    )

    def ours_jits(method: Callable[..., Any], donate: bool) -> dict[str, Callable[..., Any]]:
        """`method(buffer, *rest)` under jax.jit and eqx.filter_jit, the buffer donated when
        `donate` (and the rest kept: it is reused call after call)."""
        if donate:
            plain = jax.jit(method, donate_argnums=0)
            eqx_fn = eqx.filter_jit(lambda rest, b: method(b, *rest), donate="all-except-first")
            return {"jax.jit": plain, "filter_jit": lambda b, *rest: eqx_fn(rest, b)}
        return {"jax.jit": jax.jit(method), "filter_jit": eqx.filter_jit(method)}

    cases: dict[str, dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]] = {}
    for name, fb, ours, step in (
        ("add, trajectory", traj, ours_traj, SEQ_STEP),
        ("add, transition", flat, ours_flat, STEP),
    ):
        f_add = jax.jit(fb.add, donate_argnums=0)
        sides = {"flashbax": (lambda fb=fb: fb.init(EXAMPLE), lambda s, f=f_add, x=step: f(s, x))}
        for spelling, fn in ours_jits(lambda b, x: b.add(x), donate=True).items():
            sides[spelling] = (ours, lambda b, fn=fn, x=step: fn(b, x))
        cases[name] = sides
    for name, fb, ours, step in (
        ("sample 32, trajectory", traj, ours_traj, SEQ_STEP),
        ("sample 32, transition", flat, ours_flat, STEP),
    ):
        f_sample = jax.jit(fb.sample)
        f_state = _filled(fb.add, fb.init(EXAMPLE), step)
        o_state = _filled(lambda b, x: b.add(x), ours(), step)
        sides = {"flashbax": (lambda: 0, lambda s, f=f_sample, st=f_state: (f(st, key), s)[1])}
        for spelling, fn in ours_jits(lambda b, k: b.sample(k, BATCH), donate=False).items():
            sides[spelling] = (lambda: 0, lambda s, fn=fn, st=o_state: (fn(st, key), s)[1])
        cases[name] = sides
    # set_priorities of one sample's indices, the buffer donated.
    f_set = jax.jit(prio.set_priorities, donate_argnums=0)
    f_indices = prio.sample(_filled(prio.add, prio.init(EXAMPLE), STEP), key).indices
    o_sample = _filled(lambda b, x: b.add(x), ours_prio(), STEP).sample(key, BATCH)
    priorities = jnp.full(BATCH, 2.0)
    sides = {
        "flashbax": (
            lambda: _filled(prio.add, prio.init(EXAMPLE), STEP),
            lambda s: f_set(s, f_indices, priorities),
        )
    }
    # The sample's indices and steps rather than the whole sample (whose experience the call
    # would flatten for nothing): the spelling getting_started.md gives for a host loop.
    set_p = lambda b, i, s, p: b.set_priorities(i, p, steps=s)  # noqa: E731
    indices, steps = o_sample.indices, o_sample.steps
    for spelling, fn in ours_jits(set_p, donate=True).items():
        sides[spelling] = (
            lambda: _filled(lambda b, x: b.add(x), ours_prio(), STEP),
            lambda b, fn=fn: fn(b, indices, steps, priorities),
        )
    cases["set_priorities 32, prioritised transition"] = sides
    return cases


def time_case(
    sides: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]],
    rounds: int,
    calls: int,
    warmup: int = 50,
) -> dict[str, float]:
    """The median over `rounds` of each side's time per call, in blocks of `calls` calls, the
    order of the sides rotated each round, after `warmup` calls of each (the first compiles)."""
    states = {name: make() for name, (make, _) in sides.items()}
    for name, (_, call) in sides.items():  # compile and warm up
        for _ in range(warmup):
            states[name] = call(states[name])
        jax.block_until_ready(states[name])
    names = list(sides)
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call, state = sides[name][1], states[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                state = call(state)
            jax.block_until_ready(state)
            per_call[name].append((time.perf_counter() - t0) / calls)
            states[name] = state
    return {name: float(np.median(times)) for name, times in per_call.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="blocks timed per side")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed block")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Setting max_size dynamically")
    warnings.filterwarnings("ignore", message=".*sample_sequence_length.*")
    rounds = args.rounds or (5 if args.quick else 15)
    machine = describe()
    print(f"one jitted call from Python: {rounds} rounds of {args.calls} calls per side")
    rows = []
    for name, sides in _cases().items():
        t = time_case(sides, rounds, args.calls)
        rows.append({
            "op": name,
            "fbx jax.jit": fmt_time(t["flashbax"]),
            "ours jax.jit": fmt_time(t["jax.jit"]),
            "ours filter_jit": fmt_time(t["filter_jit"]),
            "fbx/ours jax.jit": f"{t['flashbax'] / t['jax.jit']:.2f}",
            "fbx/ours filter_jit": f"{t['flashbax'] / t['filter_jit']:.2f}",
            "_raw": t,
        })  # fmt: skip
        print(f"  done {name}", flush=True)
    print(table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]))
    if args.json:
        machine["load_average_after"] = describe()["load_average_1_5_15"]
        result = {"step": "obs (4,) float32, reward float32", "capacity": CAPACITY}
        with open(args.json, "w") as f:
            json.dump({**result, "calls": rows, "machine": machine}, f, indent=1)


if __name__ == "__main__":
    main()
