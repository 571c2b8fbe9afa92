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
`eqx.filter_jit`'s dispatch cost. Every call runs `K` operations in a `lax.scan` (so dispatch
is amortised); the two sides of each comparison are called in alternation
(`_timing.paired_times`) and the ratio is the median over the pairs (the best time of each
side, divided by `K`, is shown beside it). Sampled data is forced into memory (an
optimisation barrier) so that no gather is fused away. The n-step row is given twice: with
the fields the issue names (first, second, reward, discount) and with every field (also
`last`, a third step read only when used).

Run: `python -m benchmarks.bench_issue6 [--quick]`.
"""

import argparse
import functools
import itertools
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

import equibuffer as eb
from equibuffer._buffers._prioritised import PrioritisedItemBuffer
from equibuffer._buffers._queue import Queue
from equibuffer._mixer import Mixer

from ._timing import fmt_time, materialise, paired_times, table


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


# --------------------------------------------------------------------------- queue


def bench_queue(rows: int, t: int, obs: int, k: int, repeat: int) -> list[dict[str, Any]]:
    import flashbax as fbx

    length = 2 * t
    batch = _steps(rows, t, obs)
    ours = Queue(_example(obs), add_batch_size=rows, max_length_time_axis=length, sequence_length=t)
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

    # sample: k samples of T steps per row, each forced into memory. The queue is carried
    # from one sample to the next, so that each reads the next T steps (a sample of a state
    # that does not change would be hoisted out of the loop by XLA); ours has `unread` set
    # back after each (Flashbax's sample does not check it).
    @jax.jit
    def ours_sample(q):
        def body(carry, _):
            q, acc = carry
            q, s = q.sample()
            q = eqx.tree_at(lambda x: x.unread, q, q.unread + t)
            return (q, acc + materialise(s.experience)), None

        return jax.lax.scan(body, (q, jnp.float32(0)), None, length=k)[0][1]

    @jax.jit
    def fb_sample(state):
        def body(carry, _):
            state, acc = carry
            state, s = fb.sample(state)
            return (state, acc + materialise(s.experience)), None

        return jax.lax.scan(body, (state, jnp.float32(0)), None, length=k)[0][1]

    # a rollout cycle: add T steps, then consume them (what an on-policy loop does).
    @functools.partial(jax.jit, donate_argnums=1)
    def ours_cycle(batch, q):
        def body(carry, _):
            q, acc = carry
            q, s = q.add(batch).sample()
            return (q, acc + materialise(s.experience)), None

        return jax.lax.scan(body, (q, jnp.float32(0)), None, length=k)[0]

    @functools.partial(jax.jit, donate_argnums=0)
    def fb_cycle(state, batch):
        def body(carry, _):
            st, acc = carry
            st, s = fb.sample(fb.add(st, batch))
            return (st, acc + materialise(s.experience)), None

        return jax.lax.scan(body, (state, jnp.float32(0)), None, length=k)[0]

    box = {"ours": ours, "fb": fb_state}

    def run_ours_add():
        box["ours"] = ours_add(batch, box["ours"])
        return box["ours"]

    def run_fb_add():
        box["fb"] = fb_add(box["fb"], batch)
        return box["fb"]

    adds = paired_times(run_ours_add, run_fb_add, repeat=repeat)
    full_ours = eqx.tree_at(lambda q: q.unread, box["ours"], jnp.int32(t))
    full_fb = fb.add(box["fb"], batch)
    samples = paired_times(
        lambda: ours_sample(full_ours), lambda: fb_sample(full_fb), repeat=repeat
    )
    box["ours"] = eqx.tree_at(lambda q: q.unread, box["ours"], jnp.int32(0))
    box["fb"] = fb.init(jax.tree.map(lambda x: x[0, 0], batch))

    def run_ours_cycle():
        box["ours"], acc = ours_cycle(batch, box["ours"])
        return acc

    def run_fb_cycle():
        box["fb"], acc = fb_cycle(box["fb"], batch)
        return acc

    cycles = paired_times(run_ours_cycle, run_fb_cycle, repeat=repeat)
    rows_out = []
    for op, pair in (
        (f"add {t} steps", adds),
        (f"sample {t} steps", samples),
        ("add + sample", cycles),
    ):
        rows_out.append(
            {
                "queue op": op,
                "equibuffer (best)": fmt_time(pair["a"] / k),
                "flashbax (best)": fmt_time(pair["b"] / k),
                "flashbax / equibuffer (paired median)": f"{pair['ratio']:.2f}",
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
    def run(buffer, keys, fields):
        def body(acc, key):
            sample = buffer.sample(key, batch_size).experience
            if fields:  # the n-step fields the issue names (`last` unused, so not gathered)
                sample = [sample.first, sample.second, sample.reward, sample.discount]
            return acc + materialise(sample), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    out = []
    for fields, what in ((True, "first, second, reward, discount"), (False, "every field")):
        t = paired_times(
            functools.partial(run, plain, keys, False),
            functools.partial(run, nstep, keys, fields),
            repeat=repeat,
        )
        out.append(
            {
                "sample": f"{batch_size} transitions, obs {obs} floats",
                "n-step fields read": what,
                "plain (best)": fmt_time(t["a"] / k),
                f"n-step, n={n} (best)": fmt_time(t["b"] / k),
                "n-step / plain (paired median)": f"{t['ratio']:.2f}",
            }
        )
    return out


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
            return acc + materialise((sample.experience, extra)), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    out = []
    modes: tuple[Literal["never_cross", "pad"], ...] = ("never_cross", "pad")
    for mode, prioritised in itertools.product(modes, (False, True)):
        if prioritised:
            episodes = eb.PrioritisedEpisodeTrajectoryBuffer(
                example,
                add_batch_size=rows,
                max_length_time_axis=length,
                sequence_length=seq,
                mode=mode,
            )
            plain = eb.PrioritisedTrajectoryBuffer(
                example, add_batch_size=rows, max_length_time_axis=length, sequence_length=seq
            )
        else:
            episodes = eb.EpisodeTrajectoryBuffer(
                example,
                add_batch_size=rows,
                max_length_time_axis=length,
                sequence_length=seq,
                mode=mode,
            )
            plain = eb.TrajectoryBuffer(
                example, add_batch_size=rows, max_length_time_axis=length, sequence_length=seq
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
            return acc + materialise(mixer.sample(key, batch_size, beta=0.4)), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    # The sum of the sources' samples: the same three samples (same keys, same row counts)
    # in the same scan body, each forced into memory, without the mixing.
    @eqx.filter_jit
    def run_sources(sources, keys):
        def body(acc, key):
            parts, part_keys = [], jax.random.split(key, 3)
            for i, buffer in enumerate(sources):
                kw = {"beta": 0.4} if isinstance(buffer, PrioritisedItemBuffer) else {}
                parts.append(buffer.sample(part_keys[i], counts[i], **kw))
            return acc + materialise(parts), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    t = paired_times(
        functools.partial(run_sources, sources, keys),
        functools.partial(run_mixer, mixer, keys),
        repeat=repeat,
    )
    return [
        {
            "sample": f"{batch_size} rows {counts}",
            "sum of sources (best)": fmt_time(t["a"] / k),
            "mixer (best)": fmt_time(t["b"] / k),
            "mixer / sum (paired median)": f"{t['ratio']:.2f}",
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
