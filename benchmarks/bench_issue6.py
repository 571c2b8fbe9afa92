"""Benchmark of the queue, n-step transitions, episode-aware sampling and the mixer, side by
side with their peers in the same run (ratios, never a pass/fail):

- `Queue` add and sample (a PPO-style rollout of `T` steps per row) against Flashbax's
  `make_trajectory_queue` on the same configuration: ratio `Flashbax / equibuffer` (> 1:
  equibuffer faster). Goal: >= 1.
- `TransitionBuffer(n_step=3)` sample against the plain `TransitionBuffer` sample on the same
  data: ratio `n-step / plain`. Goal: <= 1.3.
- `EpisodeTrajectoryBuffer` sample (never_cross and pad) against the plain `TrajectoryBuffer`
  sample of the same data: ratio `episode / plain`. Goal: <= 1.2.
- `Mixer` sample (uniform + uniform + prioritised sources) against the sum of its sources'
  own samples of the same row counts: ratio `mixer / sum`. Goal: <= 1.1.

Both sides run under plain `jax.jit` (a buffer is a pytree of arrays with static config, so
`jax.jit` takes it as is) in the queue rows, so that the figures compare the work and not
`eqx.filter_jit`'s dispatch cost. Every figure is the best of several calls, each running `K`
operations in a `lax.scan` (so dispatch is amortised), divided by `K`; the episode-aware
ratio is the median over pairs of such calls timed in alternation. Sampled data is forced
into memory (an optimisation barrier) so that no gather is fused away.

Run: `python -m benchmarks.bench_issue6 [--quick]`.
"""

import argparse
import functools
import itertools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

import equibuffer as eb
from equibuffer._buffers._prioritised import PrioritisedItemBuffer
from equibuffer._buffers._queue import Queue
from equibuffer._mixer import Mixer

from ._timing import best_time, fmt_time, paired_times, table


def _example(obs: int) -> dict[str, jax.Array]:
    return {
        "obs": jnp.zeros(obs, jnp.float32),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
    }


def _steps(rows: int, t: int, obs: int, seed: int = 0) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "obs": jax.random.normal(k1, (rows, t, obs), jnp.float32),
        "action": jnp.zeros((rows, t), jnp.int32),
        "reward": jax.random.normal(k2, (rows, t), jnp.float32),
        "terminated": jax.random.uniform(k3, (rows, t)) < 0.02,
        "truncated": jax.random.uniform(k3, (rows, t)) > 0.99,
    }


def _materialise(tree: Any) -> jax.Array:
    leaves = jax.lax.optimization_barrier(jax.tree.leaves(tree))
    return jnp.stack([leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves]).sum()


def _per_op(fn: Callable[[], Any], k: int, repeat: int) -> float:
    return best_time(fn, repeat=repeat, warmup=2) / k


# --------------------------------------------------------------------------- queue


