"""DQN on CartPole, with an equibuffer `TransitionBuffer` inside the train state.

The whole training run is one `jax.lax.scan` over steps of a batch of parallel environments,
cut into a few jitted chunks so that progress can be printed between them. The replay buffer
is an ordinary field of the train state: it goes through `eb.filter_jit` (Equinox's
`filter_jit`, checked: a buffer check failing anywhere in a chunk raises when the chunk
returns), `lax.scan`, `lax.cond` and buffer donation exactly like the network parameters do.

Each environment step is stored once, as what the agent saw and what followed:
`Step(obs, action, reward, terminated, truncated)`. A `TransitionBuffer` samples consecutive
pairs `(first, second)` of steps of one environment, so the next observation of `first` is
`second.obs` and no observation is stored twice.

Run it (about a minute on a 2-core CPU):

    python examples/dqn_cartpole.py [--steps 50000] [--seed 0] [--out examples/dqn_cartpole.png]
"""

import argparse
import dataclasses
import math
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

import equibuffer as eb


# ------------------------------------------------------------------------------------------
# CartPole, in JAX: the dynamics of gymnasium's CartPole-v1 (Euler integration, reward 1 per
# step, termination when the pole leans past 12 degrees or the cart leaves [-2.4, 2.4],
# truncation after 500 steps), for one environment; `jax.vmap` makes it a batch.
# ------------------------------------------------------------------------------------------

GRAVITY = 9.8
CART_MASS = 1.0
POLE_MASS = 0.1
TOTAL_MASS = CART_MASS + POLE_MASS
POLE_HALF_LENGTH = 0.5
POLE_MASS_LENGTH = POLE_MASS * POLE_HALF_LENGTH
FORCE = 10.0
TAU = 0.02  # seconds per step
THETA_LIMIT = 12 * 2 * math.pi / 360
X_LIMIT = 2.4
MAX_EPISODE_STEPS = 500


class CartPole(eqx.Module):
    """The state of one CartPole environment."""

    physics: Float[Array, "4"]  # x, x_dot, theta, theta_dot: also the observation
    time: Int[Array, ""]  # steps taken in the current episode


def cartpole_reset(key: PRNGKeyArray) -> CartPole:
    physics = jr.uniform(key, (4,), minval=-0.05, maxval=0.05)
    return CartPole(physics=physics, time=jnp.array(0, jnp.int32))


def cartpole_step(
    key: PRNGKeyArray, env: CartPole, action: Int[Array, ""]
) -> tuple[CartPole, Float[Array, ""], Bool[Array, ""], Bool[Array, ""]]:
    """One step; returns `(env, reward, terminated, truncated)`. When the episode ends the
    returned `env` is already reset (its `physics` is the first observation of the next
    episode) and the final observation is dropped: see `td_loss` for why that is fine."""
    x, x_dot, theta, theta_dot = env.physics
    force = jnp.where(action == 1, FORCE, -FORCE)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLE_MASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (
        POLE_HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos**2 / TOTAL_MASS)
    )
    x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
    physics = jnp.stack(
        [x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc]
    )
    time = env.time + 1
    terminated = (jnp.abs(physics[0]) > X_LIMIT) | (jnp.abs(physics[2]) > THETA_LIMIT)
    truncated = time >= MAX_EPISODE_STEPS
    # Auto-reset: an ended episode continues as a fresh one.
    reset = cartpole_reset(key)
    env = jax.tree.map(
        lambda new, old: jnp.where(terminated | truncated, new, old),
        reset,
        CartPole(physics=physics, time=time),
    )
    return env, jnp.array(1.0, jnp.float32), terminated, truncated


# ------------------------------------------------------------------------------------------
# What is stored, the configuration and the train state.
# ------------------------------------------------------------------------------------------


