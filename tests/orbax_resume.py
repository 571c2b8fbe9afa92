"""A run of every kind of buffer in one train state, checkpointed with orbax and resumed in
another process (tests/test_orbax.py). `python -m tests.orbax_resume MODE DIRECTORY AXIS`:

- `run`: 8 donated steps (add, sample, set priorities); after step 4 an async save by a
    `CheckpointManager`, the next steps started at once (its arrays donated while the save
    writes); the samples of steps 5 to 8 written to `DIRECTORY/expected.npz`.
- `resume`: a new process restores the newest step into a template (sharded as the run
    was, when the process has several devices) and runs steps 5 to 8; prints one JSON line:
    whether every sample equals the run's, bit for bit, and the shardings restored.

`AXIS` is the mesh axis type on several devices (`Auto` or `Explicit`), ignored on one.
"""

import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding

import equibuffer as eb

from .mesh_kinds import add, batch, kinds, sample


R, L, B, SAVED, STEPS = 8, 32, 8, 4, 8  # rows, steps per row, batch, step saved, steps


def _mesh(axis: str):
    n = jax.device_count()
    return None if n == 1 else jax.make_mesh((n,), ("envs",), axis_types=(AxisType[axis],))


def make_state() -> dict:
    return {
        "buffers": {name: build() for name, build in kinds(R, L).items()},
        "key": jax.random.key(7),  # a typed key, restored as one
    }


def _placed(tree, mesh):
    return tree if mesh is None else eb.shard_rows(tree, mesh, "envs")


@eb.filter_jit(donate="all-except-first")
def step(t, state):  # batch t for every kind, its sample, its priorities set
    key = jax.random.fold_in(state["key"], t)
    buffers, drawn = {}, {}
    for i, (name, buffer) in enumerate(state["buffers"].items()):
        buffer = add(buffer, batch(t, R))
        buffers[name], s = sample(buffer, jax.random.fold_in(key, i), B)
        drawn[name] = jax.tree.leaves(s)
    return {"buffers": buffers, "key": key}, drawn


def run(directory: str, axis: str) -> None:
    mesh = _mesh(axis)
    state = _placed(make_state(), mesh)
    expected = {}
    with ocp.CheckpointManager(directory + "/ckpt") as manager:
        for t in range(1, STEPS + 1):
            state, drawn = step(jnp.int32(t), state)
            if t == SAVED:  # async: the next steps start (and donate) while it writes
                manager.save(t, args=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)))
            if t > SAVED:
                for name, leaves in drawn.items():
                    for j, leaf in enumerate(leaves):
                        expected[f"{t}/{name}/{j}"] = np.asarray(leaf)
        manager.wait_until_finished()
    np.savez(directory + "/expected.npz", **expected)


def resume(directory: str, axis: str) -> None:
    mesh = _mesh(axis)
    template = _placed(eqx.filter_eval_shape(make_state), mesh)
    arrays, static = eqx.partition(template, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    with ocp.CheckpointManager(directory + "/ckpt") as manager:
        latest = manager.latest_step()
        restored = manager.restore(latest, args=ocp.args.StandardRestore(arrays))
    state = eqx.combine(restored, static)
    placed = all(
        x.sharding.is_equivalent_to(
            s.sharding if mesh is not None else x.sharding,
            x.ndim,  # (one device: its own)
        )
        for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(arrays), strict=True)
    )
    split = sum(
        any(x.sharding.spec)
        for x in jax.tree.leaves(restored)
        if isinstance(x.sharding, NamedSharding)
    )
    expected = np.load(directory + "/expected.npz")
    differ = []
    for t in range(SAVED + 1, STEPS + 1):
        state, drawn = step(jnp.int32(t), state)
        for name, leaves in drawn.items():
            for j, leaf in enumerate(leaves):
                want = expected[f"{t}/{name}/{j}"]
                got = np.asarray(leaf)
                if got.dtype != want.dtype or not np.array_equal(got, want, equal_nan=True):
                    differ.append(f"{t}/{name}/{j}")
    key = state["key"]
    print(
        json.dumps(
            {
                "latest": latest,
                "kinds": sorted(state["buffers"]),
                "differ": differ,
                "compared": len(expected.files),
                "placed": placed,
                "split": split,
                "typed_key": bool(jnp.issubdtype(key.dtype, jax.dtypes.prng_key)),
                "devices": jax.device_count(),
            }
        )
    )


if __name__ == "__main__":
    mode, directory, axis = sys.argv[1:]
    {"run": run, "resume": resume}[mode](directory, axis)
