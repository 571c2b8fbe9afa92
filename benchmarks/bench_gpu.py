"""equibuffer against Flashbax 0.1.3 on one accelerator, with and without Equinox's checks.

Written for a lent GPU (`benchmarks/gpu.sh` runs it in one device call; see "On a GPU" in
`benchmarks/README.md`), runs anywhere. Steps of `(32, 32, 3)` float32 observations with an
int32 action, a float32 reward and bool `terminated` / `truncated`; buffers of 100,000 steps,
full; samples of 256. Three sides, each in its own process (Equinox reads `EQX_ON_ERROR` at
import): `ours` (the default configuration), `ours off` (`EQX_ON_ERROR=off`: every check
removed) and `fbx` (Flashbax). The cases:

- `trajectory add` (one step, one row), `trajectory sample` (windows of 1 step), `transition
  sample` (Flashbax's flat buffer), `n-step sample` (n = 3, discount 0.99: ours
  `TransitionBuffer(n_step=3)`; Flashbax has no n-step buffer, so its flat buffer with
  `sample_sequence_length=n + 1`, i.e. `make_trajectory_buffer(sample_sequence_length=4,
  period=1)`, followed by `eb.n_step_transition` on the sampled windows, the very function
  our buffer applies: both return the same `NStepTransition`, Flashbax's side having gathered
  all 4 steps of every leaf where ours reads the observation at the steps returned only),
  `prioritised sample` (with importance weights, beta 0.4: ours returns them; for Flashbax
  they are computed from its probabilities as `(N p)^-beta / max`), `prioritised sample +
  set_priorities`, `queue add + sample` (8 rows, 32 steps per add, each add consumed by one
  sample: `eb.Queue` against `fbx.make_trajectory_queue`);
- `DQN step, uniform` and `DQN step, prioritised`: a whole PureJaxRL-style training step with
  the buffer in the train state (ours: an `eqx.Module` holding the MLP's parameters, the optax
  Adam state and the buffer; Flashbax: the same in a `NamedTuple`): act on 8 environments
  (epsilon-greedy on the Q-network; the "environment" draws the next observations and
  rewards at random), add the 8 transitions, sample 256, TD loss of a 3072-64-64-4 MLP
  (prioritised: weighted by the importance weights, then `set_priorities(|td| + 1e-6)`),
  one Adam update.

Every case is timed two ways: (a) per op inside one jitted `lax.scan` of `--ops` ops (min of
3 calls, after one warm-up); (b) one jitted call from Python per op, the state donated
(ours: `eqx.filter_jit(donate="all-except-first")` with the key or batch first; Flashbax:
`jax.jit(..., donate_argnums=0)`), median time per call over blocks of calls
(`bench_calls.time_case`). Sampled data is forced into memory (`_timing.materialise`).
Ratios are `Flashbax / ours` (above 1: equibuffer faster).

    python -m benchmarks.bench_gpu [--quick] [--json PATH] [--side-timeout SECONDS]

`--quick` (2,000 steps, 10 ops per scan, the DQN step in a scan only) is a smoke test that
runs on a CPU in about two minutes; its figures are not measurements.

Writes `benchmarks/results/gpu.json` only from a full-size run on a GPU; any other run
(`--quick`, a CPU) writes `bench_gpu_<platform>[_quick].json` in the temporary directory
unless `--json` names another file (never `gpu.json`).
"""

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._machine import commit, describe
from ._timing import best_time, fmt_time, materialise, table


OBS = (32, 32, 3)
BATCH, ROWS_QUEUE, T_QUEUE, ENVS, N_STEP, DISCOUNT, BETA = 256, 8, 32, 8, 3, 0.99, 0.4
SIDES = {"fbx": None, "ours": None, "ours off": "off"}  # side -> EQX_ON_ERROR
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclasses.dataclass(frozen=True)
class Sizes:
    capacity: int  # steps per buffer
    ops: int  # ops per scan
    dqn_steps: int  # training steps per scan
    rounds: int  # blocks of single calls
    calls: int  # single calls per block
    warmup: int  # single calls before the timed blocks (the first compiles)
    dqn_calls: bool  # also time the DQN step as one jitted call per step


