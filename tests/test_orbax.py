"""Checkpoints with orbax (docs/checkpoints.md): every kind of buffer in a train state saved
(arrays only) and restored into a template made by `eqx.filter_eval_shape`, on one device
and sharded over 8 (restored with its shardings, the template placed by `shard_rows`
without allocating); the run resumed in a new process gives the samples of a run that never
stopped, bit for bit; typed keys and a recorded failure round-trip; a process killed during
an async save leaves the last complete step. (Two processes writing their own shards:
tests/test_many_hosts.py, from the recipe of docs/scaling.md.)"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import equibuffer as eb

from .helpers import spread, xla_flags
from .mesh_kinds import add, batch, kinds, sample


def _save(directory, state, step=1):
    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)))
        manager.wait_until_finished()


def _restore(directory, template):
    arrays, static = eqx.partition(template, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(arrays))
    return eqx.combine(restored, static)


@pytest.mark.parametrize("kind", spread(kinds(1, 1)))
def test_every_kind_round_trips_into_a_template(tmp_path, kind):
    build = kinds(4, 16)[kind]
    state = {"buffer": build(), "key": jax.random.key(3), "step": jnp.int32(0)}
    step = eqx.filter_jit(lambda s, b, k: sample(add(s, b), k, 4))
    for i in range(3):
        state["buffer"], _ = step(state["buffer"], batch(i, 4), jax.random.key(i))
    _save(tmp_path, state)
    template = eqx.filter_eval_shape(
        lambda: {"buffer": build(), "key": jax.random.key(0), "step": jnp.int32(0)}
    )
    restored = _restore(tmp_path, template)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key, restored as one
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # And the restored buffer steps as the saved one does.
    after = [step(s["buffer"], batch(9, 4), jax.random.key(9)) for s in (state, restored)]
    for x, y in zip(*(jax.tree.leaves(a) for a in after), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_recorded_failure_is_saved_with_the_buffer(tmp_path):
    """A check that failed inside jit is kept in the buffer's error word: restored, the
    buffer raises it at its first eager use, as the saved one does."""
    make = lambda: eb.Queue(  # noqa: E731
        {"x": jnp.float32(0)}, add_batch_size=1, max_length_time_axis=4, sequence_length=2
    )
    queue = make().add({"x": jnp.ones((1, 4))})
    full = eqx.filter_jit(lambda q: q.add({"x": jnp.ones((1, 1))}))(queue)  # refused, recorded
    _save(tmp_path, full)
    restored = _restore(tmp_path, eqx.filter_eval_shape(make))
    for q in (full, restored):
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"^Queue.add\(\): the queue is full"):
            eb.check(q)
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"^Queue.add\(\): the queue is full"):
            q.sample()  # any eager method call raises it first


def test_a_large_buffer_is_saved_in_chunks_of_the_size_asked(tmp_path):
    """docs/checkpoints.md's save of a large buffer: `ocp.SaveArgs(chunk_byte_size=...)` for
    every array. orbax stores each array in chunks of at most that many bytes (what its
    writes stage at a time: measured in benchmarks/bench_checkpoint.py), and the state
    restores bit for bit."""
    make = lambda: {  # noqa: E731
        "buffer": eb.TrajectoryBuffer(
            {"obs": jnp.zeros(64), "done": jnp.bool_(False)},
            add_batch_size=8,
            max_length_time_axis=4096,
            sequence_length=2,
        ),
        "step": jnp.int32(0),
    }
    state = make()
    obs = jax.random.normal(jax.random.key(0), (8, 4096, 64))
    state["buffer"] = state["buffer"].add({"obs": obs, "done": obs[..., 0] > 1})
    arrays = eqx.filter(state, eqx.is_array)
    chunk = 1 << 20  # 1 MiB; the observations are 8 MiB
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), arrays)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave(arrays, save_args=save_args))
        manager.wait_until_finished()
        stored = manager.item_metadata(1).tree
    metas = jax.tree.leaves(stored, is_leaf=lambda x: hasattr(x, "storage"))
    (stored_obs,) = [m for m in metas if tuple(m.shape) == (8, 4096, 64)]
    # The 8 MiB of observations in at least 8 chunks.
    assert np.prod(stored_obs.storage.write_shape) >= 8 * np.prod(stored_obs.storage.chunk_shape)
    for meta in metas:
        itemsize = np.dtype(meta.dtype).itemsize
        assert np.prod(meta.storage.chunk_shape, dtype=int) * itemsize <= chunk, meta.name
    restored = _restore(tmp_path, eqx.filter_eval_shape(make))
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
@pytest.mark.parametrize("devices", [1, 8])
def test_a_run_resumed_in_a_new_process_gives_the_same_samples(tmp_path, devices):
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = []
    for mode in ("run", "resume"):
        out = subprocess.run(
            [sys.executable, "-m", "tests.orbax_resume", mode, str(tmp_path), "Explicit"],
            capture_output=True, text=True, env=env, timeout=600, cwd=root,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(out.stdout)
    got = json.loads(outs[1].strip().splitlines()[-1])
    assert got["devices"] == devices and got["latest"] == 4
    assert got["kinds"] == sorted(kinds(1, 1))  # every kind, in one train state
    assert got["compared"] > 100 and got["differ"] == [], got
    assert got["placed"] and got["typed_key"], got
    # On 8 devices the stored steps came back split (the template's shardings).
    assert (got["split"] > 0) == (devices > 1), got


KILLED = textwrap.dedent(
    """
    import sys, time
    import equinox as eqx, jax, jax.numpy as jnp, orbax.checkpoint as ocp
    from tests.test_orbax import big_state

    directory = sys.argv[1]
    manager = ocp.CheckpointManager(directory)
    manager.save(1, args=ocp.args.StandardSave(eqx.filter(big_state(1.0), eqx.is_array)))
    manager.wait_until_finished()
    manager.save(2, args=ocp.args.StandardSave(eqx.filter(big_state(2.0), eqx.is_array)))
    print("saving", flush=True)  # the async save of step 2 is writing: killed now
    time.sleep(60)
    """
)


def big_state(value: float) -> dict:
    """A train state of 2 x 256 MB of stored steps (value `value` everywhere), and a key."""
    buffer = eb.TrajectoryBuffer(
        {"obs": jnp.zeros(1024)}, add_batch_size=64, max_length_time_axis=1024, sequence_length=2
    )
    buffer = buffer.add({"obs": jnp.full((64, 1024, 1024), value)})
    return {"buffer": buffer, "key": jax.random.key(int(value))}


@pytest.mark.slow
def test_a_process_killed_during_an_async_save_leaves_the_last_complete_step(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    with subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = proc.stdout.readline()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            proc.kill()
        stderr = proc.stderr.read()
    assert line.strip() == "saving", stderr[-3000:]
    leftover = sorted(os.listdir(tmp_path))
    assert "1" in leftover and "2" not in leftover, leftover  # step 2 never committed ...
    assert any(name.startswith("2.") for name in leftover), leftover  # ... killed mid-write
    with ocp.CheckpointManager(tmp_path) as manager:
        assert manager.latest_step() == 1 and manager.all_steps() == [1]
    restored = _restore(tmp_path, eqx.filter_eval_shape(lambda: big_state(0.0)))
    assert float(restored["buffer"].storage.data["obs"].min()) == 1.0
    assert float(restored["buffer"].storage.data["obs"].max()) == 1.0
    assert int(restored["buffer"].storage.fill) == 1024
    assert jax.random.key_data(restored["key"]).tolist() == [0, 1]