class Step(eqx.Module):
    """One stored environment step: the observation acted on, the action, and what followed.
    Any pytree of arrays works as buffer content; a module gives named, typed fields."""

    obs: Float[Array, "*envs 4"]
    action: Int[Array, "*envs"]
    reward: Float[Array, "*envs"]
    terminated: Bool[Array, "*envs"]  # the episode ended by falling: no future reward
    truncated: Bool[Array, "*envs"]  # the episode was cut at MAX_EPISODE_STEPS


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters. Frozen (hashable), so `eqx.filter_jit` and `eb.filter_jit` treat it as
    static."""

    total_steps: int = 100_000  # environment steps, summed over the parallel environments
    num_envs: int = 8  # parallel environments = the buffer's `add_batch_size`
    chunks: int = 10  # jitted pieces of the scan; progress is printed after each
    buffer_capacity: int = 100_000  # steps held in total (here: the whole run)
    batch_size: int = 128
    learning_starts: int = 1_000  # environment steps before the first update
    updates_per_step: int = 2  # gradient steps per step of all environments
    learning_rate: float = 1e-3  # decays linearly to 0, which settles the final policy
    max_grad_norm: float = 10.0
    gamma: float = 0.98  # 0.99 reached 500 too but collapsed late more often
    epsilon_start: float = 1.0
    epsilon_end: float = 0.04
    epsilon_fraction: float = 0.1  # of the run over which epsilon decays linearly
    target_period: int = 32  # steps of all environments between target-network copies
    width: int = 128
    depth: int = 2

    @property
    def steps_per_chunk(self) -> int:
        """Steps of all environments (`lax.scan` iterations) per chunk."""
        return max(1, self.total_steps // (self.num_envs * self.chunks))

    @property
    def optimiser(self) -> optax.GradientTransformation:
        updates = self.steps_per_chunk * self.chunks * self.updates_per_step
        schedule = optax.linear_schedule(self.learning_rate, 0.0, updates)
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), optax.adam(schedule))


class TrainState(eqx.Module):
    """Everything that changes during training, the replay buffer included."""

    q_network: eqx.nn.MLP
    target_network: eqx.nn.MLP
    opt_state: optax.OptState
    buffer: eb.TransitionBuffer
    env: CartPole  # leaves batched over the environments
    obs: Float[Array, "envs 4"]  # the current observation of each environment
    episode_return: Float[Array, " envs"]  # return so far of each running episode
    step: Int[Array, ""]  # steps of all environments taken so far
    key: PRNGKeyArray


class StepStats(eqx.Module):
    """What each scan iteration reports back to the host."""

    returns: Float[Array, "*steps envs"]  # return of each episode that ended (else 0)
    ended: Bool[Array, "*steps envs"]  # whether an episode ended in that environment
    loss: Float[Array, "*steps"]  # mean TD loss of the updates (0 before learning starts)


@eqx.filter_jit  # one compilation instead of many small eager operations
def init_state(config: Config, key: PRNGKeyArray) -> TrainState:
    net_key, env_key, key = jr.split(key, 3)
    q_network = eqx.nn.MLP(4, 2, config.width, config.depth, key=net_key)
    target_network = eqx.nn.MLP(4, 2, config.width, config.depth, key=net_key)  # same weights
    env = jax.vmap(cartpole_reset)(jr.split(env_key, config.num_envs))
    example = Step(
        obs=jnp.zeros(4, jnp.float32),
        action=jnp.array(0, jnp.int32),
        reward=jnp.array(0.0, jnp.float32),
        terminated=jnp.array(False),
        truncated=jnp.array(False),
    )
    buffer = eb.TransitionBuffer(
        example, add_batch_size=config.num_envs, capacity=config.buffer_capacity
    )
    return TrainState(
        q_network=q_network,
        target_network=target_network,
        opt_state=config.optimiser.init(eqx.filter(q_network, eqx.is_array)),
        buffer=buffer,
        env=env,
        obs=env.physics,
        episode_return=jnp.zeros(config.num_envs, jnp.float32),
        step=jnp.array(0, jnp.int32),
        key=key,
    )


# ------------------------------------------------------------------------------------------
# Learning.
# ------------------------------------------------------------------------------------------


def td_loss(
    q_network: eqx.nn.MLP, target_network: eqx.nn.MLP, first: Step, second: Step, gamma: float
) -> Float[Array, ""]:
    """Double-DQN Huber loss on a batch of transitions `first -> second` (leaves `(batch,
    ...)`): a sampled [`equibuffer.Transition`][] is two consecutive steps of one environment."""
    q = jax.vmap(q_network)(first.obs)
    q_taken = jnp.take_along_axis(q, first.action[:, None], axis=1)[:, 0]
    # Double DQN: the online network picks the next action, the target network values it.
    next_action = jnp.argmax(jax.vmap(q_network)(second.obs), axis=1)
    next_q = jax.vmap(target_network)(second.obs)
    next_value = jnp.take_along_axis(next_q, next_action[:, None], axis=1)[:, 0]
    # Episode ends. With auto-reset, the step after the last one of an episode is the first
    # step of the next, so `second.obs` is not the successor of `first.obs` there:
    # - terminated: the true value after it is 0, so mask the bootstrap with `terminated`;
    # - truncated (time limit) but not terminated: the true successor (the final
    #   observation) was not kept and `second.obs` would be wrong, so the pair is left out of
    #   the loss (one pair in 500 steps of a full-length episode).
    target = first.reward + gamma * jnp.where(first.terminated, 0.0, next_value)
    target = jax.lax.stop_gradient(target)
    weight = (first.terminated | ~first.truncated).astype(jnp.float32)
    losses = optax.huber_loss(q_taken, target)
    return jnp.sum(weight * losses) / jnp.maximum(jnp.sum(weight), 1.0)


def epsilon(step: Int[Array, ""], config: Config) -> Float[Array, ""]:
    decay_steps = config.epsilon_fraction * config.total_steps / config.num_envs
    progress = jnp.minimum(step.astype(jnp.float32) / decay_steps, 1.0)
    return config.epsilon_start + progress * (config.epsilon_end - config.epsilon_start)


def train_step(state: TrainState, config: Config) -> tuple[TrainState, StepStats]:
    """One step of every environment, stored in the buffer, then (once the buffer is ready)
    `updates_per_step` gradient steps on sampled transitions."""
    key, explore_key, action_key, env_key, learn_key = jr.split(state.key, 5)
    num_envs = config.num_envs

    # Act epsilon-greedily.
    greedy = jnp.argmax(jax.vmap(state.q_network)(state.obs), axis=1).astype(jnp.int32)
    random = jr.randint(action_key, (num_envs,), 0, 2, dtype=jnp.int32)
    explore = jr.uniform(explore_key, (num_envs,)) < epsilon(state.step, config)
    action = jnp.where(explore, random, greedy)

    # Step the environments and store this step (leaves shaped (num_envs, ...)).
    env, reward, terminated, truncated = jax.vmap(cartpole_step)(
        jr.split(env_key, num_envs), state.env, action
    )
    buffer = state.buffer.add(
        Step(
            obs=state.obs, action=action, reward=reward, terminated=terminated, truncated=truncated
        )
    )

    # Bookkeeping of episode returns.
    ended = terminated | truncated
    episode_return = state.episode_return + reward
    returns = jnp.where(ended, episode_return, 0.0)
    episode_return = jnp.where(ended, 0.0, episode_return)

    # Learn. Only arrays may go through `lax.cond`/`lax.scan`, so the network is split into
    # its arrays and the rest (activation functions), and put back together inside.
    params, static = eqx.partition(state.q_network, eqx.is_array)

    def learn(params, opt_state):
        def update(carry, key):
            params, opt_state = carry
            pair = buffer.sample(key, config.batch_size).experience  # an eb.Transition
            q_network = eqx.combine(params, static)
            loss, grads = eqx.filter_value_and_grad(td_loss)(
                q_network, state.target_network, pair.first, pair.second, config.gamma
            )
            updates, opt_state = config.optimiser.update(grads, opt_state, params)
            return (eqx.apply_updates(params, updates), opt_state), loss

        keys = jr.split(learn_key, config.updates_per_step)
        (params, opt_state), losses = jax.lax.scan(update, (params, opt_state), keys)
        return params, opt_state, jnp.mean(losses)

    def skip(params, opt_state):
        return params, opt_state, jnp.array(0.0, jnp.float32)

    # `can_sample()` depends only on the buffer's counters, so this stays a real branch even
    # when a whole training run is vmapped over seeds.
    ready = buffer.can_sample() & (state.step * num_envs >= config.learning_starts)
    params, opt_state, loss = jax.lax.cond(ready, learn, skip, params, state.opt_state)
    q_network = eqx.combine(params, static)

    # Copy the online network into the target network every `target_period` steps.
    step = state.step + 1
    copy = step % config.target_period == 0
    target_network = jax.tree.map(
        lambda new, old: jnp.where(copy, new, old) if eqx.is_array(new) else old,
        q_network,
        state.target_network,
    )

    state = TrainState(
        q_network=q_network,
        target_network=target_network,
        opt_state=opt_state,
        buffer=buffer,
        env=env,
        obs=env.physics,
        episode_return=episode_return,
        step=step,
        key=key,
    )
    return state, StepStats(returns=returns, ended=ended, loss=loss)


@eb.filter_jit(donate="all")
def train_chunk(state: TrainState, config: Config) -> tuple[TrainState, StepStats]:
    """`config.steps_per_chunk` steps of `train_step` in one `lax.scan`. The state is
    donated, so the buffer's storage is updated in place rather than copied each chunk."""
    dynamic, static = eqx.partition(state, eqx.is_array)

    def body(dynamic, _):
        state, stats = train_step(eqx.combine(dynamic, static), config)
        return eqx.filter(state, eqx.is_array), stats

    dynamic, stats = jax.lax.scan(body, dynamic, length=config.steps_per_chunk)
    return eqx.combine(dynamic, static), stats


