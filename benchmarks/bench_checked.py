"""What the checked step costs: a DQN-style step under `eb.filter_jit` against the same step
with every check off (`EQX_ON_ERROR=off`, where `eb.filter_jit` is `eqx.filter_jit`), and
under plain `eqx.filter_jit` (failures recorded, nothing raised).

The step every prioritised-replay user writes (issue 36): add one transition, sample a
batch of 256 from a `PrioritisedTransitionBuffer` (10**5 slots, items of 4 float32), a
linear Q-function's weighted TD loss, one SGD step, `set_priorities(sample, |td| + 1e-6)`;
the train state (parameters and buffer) donated. Two ways to call it:

- `one call`: one step per jitted call from Python, timed in blocks of `--calls` calls
    (the median block, per call): the checked step's read of its carried failure to the
    host is in every call;
- `scan of 1000`: 1,000 steps inside one `lax.scan` per call (per step): the failure is
    carried through the loop and read once.

`EQX_ON_ERROR` is read at import, so each mode runs in its own process, the processes
alternated round by round (`--rounds`); figures are medians over the rounds, ratios the
checked time over the other (at most 1.05 is the target). Never fails on speed.

    python -m benchmarks.bench_checked [--quick] [--rounds 3] [--json PATH]
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


CAPACITY, BATCH, SCAN = 100_000, 256, 1_000


def _child(calls: int, scans: int) -> dict[str, float]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import equibuffer as eb

    example = {"obs": jnp.zeros(4), "action": jnp.int32(0), "reward": jnp.float32(0)}
    buffer = eb.PrioritisedTransitionBuffer(example, add_batch_size=1, capacity=CAPACITY)
    fill = {
        "obs": jnp.arange(CAPACITY * 4, dtype=jnp.float32).reshape(1, CAPACITY, 4) % 7,
        "action": jnp.zeros((1, CAPACITY), jnp.int32),
        "reward": jnp.ones((1, CAPACITY), jnp.float32),
    }
    buffer = buffer.add(fill)
    params = jnp.full((4, 2), 0.1, jnp.float32)
    one = {"obs": jnp.ones((1, 4)), "action": jnp.zeros(1, jnp.int32), "reward": jnp.ones(1)}

    def learn(params, buffer, key):
        buffer = buffer.add(one)
        sample = buffer.sample(key, BATCH, beta=0.4)
        first, second = sample.experience.first, sample.experience.second

        def loss(params):
            q = (first["obs"] @ params)[jnp.arange(BATCH), first["action"]]
            target = first["reward"] + 0.99 * jnp.max(second["obs"] @ params, axis=-1)
            td = q - jax.lax.stop_gradient(target)
            return jnp.mean(sample.weights * td**2), td

        grad, td = jax.grad(loss, has_aux=True)(params)
        buffer = buffer.set_priorities(sample, jnp.abs(td) + 1e-6)
        return params - 1e-3 * grad, buffer

    def scanned(params, buffer, key):
        def body(carry, k):
            return learn(*carry, k), None

        return jax.lax.scan(body, (params, buffer), jax.random.split(key, SCAN))[0]

    out: dict[str, float] = {}
    sides = {"checked": eb.filter_jit}
    if os.environ.get("EQX_ON_ERROR") != "off":
        sides["plain"] = eqx.filter_jit
    for side, jit in sides.items():
        for case, fn, n, per in (
            ("one call", learn, calls, 1),
            (f"scan of {SCAN}", scanned, scans, SCAN),
        ):
            step = jit(fn, donate="all")
            p, b = jnp.array(params), jax.tree.map(jnp.array, buffer)
            key = jax.random.key(0)
            for _ in range(3):  # compile and warm up
                p, b = step(p, b, key)
            jax.block_until_ready((p, b))
            blocks = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(n):
                    p, b = step(p, b, key)
                jax.block_until_ready((p, b))
                blocks.append((time.perf_counter() - start) / (n * per))
            out[f"{side}: {case}"] = float(np.median(blocks))
            del p, b
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls per block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scans", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    calls = args.calls or (100 if args.quick else 500)
    scans = args.scans or (1 if args.quick else 3)
    if args.child:
        print(json.dumps(_child(calls, scans)))
        return
    runs: dict[str, list[dict[str, float]]] = {"default": [], "off": []}
    for r in range(args.rounds):
        for mode in ("default", "off") if r % 2 == 0 else ("off", "default"):
            env = dict(os.environ)
            env.pop("EQX_ON_ERROR", None)
            if mode == "off":
                env["EQX_ON_ERROR"] = "off"
            command = [sys.executable, "-m", "benchmarks.bench_checked", "--child"]
            command += ["--calls", str(calls), "--scans", str(scans)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {runs[mode][-1]}", flush=True)
    median = {
        mode: {k: float(np.median([run[k] for run in rs])) for k in rs[0]}
        for mode, rs in runs.items()
    }
    rows = []
    for case in ("one call", f"scan of {SCAN}"):
        checked, off = median["default"][f"checked: {case}"], median["off"][f"checked: {case}"]
        plain = median["default"][f"plain: {case}"]
        rows.append(
            {
                "case": case,
                "checked_us": checked * 1e6,
                "off_us": off * 1e6,
                "plain_us": plain * 1e6,
                "checked_over_off": checked / off,
                "checked_over_plain": checked / plain,
            }
        )
        print(
            f"{case:>14}: checked {checked * 1e6:8.2f} us, checks off {off * 1e6:8.2f} us, "
            f"plain eqx.filter_jit {plain * 1e6:8.2f} us; checked / off {checked / off:.3f}, "
            f"checked / plain {checked / plain:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