FULL = Sizes(
    capacity=100_000, ops=500, dqn_steps=200, rounds=5, calls=100, warmup=20, dqn_calls=True
)
QUICK = Sizes(capacity=2_000, ops=10, dqn_steps=5, rounds=2, calls=5, warmup=2, dqn_calls=False)


def example() -> dict[str, jax.Array]:
    return {
        "obs": jnp.zeros(OBS, jnp.float32),
        "action": jnp.int32(0),
        "reward": jnp.float32(0),
        "terminated": jnp.bool_(False),
        "truncated": jnp.bool_(False),
    }


@functools.partial(jax.jit, static_argnums=(0, 1))
def steps(rows: int, t: int | None, seed: int | jax.Array = 0) -> dict[str, jax.Array]:
    """`t` steps for each of `rows` rows (leaves `(rows, t, ...)`; `(rows, ...)` if `t` is
    None), a few of them ending episodes (jitted: one compilation per shape, not per op)."""
    lead = (rows,) if t is None else (rows, t)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "obs": jax.random.uniform(k1, lead + OBS, jnp.float32),
        "action": jnp.zeros(lead, jnp.int32),
        "reward": jax.random.normal(k2, lead, jnp.float32),
        "terminated": jax.random.uniform(k3, lead) < 0.02,
        "truncated": jnp.zeros(lead, jnp.bool_),
    }


def _fill(add: Callable[[Any, Any], Any], state: Any, rows: int, length: int) -> Any:
    """`state` after `length` steps of every row were added, in blocks of about 4,096 steps
    in all (one jitted call each, so that the batch in memory stays small)."""
    chunk = min(length, max(1, 4096 // rows))
    jitted = jax.jit(lambda s, b: add(s, b), donate_argnums=0)
    done = 0
    while done < length:
        t = min(chunk, length - done)
        state = jitted(state, steps(rows, t, seed=done))
        done += t
    return jax.block_until_ready(state)


# --------------------------------------------------------------------------- the cases
#
# A case: `make()` -> a full state; `op(state, key)` -> `(state, output)`, one operation.
# `output` (a tree of arrays, or None) is forced into memory in the scans.


class Case(NamedTuple):
    make: Callable[[], Any]
    op: Callable[[Any, jax.Array], tuple[Any, Any]]
    scan_ops: int
    calls: bool = True  # also timed as one jitted call per op


def _weights(probabilities: jax.Array, n: int) -> jax.Array:
    """Importance weights `(n p)^-beta`, normalised by their max (a Flashbax user's)."""
    w = (n * probabilities) ** -BETA
    return w / jnp.max(w)


def _mlp_init(key: jax.Array) -> dict[str, jax.Array]:
    sizes = (int(np.prod(OBS)), 64, 64, 4)
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        **{f"w{i}": jax.random.normal(k, (a, b)) / np.sqrt(a) for i, (k, a, b) in
           enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))},
        **{f"b{i}": jnp.zeros(b) for i, b in enumerate(sizes[1:])},
    }  # fmt: skip


def _learner(optimiser: Any) -> tuple[Any, Any, jax.Array]:
    """`(params, optimiser state, first observations)` of the DQN (one jitted call)."""

    def init() -> tuple[Any, Any, jax.Array]:
        params = _mlp_init(jax.random.key(1))
        return params, optimiser.init(params), jnp.zeros((ENVS, *OBS))

    return jax.jit(init)()


def _q(params: dict[str, jax.Array], obs: jax.Array) -> jax.Array:
    x = obs.reshape(obs.shape[0], -1)
    x = jax.nn.relu(x @ params["w0"] + params["b0"])
    x = jax.nn.relu(x @ params["w1"] + params["b1"])
    return x @ params["w2"] + params["b2"]