@eqx.filter_jit
def evaluate(q_network: eqx.nn.MLP, key: PRNGKeyArray, num_episodes: int) -> Float[Array, " n"]:
    """Returns of `num_episodes` episodes of the greedy policy (no exploration)."""
    reset_key, key = jr.split(key)
    env = jax.vmap(cartpole_reset)(jr.split(reset_key, num_episodes))

    def body(carry, key):
        env, total, running = carry
        action = jnp.argmax(jax.vmap(q_network)(env.physics), axis=1).astype(jnp.int32)
        env, reward, terminated, truncated = jax.vmap(cartpole_step)(
            jr.split(key, num_episodes), env, action
        )
        total = total + jnp.where(running, reward, 0.0)
        return (env, total, running & ~(terminated | truncated)), None

    init = (env, jnp.zeros(num_episodes, jnp.float32), jnp.ones(num_episodes, bool))
    (_, total, _), _ = jax.lax.scan(body, init, jr.split(key, MAX_EPISODE_STEPS))
    return total


# ------------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class History:
    """Episodes completed during training, on the host."""

    env_steps: np.ndarray  # environment steps (over all envs) at which each episode ended
    returns: np.ndarray  # the return of each of those episodes
    chunk_means: list[float]  # mean return of the episodes ended in each chunk
    greedy_returns: np.ndarray  # returns of the final greedy policy


