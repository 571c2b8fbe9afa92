"""A prioritised training step, ours against Flashbax's, at 10**5, 10**6 and 10**7 slots.

The step every PER user writes: sample a batch of transitions, a small MLP's Q-learning loss
weighted by the importance weights, one SGD step, new priorities `|td| + 1e-6` set back
into the buffer. `steps` such steps run inside one `lax.fori_loop` per call, the learner's
parameters and the buffer donated (`jax.jit(donate_argnums=0)`, as
`eqx.filter_jit(donate="all")` does), so the figure is the step's cost inside a jitted
training loop, with no dispatch. Ours: `PrioritisedTransitionBuffer` (its `sample.weights`);
Flashbax's: `make_prioritised_flat_buffer` (weights computed from `sample.probabilities`, as
its users do), both with add batch 1, `alpha = 0.6`, `beta = 0.4`, items of 4 float32, an
int32 action and a float32 reward, filled to capacity before timing.

Each step is timed weighted, unweighted (the same loss without the weights), and weighted
after an add of one transition (one environment's step: the whole DQN step): under
donation the two must cost the same (a read of the tree that only the weights use once
made XLA copy the whole tree at every step), and the cost must not grow with the capacity
beyond the tree's depth. Ours and Flashbax's are timed in alternation, both buffers filled
and alive; ratios are Flashbax's time / ours (above 1: ours is faster), the median over
the pairs, and of the best times.

Run: `python -m benchmarks.bench_step [--quick] [--batch B] [--steps S] [--sizes 5,6,7]`.
Never fails on speed.
"""

import argparse
import gc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from equibuffer import PrioritisedTransitionBuffer

from ._timing import fmt_time, Held, paired_times, table


EXAMPLE = {"obs": jnp.zeros(4), "action": jnp.int32(0), "reward": jnp.float32(0)}
ACTIONS, HIDDEN = 2, 32
ALPHA, BETA, LR, GAMMA = 0.6, 0.4, 1e-3, 0.99
FILL_CHUNK = 10**6
# Each step: (weighted loss, an add of one transition first, a training step at all).
VARIANTS = {
    "weighted": (True, False, True),
    "unweighted": (False, False, True),
    "add+weighted": (True, True, True),
    "add": (False, True, False),
}


def _mlp(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (4, HIDDEN)) * 0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, ACTIONS)) * 0.5,
        "b2": jnp.zeros(ACTIONS),
    }