def _act_and_step(params: dict[str, jax.Array], obs: jax.Array, key: jax.Array) -> Any:
    """Epsilon-greedy actions on `ENVS` observations, and what the (random) environment
    returns: `(transitions to add, next observations)`."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    greedy = jnp.argmax(_q(params, obs), axis=1).astype(jnp.int32)
    action = jnp.where(
        jax.random.uniform(k1, (ENVS,)) < 0.1, jax.random.randint(k2, (ENVS,), 0, 4), greedy
    )
    done = jax.random.uniform(k3, (ENVS,)) < 0.01
    reward = jax.random.normal(k4, (ENVS,))
    added = {"obs": obs, "action": action, "reward": reward, "terminated": done,
             "truncated": jnp.zeros(ENVS, jnp.bool_)}  # fmt: skip
    return added, jax.random.uniform(k4, (ENVS, *OBS))


def _td(params: dict[str, jax.Array], first: Any, second: Any) -> jax.Array:
    q = jnp.take_along_axis(_q(params, first["obs"]), first["action"][:, None], axis=1)[:, 0]
    target = jnp.max(_q(jax.lax.stop_gradient(params), second["obs"]), axis=1)
    not_done = 1.0 - first["terminated"].astype(jnp.float32)
    return q - jax.lax.stop_gradient(first["reward"] + 0.99 * not_done * target)


def _learn(params: Any, opt_state: Any, optimiser: Any, first: Any, second: Any, weights: Any):
    """One Adam step on the (weighted) squared TD error: `(params, opt_state, |td|)`."""
    import optax

    def loss(p: Any) -> tuple[jax.Array, jax.Array]:
        td = _td(p, first, second)
        return jnp.mean(weights * td**2), td

    (_, td), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimiser.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.abs(td)


class OursTrainState(eqx.Module):
    params: Any
    opt_state: Any
    buffer: Any
    obs: jax.Array


class FbxTrainState(NamedTuple):
    params: Any
    opt_state: Any
    buffer: Any
    obs: jax.Array


def ours_cases(sizes: Sizes) -> dict[str, Case]:
    import optax

    import equibuffer as eb

    cap, ex, n_ops = sizes.capacity, example(), sizes.ops
    one = steps(1, None)
    rollout = steps(ROWS_QUEUE, T_QUEUE)
    optimiser = optax.adam(1e-4)
    traj = dict(add_batch_size=1, max_length_time_axis=cap, sequence_length=1, period=1)

    def full(buffer: Any, rows: int = 1) -> Callable[[], Any]:
        return lambda: _fill(lambda b, x: b.add(x), buffer(), rows, cap // rows)

    def dqn(prioritised: bool) -> Case:
        kind = eb.PrioritisedTransitionBuffer if prioritised else eb.TransitionBuffer

        def make() -> OursTrainState:
            buffer = full(lambda: kind(ex, add_batch_size=ENVS, capacity=cap), ENVS)()
            params, opt_state, obs = _learner(optimiser)
            return OursTrainState(params, opt_state, buffer, obs)

        def op(state: OursTrainState, key: jax.Array) -> tuple[OursTrainState, Any]:
            k_act, k_sample = jax.random.split(key)
            added, obs = _act_and_step(state.params, state.obs, k_act)
            buffer = state.buffer.add(added)
            if prioritised:
                sample = buffer.sample(k_sample, BATCH, beta=BETA)
                weights = sample.weights
            else:
                sample, weights = buffer.sample(k_sample, BATCH), jnp.ones(BATCH)
            first, second = sample.experience.first, sample.experience.second
            params, opt_state, td = _learn(
                state.params, state.opt_state, optimiser, first, second, weights
            )
            if prioritised:
                buffer = buffer.set_priorities(sample, td + 1e-6)
            return OursTrainState(params, opt_state, buffer, obs), td

        return Case(make, op, sizes.dqn_steps, sizes.dqn_calls)

    def prio_sample(b: Any, k: jax.Array) -> tuple[Any, Any]:
        s = b.sample(k, BATCH, beta=BETA)
        return b, (s.experience, s.weights)

    def prio_set(b: Any, k: jax.Array) -> tuple[Any, Any]:
        s = b.sample(k, BATCH, beta=BETA)
        return b.set_priorities(s, jax.random.uniform(k, (BATCH,)) + 0.1), (s.experience, s.weights)

    def queue(q: Any, k: jax.Array) -> tuple[Any, Any]:
        q, s = q.add(rollout).sample()
        return q, s.experience

    return {
        "trajectory add": Case(
            full(lambda: eb.TrajectoryBuffer(ex, **traj)), lambda b, k: (b.add(one), None), n_ops
        ),
        "trajectory sample": Case(
            full(lambda: eb.TrajectoryBuffer(ex, **traj)),
            lambda b, k: (b, b.sample(k, BATCH).experience),
            n_ops,
        ),
        "transition sample": Case(
            full(lambda: eb.TransitionBuffer(ex, add_batch_size=1, capacity=cap)),
            lambda b, k: (b, b.sample(k, BATCH).experience),
            n_ops,
        ),
        "n-step sample": Case(
            full(
                lambda: eb.TransitionBuffer(
                    ex, add_batch_size=1, capacity=cap, n_step=N_STEP, discount=DISCOUNT
                )
            ),
            lambda b, k: (b, b.sample(k, BATCH).experience),
            n_ops,
        ),
        "prioritised sample": Case(
            full(lambda: eb.PrioritisedTrajectoryBuffer(ex, **traj)), prio_sample, n_ops
        ),
        "prioritised sample + set_priorities": Case(
            full(lambda: eb.PrioritisedTrajectoryBuffer(ex, **traj)), prio_set, n_ops
        ),
        "queue add + sample": Case(
            lambda: eb.Queue(
                ex,
                add_batch_size=ROWS_QUEUE,
                max_length_time_axis=2 * T_QUEUE,
                sequence_length=T_QUEUE,
            ),
            queue,
            n_ops,
        ),
        "DQN step, uniform": dqn(prioritised=False),
        "DQN step, prioritised": dqn(prioritised=True),
    }


def fbx_cases(sizes: Sizes) -> dict[str, Case]:
    import flashbax as fbx
    import optax

    import equibuffer as eb  # (only `n_step_transition`, the n-step rule both sides apply)

    cap, ex, n_ops = sizes.capacity, example(), sizes.ops
    device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    one = steps(1, 1)
    rollout = steps(ROWS_QUEUE, T_QUEUE)
    optimiser = optax.adam(1e-4)
    traj = dict(add_batch_size=1, sample_batch_size=BATCH, period=1, max_length_time_axis=cap)
    trajectory = fbx.make_trajectory_buffer(
        sample_sequence_length=1, min_length_time_axis=1, **traj
    )
    flat = fbx.make_flat_buffer(
        max_length=cap, min_length=2, sample_batch_size=BATCH, add_sequences=True,
        add_batch_size=1,
    )  # fmt: skip
    # Flashbax's flat buffer is its trajectory buffer with `sample_sequence_length=2,
    # period=1`; n-step transitions come from windows of n + 1 steps.
    n_step = fbx.make_trajectory_buffer(
        sample_sequence_length=N_STEP + 1, min_length_time_axis=N_STEP + 1, **traj
    )
    prioritised = fbx.make_prioritised_trajectory_buffer(
        sample_sequence_length=1, min_length_time_axis=1, priority_exponent=0.6,
        device=device, **traj,
    )  # fmt: skip
    queue = fbx.make_trajectory_queue(
        max_length_time_axis=2 * T_QUEUE,
        add_batch_size=ROWS_QUEUE,
        add_sequence_length=T_QUEUE,
        sample_sequence_length=T_QUEUE,
    )

    def full(fb: Any, rows: int = 1, init: Any = None) -> Callable[[], Any]:
        return lambda: _fill(fb.add, (init or fb).init(ex), rows, cap // rows)

    def dqn(prioritised: bool) -> Case:
        def flat_buffer(add_sequences: bool) -> Any:
            if prioritised:
                return fbx.make_prioritised_flat_buffer(
                    max_length=cap, min_length=BATCH, sample_batch_size=BATCH,
                    add_sequences=add_sequences, add_batch_size=ENVS, priority_exponent=0.6,
                    device=device,
                )  # fmt: skip
            return fbx.make_flat_buffer(
                max_length=cap, min_length=BATCH, sample_batch_size=BATCH,
                add_sequences=add_sequences, add_batch_size=ENVS,
            )  # fmt: skip

        buffer = flat_buffer(add_sequences=False)
        filler = flat_buffer(add_sequences=True)  # (the same state, filled in sequences)

        def make() -> FbxTrainState:
            state = full(filler, ENVS)()
            params, opt_state, obs = _learner(optimiser)
            return FbxTrainState(params, opt_state, state, obs)

        def op(state: FbxTrainState, key: jax.Array) -> tuple[FbxTrainState, Any]:
            k_act, k_sample = jax.random.split(key)
            added, obs = _act_and_step(state.params, state.obs, k_act)
            buffer_state = buffer.add(state.buffer, added)
            sample = buffer.sample(buffer_state, k_sample)
            weights = _weights(sample.probabilities, cap) if prioritised else jnp.ones(BATCH)
            first, second = sample.experience.first, sample.experience.second
            params, opt_state, td = _learn(
                state.params, state.opt_state, optimiser, first, second, weights
            )
            if prioritised:
                buffer_state = buffer.set_priorities(buffer_state, sample.indices, td + 1e-6)
            return FbxTrainState(params, opt_state, buffer_state, obs), td

        return Case(make, op, sizes.dqn_steps, sizes.dqn_calls)

    def nstep_sample(s: Any, k: jax.Array) -> tuple[Any, Any]:
        windows = n_step.sample(s, k).experience
        return s, eb.n_step_transition(windows, N_STEP, DISCOUNT)

    def prio_sample(s: Any, k: jax.Array) -> tuple[Any, Any]:
        smp = prioritised.sample(s, k)
        return s, (smp.experience, _weights(smp.probabilities, cap))

    def prio_set(s: Any, k: jax.Array) -> tuple[Any, Any]:
        smp = prioritised.sample(s, k)
        priorities = jax.random.uniform(k, (BATCH,)) + 0.1
        weights = _weights(smp.probabilities, cap)
        return prioritised.set_priorities(s, smp.indices, priorities), (smp.experience, weights)

    def queue_cycle(s: Any, k: jax.Array) -> tuple[Any, Any]:
        s, smp = queue.sample(queue.add(s, rollout))
        return s, smp.experience

    return {
        "trajectory add": Case(
            full(trajectory), lambda s, k: (trajectory.add(s, one), None), n_ops
        ),
        "trajectory sample": Case(
            full(trajectory), lambda s, k: (s, trajectory.sample(s, k).experience), n_ops
        ),
        "transition sample": Case(
            full(flat), lambda s, k: (s, flat.sample(s, k).experience), n_ops
        ),
        "n-step sample": Case(full(n_step), nstep_sample, n_ops),
        "prioritised sample": Case(full(prioritised), prio_sample, n_ops),
        "prioritised sample + set_priorities": Case(full(prioritised), prio_set, n_ops),
        "queue add + sample": Case(lambda: queue.init(ex), queue_cycle, n_ops),
        "DQN step, uniform": dqn(prioritised=False),
        "DQN step, prioritised": dqn(prioritised=True),
    }


# --------------------------------------------------------------------------- timing


def _in_scan(op: Callable[[Any, jax.Array], tuple[Any, Any]], n: int) -> Callable[..., Any]:
    """`(state, key) -> (state, total)`: `n` ops in one `lax.scan`, each output forced into
    memory."""

    def run(state: Any, key: jax.Array) -> tuple[Any, jax.Array]:
        def body(carry: tuple[Any, jax.Array], k: jax.Array) -> tuple[Any, None]:
            state, total = carry
            state, out = op(state, k)
            if out is not None:
                total = total + materialise(out)
            return (state, total), None

        return jax.lax.scan(body, (state, jnp.float32(0)), jax.random.split(key, n))[0]

    return run


def _jit(fn: Callable[[Any, Any], tuple[Any, Any]], ours: bool) -> Callable[[Any, Any], Any]:
    """`fn(state, x)` jitted as each side's users write it, the state donated, called as
    `jitted(state, x) -> (state, out)`: ours `eqx.filter_jit(donate="all-except-first")` (the
    key or batch first), Flashbax's `jax.jit(..., donate_argnums=0)`."""
    if ours:
        jitted = eqx.filter_jit(lambda x, s: fn(s, x), donate="all-except-first")
        return lambda s, x: jitted(x, s)
    return jax.jit(fn, donate_argnums=0)