def bench_queue(rows: int, t: int, obs: int, k: int, repeat: int) -> list[dict[str, Any]]:
    import flashbax as fbx

    length = 2 * t
    batch = _steps(rows, t, obs)
    ours = Queue(_example(obs), add_batch_size=rows, max_length=length, sequence_length=t)
    fb = fbx.make_trajectory_queue(
        max_length_time_axis=length,
        add_batch_size=rows,
        add_sequence_length=t,
        sample_sequence_length=t,
    )
    fb_state = fb.init(jax.tree.map(lambda x: x[0, 0], batch))

    # add: k adds of T steps; ours resets `unread` after each add (a scalar) so it never fills.
    @functools.partial(jax.jit, donate_argnums=1)
    def ours_add(batch, q):
        def body(q, _):
            q = q.add(batch)
            return eqx.tree_at(lambda x: x.unread, q, q.unread - t), None

        return jax.lax.scan(body, q, None, length=k)[0]

    @functools.partial(jax.jit, donate_argnums=0)
    def fb_add(state, batch):
        return jax.lax.scan(lambda s, _: (fb.add(s, batch), None), state, None, length=k)[0]

    # sample: k samples of T steps per row, each forced into memory.
    @jax.jit
    def ours_sample(q):
        def body(acc, _):
            q2, s = q.sample()
            return acc + _materialise(s.experience) + q2.unread.astype(jnp.float32), None

        return jax.lax.scan(body, jnp.float32(0), None, length=k)[0]

    @jax.jit
    def fb_sample(state):
        def body(acc, _):
            s2, s = fb.sample(state)
            return acc + _materialise(s.experience) + s2.read_index.astype(jnp.float32), None

        return jax.lax.scan(body, jnp.float32(0), None, length=k)[0]

    # a rollout cycle: add T steps, then consume them (what an on-policy loop does).
    @functools.partial(jax.jit, donate_argnums=1)
    def ours_cycle(batch, q):
        def body(carry, _):
            q, acc = carry
            q, s = q.add(batch).sample()
            return (q, acc + _materialise(s.experience)), None

        return jax.lax.scan(body, (q, jnp.float32(0)), None, length=k)[0]

    @functools.partial(jax.jit, donate_argnums=0)
    def fb_cycle(state, batch):
        def body(carry, _):
            st, acc = carry
            st, s = fb.sample(fb.add(st, batch))
            return (st, acc + _materialise(s.experience)), None

        return jax.lax.scan(body, (state, jnp.float32(0)), None, length=k)[0]

    box = {"ours": ours, "fb": fb_state}

    def run_ours_add():
        box["ours"] = ours_add(batch, box["ours"])
        return box["ours"]

    def run_fb_add():
        box["fb"] = fb_add(box["fb"], batch)
        return box["fb"]

    t_ours_add, t_fb_add = _per_op(run_ours_add, k, repeat), _per_op(run_fb_add, k, repeat)
    full_ours = eqx.tree_at(lambda q: q.unread, box["ours"], jnp.int32(t))
    full_fb = fb.add(box["fb"], batch)
    t_ours_sample = _per_op(lambda: ours_sample(full_ours), k, repeat)
    t_fb_sample = _per_op(lambda: fb_sample(full_fb), k, repeat)
    box["ours"] = eqx.tree_at(lambda q: q.unread, box["ours"], jnp.int32(0))
    box["fb"] = fb.init(jax.tree.map(lambda x: x[0, 0], batch))

    def run_ours_cycle():
        box["ours"], acc = ours_cycle(batch, box["ours"])
        return acc

    def run_fb_cycle():
        box["fb"], acc = fb_cycle(box["fb"], batch)
        return acc

    t_ours_cycle, t_fb_cycle = _per_op(run_ours_cycle, k, repeat), _per_op(run_fb_cycle, k, repeat)
    rows_out = []
    for op, a, b in (
        (f"add {t} steps", t_ours_add, t_fb_add),
        (f"sample {t} steps", t_ours_sample, t_fb_sample),
        ("add + sample", t_ours_cycle, t_fb_cycle),
    ):
        rows_out.append(
            {
                "queue op": op,
                "equibuffer": fmt_time(a),
                "flashbax": fmt_time(b),
                "flashbax / equibuffer": f"{b / a:.2f}",
            }
        )
    return rows_out


# --------------------------------------------------------------------------- n-step


