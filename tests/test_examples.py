"""Smoke tests of `examples/dqn_cartpole.py`: tiny runs of the full jitted training loop.

Every test uses the same tiny configuration, so the jitted chunk is compiled once for the
module; a counting wrapper makes any retrace (a shape, dtype or structure change of the train
state between chunks) fail the test that causes it.
"""

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import equibuffer as eb


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dqn_cartpole.py"

# 2 chunks of 40 steps of 4 environments; learning starts after 64 environment steps.
TINY = dict(
    num_envs=4,
    chunks=2,
    buffer_capacity=200,
    batch_size=16,
    learning_starts=64,
    updates_per_step=2,
    width=16,
    target_period=8,
)
TINY_STEPS = 320


@pytest.fixture(scope="module")
def dqn() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("dqn_cartpole", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # Same jitted chunk, but its traces are counted: one configuration, one trace.
    counted = eqx.debug.assert_max_traces(module.train_chunk.__wrapped__, max_traces=1)
    module.__dict__["train_chunk"] = eqx.filter_jit(counted, donate="all")
    yield module
    del sys.modules[spec.name]


@pytest.fixture(autouse=True)
def standard_promotion() -> Iterator[None]:
    # optax's Adam mixes Python floats with its int32 step count, which the strict dtype
    # promotion set in conftest refuses; the example is user code and runs with JAX defaults.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def trained(dqn: ModuleType):
    with jax.numpy_dtype_promotion("standard"):
        config = dqn.Config(total_steps=TINY_STEPS, **TINY)
        state, history = dqn.train(config, seed=0, verbose=False)
    return config, state, history


def test_tiny_training_run(dqn: ModuleType, trained):
    config, state, history = trained
    assert config.steps_per_chunk == 40
    initial = dqn.init_state(config, jr.key(0))

    # The buffer went through both jitted chunks as a field of the train state.
    assert isinstance(state.buffer, eb.TransitionBuffer)
    assert state.buffer.storage.steps_added() == 2 * config.steps_per_chunk
    assert int(state.step) == 2 * config.steps_per_chunk
    assert bool(state.buffer.can_sample())
    # A random policy ends episodes within 80 steps; every return is finite and in range.
    assert history.returns.size > 0
    assert np.all(np.isfinite(history.returns))
    assert np.all((history.returns >= 1) & (history.returns <= dqn.MAX_EPISODE_STEPS))
    assert np.all(np.diff(history.env_steps) >= 0)
    assert len(history.chunk_means) == config.chunks
    assert history.greedy_returns.shape == (16,)
    assert np.all(np.isfinite(history.greedy_returns))
    # Learning happened (the lax.cond took the learn branch): the parameters moved.
    params = eqx.filter(state.q_network, eqx.is_array)
    before = eqx.filter(initial.q_network, eqx.is_array)
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), params, before)
    assert any(jax.tree.leaves(moved))
    assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))


def test_chunk_donates_the_state(dqn: ModuleType, trained):
    config, _, _ = trained
    state = dqn.init_state(config, jr.key(1))
    old = state
    state, stats = dqn.train_chunk(state, config)
    state, stats = dqn.train_chunk(state, config)  # no retrace (checked by the fixture)
    assert stats.returns.shape == (config.steps_per_chunk, config.num_envs)
    assert stats.loss.shape == (config.steps_per_chunk,)
    # The donated input is consumed: the buffer was updated in place, not copied.
    assert old.buffer.storage.data.obs.is_deleted()
    assert not state.buffer.storage.data.obs.is_deleted()
    assert state.buffer.storage.steps_added() == 2 * config.steps_per_chunk


def test_pairs_give_the_next_observation(dqn: ModuleType, trained):
    """Each step is stored once; a sampled pair's `second.obs` is the observation that
    followed `first`, except across an episode end (auto-reset), which the flags mark."""
    _, state, _ = trained
    n = 256

    @eqx.filter_jit
    def sample_and_step(buffer: eb.TransitionBuffer, key):
        sample_key, env_key = jr.split(key)
        pair = buffer.sample(sample_key, n).experience
        env = dqn.CartPole(physics=pair.first.obs, time=jnp.zeros(n, jnp.int32))
        keys = jr.split(env_key, n)
        stepped, _, terminated, _ = jax.vmap(dqn.cartpole_step)(keys, env, pair.first.action)
        return pair.first, pair.second, stepped, terminated

    first, second, stepped, terminated = jax.tree.map(
        np.asarray, sample_and_step(state.buffer, jr.key(3))
    )
    within = ~(first.terminated | first.truncated)
    assert within.any() and first.terminated.any()
    np.testing.assert_allclose(stepped.physics[within], second.obs[within], atol=1e-6)
    np.testing.assert_array_equal(terminated, first.terminated)


def test_main_writes_png(dqn: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "returns.png"
    argv = ["--steps", str(TINY_STEPS), "--seed", "5", "--out", str(out)]
    history = dqn.main(argv, **TINY)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.all(np.isfinite(history.returns))
    printed = capsys.readouterr().out
    assert "chunk  2/2" in printed and "final mean return" in printed