def train(config: Config, seed: int, verbose: bool = True) -> tuple[TrainState, History]:
    state = init_state(config, jr.key(seed))
    env_steps, returns, chunk_means = [], [], []
    start = time.perf_counter()
    for chunk in range(config.chunks):
        # A check that fails inside the chunk (e.g. a sample before `can_sample()`) raises
        # here, when the chunk returns (no wait for the host inside it).
        state, stats = train_chunk(state, config)
        ended = np.asarray(stats.ended)  # (steps_per_chunk, num_envs)
        step_index, _ = np.nonzero(ended)
        first_step = chunk * config.steps_per_chunk
        env_steps.append((first_step + step_index + 1) * config.num_envs)
        returns.append(np.asarray(stats.returns)[ended])
        chunk_mean = float(np.mean(returns[-1])) if returns[-1].size else float("nan")
        chunk_means.append(chunk_mean)
        if verbose:
            done = (chunk + 1) * config.steps_per_chunk * config.num_envs
            print(
                f"chunk {chunk + 1:2d}/{config.chunks}  env steps {done:7d}  "
                f"episodes {returns[-1].size:4d}  mean return {chunk_mean:6.1f}  "
                f"loss {float(np.mean(np.asarray(stats.loss))):.4f}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    greedy = np.asarray(evaluate(state.q_network, jr.key(seed + 1), 16))
    history = History(np.concatenate(env_steps), np.concatenate(returns), chunk_means, greedy)
    return state, history


def plot(history: History, config: Config, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(history.env_steps, history.returns, s=4, alpha=0.25, label="episode return")
    # Mean over windows of 2% of the run.
    width = max(config.total_steps // 50, 1)
    bins = history.env_steps // width
    centres, means = [], []
    for b in np.unique(bins):
        centres.append((b + 0.5) * width)
        means.append(history.returns[bins == b].mean())
    ax.plot(centres, means, color="C1", linewidth=2, label=f"mean over {width} steps")
    ax.axhline(MAX_EPISODE_STEPS, color="grey", linestyle="--", linewidth=1, label="maximum")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(f"DQN on CartPole-v1 with an equibuffer TransitionBuffer ({config.num_envs} envs)")
    ax.set_ylim(0, MAX_EPISODE_STEPS * 1.05)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None, **overrides) -> History:
    """The command line. `overrides` replace other `Config` fields (used by the tests)."""
    parser = argparse.ArgumentParser(
        description="DQN on CartPole with an equibuffer TransitionBuffer in its train state."
    )
    parser.add_argument("--steps", type=int, default=Config.total_steps, help="environment steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".png"))
    args = parser.parse_args(argv)

    config = Config(total_steps=args.steps, **overrides)
    start = time.perf_counter()
    _, history = train(config, args.seed)
    elapsed = time.perf_counter() - start
    last = history.chunk_means[-1]
    print(f"final mean return (episodes of the last chunk, epsilon-greedy): {last:.1f}")
    print(
        f"greedy policy: mean return {history.greedy_returns.mean():.1f} over "
        f"{history.greedy_returns.size} episodes (maximum {MAX_EPISODE_STEPS})"
    )
    print(f"trained in {elapsed:.1f} s (compilation included)")
    plot(history, config, args.out)
    print(f"saved {args.out}")
    return history


if __name__ == "__main__":
    main()