def bench_n_step(
    rows: int, capacity: int, obs: int, n: int, batch_size: int, k: int, repeat: int
) -> list[dict[str, Any]]:
    data = _steps(rows, capacity // rows, obs)
    plain = eb.TransitionBuffer(_example(obs), add_batch_size=rows, capacity=capacity).add(data)
    nstep = eqx.tree_at(
        lambda b: b.storage,
        eb.TransitionBuffer(
            _example(obs), add_batch_size=rows, capacity=capacity, n_step=n, discount=0.99
        ),
        plain.storage,
    )
    keys = jax.random.split(jax.random.key(0), k)

    @eqx.filter_jit
    def run(buffer, keys):
        def body(acc, key):
            return acc + _materialise(buffer.sample(key, batch_size).experience), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    a = _per_op(lambda: run(plain, keys), k, repeat)
    b = _per_op(lambda: run(nstep, keys), k, repeat)
    return [
        {
            "sample": f"{batch_size} transitions, obs {obs} floats",
            "plain": fmt_time(a),
            f"n-step (n={n})": fmt_time(b),
            "n-step / plain": f"{b / a:.2f}",
        }
    ]


# --------------------------------------------------------------------------- episodes


def bench_episodes(
    rows: int, capacity: int, obs: tuple[int, ...], seq: int, batch_size: int, k: int, repeat: int
) -> list[dict[str, Any]]:
    """Episode-aware sample (both modes, uniform and prioritised) against the plain trajectory
    sample (uniform, prioritised) of the same data: episodes of random lengths (geometric, mean
    100 steps) end anywhere in the ring."""
    example = {"obs": jnp.zeros(obs, jnp.float32), "done": jnp.bool_(False)}
    length = capacity // rows
    data = {
        "obs": jax.random.normal(jax.random.key(1), (rows, length, *obs), jnp.float32),
        "done": jax.random.uniform(jax.random.key(2), (rows, length)) < 0.01,
    }
    keys = jax.random.split(jax.random.key(0), k)

    @eqx.filter_jit
    def run(buffer, keys):
        def body(acc, key):
            prioritised = isinstance(buffer, eb.AbstractPrioritisedBuffer)
            sample = buffer.sample(key, batch_size, **({"beta": 0.4} if prioritised else {}))
            extra = getattr(sample, "mask", None)
            return acc + _materialise((sample.experience, extra)), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    out = []
    modes: tuple[Literal["never_cross", "pad"], ...] = ("never_cross", "pad")
    for mode, prioritised in itertools.product(modes, (False, True)):
        if prioritised:
            episodes = eb.PrioritisedEpisodeTrajectoryBuffer(
                example, add_batch_size=rows, max_length=length, sequence_length=seq, mode=mode
            )
            plain = eb.PrioritisedTrajectoryBuffer(
                example, add_batch_size=rows, max_length=length, sequence_length=seq
            )
        else:
            episodes = eb.EpisodeTrajectoryBuffer(
                example, add_batch_size=rows, max_length=length, sequence_length=seq, mode=mode
            )
            plain = eb.TrajectoryBuffer(
                example, add_batch_size=rows, max_length=length, sequence_length=seq
            )
        plain = plain.add(data)
        episodes = episodes.add(data)
        # Timed in alternation, so that machine drift hits both sides alike.
        t = paired_times(
            functools.partial(run, plain, keys),
            functools.partial(run, episodes, keys),
            repeat=repeat,
        )
        kind = "prioritised" if prioritised else "uniform"
        out.append(
            {
                "sample": f"{batch_size} windows of {seq}, {kind}, mode={mode}",
                "valid windows": f"{episodes.num_valid_windows()} / {plain.num_windows()}",
                "plain (best)": fmt_time(t["a"] / k),
                "episode-aware (best)": fmt_time(t["b"] / k),
                "episode / plain (paired median)": f"{t['ratio']:.2f}",
            }
        )
        del episodes, plain
    return out


# --------------------------------------------------------------------------- mixer


def bench_mixer(
    rows: int, capacity: int, obs: int, batch_size: int, k: int, repeat: int
) -> list[dict[str, Any]]:
    example = {"obs": jnp.zeros(obs, jnp.float32), "reward": jnp.float32(0)}
    data = {k_: v for k_, v in _steps(rows, capacity // rows, obs).items() if k_ in example}
    sources = (
        eb.ItemBuffer(example, add_batch_size=rows, capacity=capacity).add(data),
        eb.ItemBuffer(example, add_batch_size=rows, capacity=capacity).add(data),
        PrioritisedItemBuffer(example, add_batch_size=rows, capacity=capacity).add(data),
    )
    mixer = Mixer(sources, proportions=(0.5, 0.25, 0.25))
    counts = mixer.counts(batch_size)
    keys = jax.random.split(jax.random.key(0), k)

    @eqx.filter_jit
    def run_mixer(mixer, keys):
        def body(acc, key):
            return acc + _materialise(mixer.sample(key, batch_size, beta=0.4)), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    def one(i):
        @eqx.filter_jit
        def run(buffer, keys):
            def body(acc, key):
                kw = {"beta": 0.4} if isinstance(buffer, PrioritisedItemBuffer) else {}
                return acc + _materialise(buffer.sample(key, counts[i], **kw)), None

            return jax.lax.scan(body, jnp.float32(0), keys)[0]

        return _per_op(lambda: run(sources[i], keys), k, repeat)

    # Interleave so that machine noise hits both sides alike.
    t_sum = sum(one(i) for i in range(3))
    t_mix = _per_op(lambda: run_mixer(mixer, keys), k, repeat)
    t_sum = min(t_sum, sum(one(i) for i in range(3)))
    t_mix = min(t_mix, _per_op(lambda: run_mixer(mixer, keys), k, repeat))
    return [
        {
            "sample": f"{batch_size} rows {counts}",
            "sum of sources": fmt_time(t_sum),
            "mixer": fmt_time(t_mix),
            "mixer / sum": f"{t_mix / t_sum:.2f}",
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    repeat = 5 if args.quick else 15
    k = 5 if args.quick else 20
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    obs = 64 if args.quick else 256
    for rows, t in ((8, 32), (64, 128)) if not args.quick else ((8, 32),):
        print(f"\nQueue: {rows} rows, rollouts of {t} steps, obs {obs} floats")
        print(table(bench_queue(rows, t, obs, k, repeat)))
    capacity = 20_000 if args.quick else 100_000
    print(f"\nn-step sample: capacity {capacity}")
    print(table(bench_n_step(16, capacity, obs, 3, 256, k, repeat)))
    shape = (16, 16, 3) if args.quick else (32, 32, 3)
    print(f"\nEpisode-aware sample: capacity {capacity}, obs {shape} float32")
    print(table(bench_episodes(16, capacity, shape, 8, 256, k, repeat)))
    print(f"\nEpisode-aware sample: capacity {capacity}, obs (4,) float32 (tiny steps)")
    print(table(bench_episodes(16, capacity, (4,), 8, 256, k, repeat)))
    print(f"\nMixer sample: three sources of capacity {capacity}")
    print(table(bench_mixer(16, capacity, obs, 256, k, repeat)))


if __name__ == "__main__":
    main()