def measure_case(case: Case, sizes: Sizes, ours: bool) -> dict[str, float | None]:
    """Seconds per op: `scan` (per op of a scan of `case.scan_ops`, min of 3 calls after a
    warm-up) and `call` (one jitted call per op: the median over `sizes.rounds` blocks of
    `sizes.calls` calls, after `bench_calls.time_case`'s warm-up calls); and the seconds the
    three phases took (`_make`, `_scan`, `_call`: filling, compiling and timing)."""
    from .bench_calls import time_case

    t0 = time.perf_counter()
    held = [jax.block_until_ready(case.make())]
    t1 = time.perf_counter()
    scan = _jit(_in_scan(case.op, case.scan_ops), ours)
    keys = iter(jax.random.split(jax.random.key(7), 64))

    def scan_call() -> Any:
        held[0], total = scan(held[0], next(keys))
        return held[0], total

    per_scan = best_time(scan_call, repeat=3, warmup=1)
    t2 = time.perf_counter()
    single = _jit(case.op, ours)
    key = jax.random.key(3)
    state = held.pop()
    per_call = None
    if case.calls:
        per_call = time_case(
            {"side": (lambda: state, lambda s: single(s, key)[0])},
            rounds=sizes.rounds,
            calls=sizes.calls,
            warmup=sizes.warmup,
        )["side"]
    t3 = time.perf_counter()
    phases = {"_make": t1 - t0, "_scan": t2 - t1, "_call": t3 - t2}
    return {"scan": per_scan / case.scan_ops, "call": per_call, **phases}