def _q(params: dict[str, jax.Array], obs: jax.Array) -> jax.Array:
    return jax.nn.relu(obs @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def _td(params: dict[str, jax.Array], target: dict[str, jax.Array], first: dict, second: dict):
    """The TD errors of the transitions, bootstrapped from a target network (held fixed here:
    the loss stays a regression, so no run of steps diverges)."""
    q = jnp.take_along_axis(_q(params, first["obs"]), first["action"][:, None], axis=1)[:, 0]
    bootstrap = _q(target, second["obs"]).max(axis=1)
    return q - (first["reward"] + GAMMA * bootstrap)


def _library(name: str, capacity: int, batch: int) -> dict[str, Any]:
    """How one library makes its buffer, fills it, samples (`(first, second, weights)` and
    what `set` needs) and sets priorities, as functions of its state."""
    if name == "equibuffer":

        def sample(buffer: Any, key: jax.Array) -> tuple:
            s = buffer.sample(key, batch, beta=BETA)
            return s.experience.first, s.experience.second, s.weights, s

        return {
            "make": lambda: PrioritisedTransitionBuffer(
                EXAMPLE, add_batch_size=1, capacity=capacity, alpha=ALPHA
            ),
            "fill": lambda b, x: b.add(x),
            "sample": sample,
            "set": lambda b, s, p: b.set_priorities(s, p),
        }
    import flashbax as fbx

    buffer = fbx.make_prioritised_flat_buffer(
        max_length=capacity,
        min_length=2,
        sample_batch_size=batch,
        add_sequences=True,
        add_batch_size=1,
        priority_exponent=ALPHA,
    )

    def fbx_sample(state: Any, key: jax.Array) -> tuple:
        s = buffer.sample(state, key)
        p = s.probabilities  # (N P(i))^-beta / max_j (N P(j))^-beta, as ours
        weights = (p / jnp.min(p)) ** -BETA
        return s.experience.first, s.experience.second, weights, s

    return {
        "make": lambda: buffer.init(EXAMPLE),
        "fill": buffer.add,
        "sample": fbx_sample,
        "set": lambda state, s, p: buffer.set_priorities(state, s.indices, p),
    }


def _filled(lib: dict[str, Any], capacity: int) -> Held:
    # (the target network allocated apart from the learner's: every leaf donated once)
    held = Held((_mlp(jax.random.key(0)), _mlp(jax.random.key(0)), lib["make"]()))
    fill = held.update(lambda state, x: (*state[:2], lib["fill"](state[2], x)))
    rng = np.random.default_rng(0)
    for start in range(0, capacity, FILL_CHUNK):
        n = min(FILL_CHUNK, capacity - start)
        chunk = {
            "obs": jnp.asarray(rng.standard_normal((1, n, 4), np.float32)),
            "action": jnp.asarray(rng.integers(0, ACTIONS, (1, n), np.int32)),
            "reward": jnp.asarray(rng.standard_normal((1, n), np.float32)),
        }
        fill(chunk)
    return held


def _training(
    lib: dict[str, Any], steps: int, weighted: bool, adds: bool = False, trains: bool = True
) -> Any:
    """`state -> state` after `steps` training steps (state: the MLP's parameters, its
    target network's and the buffer), each with its own key; with `adds`, each step first
    adds one transition (one environment's step, as a DQN's loop does); without `trains`,
    only that add (the environment steps between two training steps)."""

    def train(state: tuple, key: jax.Array) -> tuple:
        def step(i: jax.Array, state: tuple) -> tuple:
            params, target, buffer = state
            if adds:
                obs = jnp.full((1, 1, 4), i, jnp.float32)
                one = {"obs": obs, "action": jnp.zeros((1, 1), jnp.int32), "reward": obs[..., 0]}
                buffer = lib["fill"](buffer, one)
            if not trains:
                return params, target, buffer
            first, second, weights, sample = lib["sample"](buffer, jax.random.fold_in(key, i))
            weights = weights if weighted else jnp.ones_like(weights)

            def loss(params: dict) -> tuple[jax.Array, jax.Array]:
                td = _td(params, target, first, second)
                return jnp.mean(weights * td**2), td

            grads, td = jax.grad(loss, has_aux=True)(params)
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
            return params, target, lib["set"](buffer, sample, jnp.abs(td) + 1e-6)

        return jax.lax.fori_loop(0, steps, step, state)

    return train


def bench(capacity: int, batch: int, steps: int, repeat: int) -> dict[str, Any]:
    """Per-step times (best) and paired ratios Flashbax / ours, weighted and unweighted."""
    libs = {name: _library(name, capacity, batch) for name in ("equibuffer", "flashbax")}
    held = {name: _filled(lib, capacity) for name, lib in libs.items()}
    key = jax.random.key(1)
    out: dict[str, Any] = {}
    for variant, (weighted, adds, trains) in VARIANTS.items():
        train = {n: _training(libs[n], steps, weighted, adds, trains) for n in libs}
        ours, fbx = (held[n].update(train[n]) for n in libs)
        out[variant] = paired_times(
            lambda: ours(key),  # noqa: B023
            lambda: fbx(key),  # noqa: B023
            repeat=repeat,
        )
    for h in held.values():
        h.arrays = None
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--batch", type=int, default=32, help="sample batch size")
    parser.add_argument("--steps", type=int, default=None, help="training steps per call")
    parser.add_argument("--sizes", default=None, help="powers of 10 of the capacities: 5,6,7")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    powers = [int(p) for p in (args.sizes or ("3,4,5" if args.quick else "5,6,7")).split(",")]
    steps = args.steps or (100 if args.quick else 1000)
    repeat = 3 if args.quick else 10
    rounds = 1 if args.quick else args.rounds
    print(f"devices: {jax.devices()}", flush=True)
    print(f"\n## A prioritised training step: batch {args.batch}, {steps} steps per call\n")
    rows = []
    for p in powers:
        runs = []
        for _ in range(rounds):
            runs.append(bench(10**p, args.batch, steps, repeat))
            print(f"  10^{p} done", flush=True)
        row: dict[str, Any] = {"slots": f"10^{p}"}
        best = {
            (w, side): min(r[w][side] for r in runs) / steps
            for w in VARIANTS
            for side in ("a", "b")
        }
        for w in VARIANTS:
            row[f"ours {w}"] = fmt_time(best[w, "a"])
            row[f"fbx {w}"] = fmt_time(best[w, "b"])
        for w in VARIANTS:
            medians = " ".join(f"{r[w]['ratio']:.2f}x" for r in runs)
            row[f"fbx/ours {w} (median; best)"] = f"{medians}; {best[w, 'b'] / best[w, 'a']:.2f}x"
        row["ours w/u"] = f"{best['weighted', 'a'] / best['unweighted', 'a']:.2f}x"
        row["fbx w/u"] = f"{best['weighted', 'b'] / best['unweighted', 'b']:.2f}x"
        rows.append(row)
        # Each size's figures as soon as they are in (a run cut short keeps what it measured).
        print(table([row]), flush=True)
    print("\nPer step, best over the pairs; ratios Flashbax / ours (target >= 1.0):\n")
    print(table(rows))
    if len(rows) > 1:
        first, last = rows[0]["slots"], rows[-1]["slots"]
        print(f"\nOurs weighted, {last} / {first}: ", end="")
        print(f"{_seconds(rows[-1]['ours weighted']) / _seconds(rows[0]['ours weighted']):.2f}x")


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]


if __name__ == "__main__":
    main()
