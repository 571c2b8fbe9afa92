"""`per_device`: one whole buffer of every kind on each of 8 devices, stepped per device by a
donated `jax.shard_map` step and by `eqx.filter_vmap` under jit. Device `d`'s buffer gives
exactly what the same buffer on one device gives from device `d`'s batches and keys, the
placement is kept, and the compiled steps move no stored experience between devices. On a
mesh whose axis is `Auto` and on one whose axis is `Explicit`.

Run in one subprocess with eight host CPU devices (the test process has one); it prints one
line per kind as it finishes."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb

from .helpers import json_lines_on_host_devices
from .mesh_kinds import kinds


SCRIPT = textwrap.dedent(
    """
    import json
    from functools import partial
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import equibuffer as eb
    from tests.helpers import largest_collective as moved
    from tests.mesh_kinds import add, batch, kinds, sample

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    n, R, L, B = 8, 2, 64, 4  # devices; each device's rows, steps per row, batch
    for AXIS in ("Auto", "Explicit"):  # JAX's default since 0.7: Explicit
        mesh = jax.make_mesh((n,), ("envs",), axis_types=(jax.sharding.AxisType[AXIS],))
        split = NamedSharding(mesh, P("envs"))
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:  # jax < 0.6
            from jax.experimental.shard_map import shard_map

        def local(key, buffer, b):  # what one device runs: its buffer, its batch, its key
            return sample(add(buffer, b), key, B)

        def mapped(keys, buffers, b):  # in shard_map: leading axis 1 in, 1 out
            out = local(keys[0], jax.tree.map(lambda x: x[0], buffers), b)
            return jax.tree.map(lambda x: x[None], out)

        by_shard_map = eqx.filter_jit(
            shard_map(mapped, mesh=mesh, in_specs=P("envs"), out_specs=P("envs")),
            donate="all-except-first")
        by_vmap = eqx.filter_jit(eqx.filter_vmap(local), donate="all-except-first")
        one = eqx.filter_jit(local, donate="all-except-first")

        def check(name, build):
            stacked = {"shard_map": eb.per_device(build(), mesh, "envs"),
                       "vmap": eb.per_device(build(), mesh, "envs")}
            singles = [build() for _ in range(n)]
            result = {"kind": name}
            for i in range(4):
                keys = jax.random.split(jax.random.key(i), n)
                whole = batch(i, n * R)  # device d's rows: d * R .. (d + 1) * R
                parts = [jax.tree.map(lambda x: x[d * R:(d + 1) * R], whole) for d in range(n)]
                expect = []
                for d in range(n):
                    singles[d], s = one(keys[d], singles[d], parts[d])
                    expect.append((singles[d], s))
                expect = jax.tree.map(lambda *x: np.stack(x), *expect)
                for how, step in (("shard_map", by_shard_map), ("vmap", by_vmap)):
                    b = whole if how == "shard_map" else jax.tree.map(
                        lambda x: x.reshape(n, R, *x.shape[1:]), whole)
                    stacked[how], s = step(*jax.device_put((keys, stacked[how], b), split))
                    got = jax.tree.leaves((stacked[how], s))
                    want = jax.tree.leaves(expect)
                    assert len(got) == len(want), (how, len(got), len(want))
                    for x, y in zip(got, want):
                        np.testing.assert_allclose(np.asarray(x).reshape(y.shape), y, rtol=1e-6,
                                                   err_msg=f"{name} {how} step {i}")
                    # Kept split; only a scalar per device (a counter computed alike for every
                    # copy, such as the clustered buffers' `added` under vmap) may be replicated.
                    specs = {tuple(l.sharding.spec) for l in jax.tree.leaves(stacked[how])
                             if l.size > n}
                    assert {(s[0], any(s[1:])) for s in specs} == {("envs", False)}, (how, specs)
            keys = jax.device_put(jax.random.split(jax.random.key(9), n), split)
            b = jax.device_put(batch(9, n * R), split)
            result["shard_map"] = moved(by_shard_map, keys, stacked["shard_map"], b)
            b = jax.tree.map(lambda x: x.reshape(n, R, *x.shape[1:]), batch(9, n * R))
            b = jax.device_put(b, split)
            result["vmap"] = moved(by_vmap, keys, stacked["vmap"], b)
            leaves = jax.tree.leaves(stacked["vmap"])
            result["shard"] = min(l.size // n for l in leaves if l.ndim > 2)
            return result

        for name, build in kinds(R, L).items():
            try:
                result = check(name, build)
            except Exception as e:
                result = {"kind": name, "error": f"{type(e).__name__}: {e}"[:2000]}
            result["kind"] = f"{AXIS}:{name}"
            print(json.dumps(result), flush=True)
    """
)

KINDS = list(kinds(1, 1))


@pytest.fixture(scope="module")
def results() -> dict:
    return json_lines_on_host_devices(SCRIPT, 8, timeout=900, key="kind")


@pytest.mark.slow  # starts a process with 8 devices: `nox -s slow`, and CI
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_device_steps_its_own_buffer(results, kind, axis_type):
    got = results["cases"].get(f"{axis_type}:{kind}")
    assert got is not None, f"the kind did not finish (hang or abort): {results['stderr']}"
    assert "error" not in got, got["error"]
    # Per device, nothing crosses devices but the checks' flags (one per check, combined so
    # that a failing check raises on every device): no collective of more than a few scalars.
    assert got["shard_map"] <= 4 < got["shard"], got
    assert got["vmap"] <= 4, got


def test_copies_are_placed_from_the_one_buffer():
    mesh = jax.make_mesh((1,), ("envs",))
    buffer = eb.PrioritisedTrajectoryBuffer(
        {"obs": jnp.zeros(2)}, add_batch_size=2, max_length_time_axis=8, sequence_length=2
    ).add({"obs": jnp.ones((2, 3, 2))})
    state = (buffer, jax.random.key(3), "not an array")  # a train state holds keys too
    copies, key, text = eb.per_device(state, mesh, "envs")
    for x, y in zip(jax.tree.leaves(copies), jax.tree.leaves(buffer), strict=True):
        assert x.shape == (1, *y.shape) and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y))
    assert key.shape == (1,) and text == "not an array"
    np.testing.assert_array_equal(jax.random.key_data(key[0]), jax.random.key_data(state[1]))
    with pytest.raises(ValueError, match=r"^per_device\(\): the mesh has no axis 'rows'; its "):
        eb.per_device(buffer, mesh, "rows")