def run_side(side: str, sizes: Sizes, part: str) -> None:
    """Measure every case of one side in this process, writing `part` (JSON) after each."""
    warnings.filterwarnings("ignore", module="flashbax")
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    ours = side != "fbx"
    cases = ours_cases(sizes) if ours else fbx_cases(sizes)
    result: dict[str, Any] = {"side": side, "machine": _device_info(), "cases": {}}
    for name, case in cases.items():
        t0 = time.perf_counter()
        try:
            result["cases"][name] = measure_case(case, sizes, ours)
        except Exception as e:  # one failed case must not lose the others' figures
            result["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        took = time.perf_counter() - t0
        shown = {
            k: f"{v:.3g}" if isinstance(v, float) else v for k, v in result["cases"][name].items()
        }
        print(f"  {side:9s} {name:36s} {shown} ({took:.1f} s)", flush=True)
        with open(part, "w") as f:
            json.dump(result, f)


def _nvidia_smi(query: str) -> str | None:
    """`nvidia-smi --query-gpu=QUERY` of the first GPU, or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _device_info() -> dict[str, Any]:
    info = describe()
    device = jax.devices()[0]
    info["platform"] = device.platform
    info["device_kind"] = getattr(device, "device_kind", device.platform)
    info["gpu_name"] = _nvidia_smi("name")
    info["nvidia_smi"] = _nvidia_smi("name,memory.total,driver_version")
    info["equibuffer_commit"] = commit()
    info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return info


# --------------------------------------------------------------------------- the run


def _side_process(side: str, quick: bool, part: str, timeout: float | None) -> str:
    env = dict(os.environ)
    env.pop("EQX_ON_ERROR", None)
    if SIDES[side] is not None:
        env["EQX_ON_ERROR"] = SIDES[side]
    command = [sys.executable, "-m", "benchmarks.bench_gpu", "--side", side, "--part", part]
    try:
        done = subprocess.run(command + ["--quick"] * quick, env=env, timeout=timeout)
        return "ok" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"


def _rows(parts: dict[str, dict[str, Any]], which: str, names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        t = {side: parts.get(side, {}).get("cases", {}).get(name, {}) for side in SIDES}
        row: dict[str, Any] = {"op": name}
        for side in SIDES:
            value = t[side].get(which)
            if value is None:
                value = "not timed" if which in t[side] else t[side].get("error", "missing")
            row[side] = fmt_time(value) if isinstance(value, float) else value[:80]
        for side in ("ours", "ours off"):
            a, b = t["fbx"].get(which), t[side].get(which)
            row[f"fbx/{side}"] = f"{a / b:.2f}" if a and b else ""
        row["_raw"] = {side: t[side].get(which) for side in SIDES}
        rows.append(row)
    return rows


def output_path(requested: str | None, platform: str, quick: bool) -> str:
    """Where the figures go: `gpu.json` only from a full-size run on a GPU (by default in
    `benchmarks/results/`); any other run writes `bench_gpu_<platform>[_quick].json`, in the
    folder asked for or, instead of `benchmarks/results/` (whose files the docs show), in the
    temporary directory."""
    official = platform == "gpu" and not quick
    name = "gpu.json" if official else f"bench_gpu_{platform}{'_quick' if quick else ''}.json"
    if requested is None:
        return os.path.join(RESULTS if official else tempfile.gettempdir(), name)
    if os.path.basename(requested) != "gpu.json" or official:
        return requested
    folder = os.path.dirname(os.path.abspath(requested))
    if folder == os.path.abspath(RESULTS):
        folder = tempfile.gettempdir()
    print(f"not writing {requested}: gpu.json holds full-size GPU figures only")
    return os.path.join(folder, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (runs on a CPU)")
    parser.add_argument("--json", default=None, help="where to write (see the module's doc)")
    parser.add_argument("--side-timeout", type=float, default=None, help="seconds per side")
    parser.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.side:
        run_side(args.side, sizes, args.part)
        return
    t0 = time.perf_counter()
    parts: dict[str, dict[str, Any]] = {}
    status: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {side: os.path.join(tmp, f"{side.replace(' ', '_')}.json") for side in SIDES}
        for side, part in files.items():
            print(f"side {side} (EQX_ON_ERROR={SIDES[side] or 'unset'})", flush=True)
            status[side] = _side_process(side, args.quick, part, args.side_timeout)
            if os.path.exists(part):
                with open(part) as f:
                    parts[side] = json.load(f)
    machine: dict[str, Any] = next((p["machine"] for p in parts.values()), {})
    names = list(dict.fromkeys(n for p in parts.values() for n in p["cases"]))
    ops = [n for n in names if not n.startswith("DQN")]
    dqn = [n for n in names if n.startswith("DQN")]
    result = {
        "device": machine.get("gpu_name") or machine.get("device_kind"),
        "device_kind": machine.get("device_kind"),
        "jax": dict(machine.get("versions", {})).get("jax"),
        "date": machine.get("date"),
        "sizes": f"{dataclasses.asdict(sizes)}, steps {OBS} float32, sample batch {BATCH}",
        "sides": "fbx: Flashbax; ours: default; ours off: EQX_ON_ERROR=off",
        "status": json.dumps(status),
        "seconds": round(time.perf_counter() - t0, 1),
        "per op in one jitted scan": _rows(parts, "scan", ops),
        "one jitted call per op": _rows(parts, "call", ops),
        "DQN training step in one jitted scan": _rows(parts, "scan", dqn),
        "DQN training step, one jitted call": _rows(parts, "call", dqn),
        "machine": machine,
    }
    for key, value in result.items():
        if isinstance(value, list):
            print(f"\n{key} (ratios Flashbax / ours)")
            print(table([{k: v for k, v in r.items() if not k.startswith("_")} for r in value]))
    path = output_path(args.json, machine.get("platform", "unknown"), args.quick)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path} in {result['seconds']} s; sides: {status}")


if __name__ == "__main__":
    main()
