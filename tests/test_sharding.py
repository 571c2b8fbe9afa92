"""Buffers split over devices along their rows (`shard_rows`): the same results as on one
device, the placement kept by donated jitted steps, and no gather of the stored data.

Run in a subprocess with two host CPU devices (the test process has one)."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import equibuffer as eb

from .helpers import xla_flags


SCRIPT = textwrap.dedent(
    """
    import os, re
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, PartitionSpec as P
    import equibuffer as eb

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 2
    rows = 4
    example = {"obs": jnp.zeros(3), "done": jnp.bool_(False)}

    def batch(i):
        obs = jnp.arange(rows * 5 * 3, dtype=jnp.float32).reshape(rows, 5, 3) + 100 * i
        done = (jnp.arange(rows * 5).reshape(rows, 5) + i) % 7 == 0
        return {"obs": obs, "done": done}

    def learn(buffer, key):
        if isinstance(buffer, eb.AbstractPrioritisedBuffer):
            sample = buffer.sample(key, 8, beta=0.5)
            buffer = buffer.set_priorities(sample, sample.weights + 1.0)
            return buffer, sample
        return buffer, buffer.sample(key, 8)

    @eqx.filter_jit(donate="all-except-first")
    def step(key, buffer, batch):
        buffer = buffer.add(batch)
        return learn(buffer, key)

    builders = {
        "trajectory": lambda: eb.TrajectoryBuffer(
            example, add_batch_size=rows, max_length_time_axis=12, sequence_length=4),
        "prioritised": lambda: eb.PrioritisedTrajectoryBuffer(
            example, add_batch_size=rows, max_length_time_axis=12, sequence_length=3),
        "episodes": lambda: eb.EpisodeTrajectoryBuffer(
            example, add_batch_size=rows, max_length_time_axis=12, sequence_length=3, mode="pad"),
    }
    GATHERED = r"= \\w+\\[([\\d,]*)\\]\\S* all-gather\\("
    assert re.findall(GATHERED, "%a = f32[28,1]{1,0} all-gather(%b), x") == ["28,1"]
    def rows_split(leaf):
        return tuple(leaf.sharding.spec)[:1] == ("envs",)

    for (name, build), axis_type in (
        (case, t) for t in (AxisType.Auto, AxisType.Explicit) for case in builders.items()
    ):
        mesh = jax.make_mesh((2,), ("envs",), axis_types=(axis_type,))
        one, split = build(), eb.shard_rows(build(), mesh, "envs")
        assert rows_split(split.storage.data["obs"]), name
        for i in range(4):  # wraps the ring of 12 steps
            key = jax.random.key(i)
            one, s1 = step(key, one, batch(i))
            b = jax.device_put(batch(i), jax.sharding.NamedSharding(mesh, P("envs")))
            split, s2 = step(key, split, b)
            for x, y in zip(jax.tree.leaves((one, s1)), jax.tree.leaves((split, s2))):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
            for leaf in jax.tree.leaves(split.storage.data):
                assert rows_split(leaf), (name, leaf.sharding)
                assert leaf.addressable_shards[0].data.shape[0] == rows // 2, name
        # The stored data is never gathered across devices: only the sample (and, for the
        # episode buffer, the few window flags an add refreshes) is combined.
        arrays, static = eqx.partition(split, eqx.is_array)

        def raw(key, arrays, batch):
            buffer, sample = learn(eqx.combine(arrays, static).add(batch), key)
            return eqx.partition(buffer, eqx.is_array)[0], sample

        hlo = jax.jit(raw).lower(jax.random.key(0), arrays, batch(0)).compile().as_text()
        shapes = re.findall(GATHERED, hlo)
        sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
        stored = split.storage.data["obs"].size
        assert all(n < stored // 2 for n in sizes), (name, shapes)
        print(axis_type.name, name, "ok")
    """
)


@pytest.mark.slow  # (it starts a process with two host devices)
def test_sharded_buffers_match_one_device():
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",  # two host devices, also on a machine with an accelerator
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = ("trajectory", "prioritised", "episodes")
    assert out.stdout.split() == [
        word for t in ("Auto", "Explicit") for name in names for word in (t, name, "ok")
    ]


def _buffer(rows: int) -> eb.TrajectoryBuffer:
    return eb.TrajectoryBuffer(
        {"obs": jnp.zeros(3)}, add_batch_size=rows, max_length_time_axis=8, sequence_length=2
    )


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_shard_rows_errors(axis_type):
    mesh = jax.make_mesh((1,), ("envs",), axis_types=(axis_type,))
    with pytest.raises(ValueError, match=r"no axis 'rows'; its axes are \('envs',\)"):
        eb.shard_rows(_buffer(2), mesh, "rows")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_shard_rows_on_one_device_keeps_values(axis_type):
    mesh = jax.make_mesh((1,), ("envs",), axis_types=(axis_type,))
    buffer = _buffer(3).add({"obs": jnp.ones((3, 5, 3))})
    placed = eb.shard_rows({"buffer": buffer, "step": jnp.int32(7)}, mesh, "envs")
    assert int(placed["step"]) == 7
    assert (placed["buffer"].storage.data["obs"] == buffer.storage.data["obs"]).all()
    assert int(placed["buffer"].storage.fill) == 5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_on_an_explicit_mesh_every_method_says_its_sharding(jit):
    """On a mesh of `Explicit` axes (JAX's default) a buffer's methods run eagerly and under
    `filter_jit` alike: the buffer keeps the sharding of its stored steps (in its type), a
    sample of row blocks is split over the rows' axis, and so is the global sample on an
    axis of one device (one block; on 8 devices it is replicated:
    tests/test_sharding_kinds.py)."""
    mesh = jax.make_mesh((1,), ("envs",), axis_types=(AxisType.Explicit,))
    buffer = eb.shard_rows(
        eb.PrioritisedTrajectoryBuffer(
            {"obs": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=8, sequence_length=2
        ),
        mesh,
        "envs",
    )

    def step(buffer, batch, key):
        buffer = buffer.add(batch)
        sample = buffer.sample(key, 4, beta=0.5)
        blocks = buffer.sample(key, 4, beta=0.5, row_blocks=2)
        return buffer.set_priorities(sample, sample.weights + 1.0), sample, blocks

    run = eqx.filter_jit(step) if jit else step
    batch = {"obs": jnp.arange(30, dtype=jnp.float32).reshape(2, 5, 3)}
    buffer, sample, blocks = run(buffer, batch, jax.random.key(0))
    stored = jax.typeof(buffer.storage.data["obs"])
    assert tuple(stored.sharding.spec)[:1] == ("envs",)
    assert tuple(jax.typeof(sample.experience["obs"]).sharding.spec)[:1] == ("envs",)
    assert tuple(jax.typeof(blocks.experience["obs"]).sharding.spec)[:1] == ("envs",)
    assert sample.experience["obs"].shape == (4, 2, 3)
    assert float(buffer.tree.total()) > 0
    one = eb.PrioritisedTrajectoryBuffer(
        {"obs": jnp.zeros(3)}, add_batch_size=2, max_length_time_axis=8, sequence_length=2
    )
    _, expected, _ = eqx.filter_jit(step)(one, batch, jax.random.key(0))  # (one device)
    assert (sample.experience["obs"] == expected.experience["obs"]).all()
