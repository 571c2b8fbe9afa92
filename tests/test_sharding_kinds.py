"""Every kind of buffer sharded over 8 devices (`shard_rows`): a donated jitted step adds and
samples, keeps the placement and gives the one-device results; and the compiled add and
sample move no stored experience between devices (no collective of storage size). The same
with `sample(..., row_blocks=8)` for the clustered buffers, the `Mixer` and `RateLimited`,
whose block sample then moves nothing but scalars and stays split over the devices, as the
`Queue`'s sample does. An epoch (`epoch` and `epoch_batch`) gives the one-device batches, and
so do `update` and `with_storage`.
Each on a mesh whose axis is `Auto` and on one whose axis is `Explicit` (JAX's default), where
the step moves no more than on `Auto`.

Run in one subprocess with eight host CPU devices (the test process has one); it prints one
line per kind as it finishes."""

import textwrap

import pytest

from .helpers import json_lines_on_host_devices


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


SCRIPT = textwrap.dedent(
    """
    import json
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import equibuffer as eb
    from tests.helpers import collectives, largest_collective as moved
    from tests.mesh_kinds import add, batch as mesh_batch, cluster_of, draw as mesh_draw, EXAMPLE
    from tests.mesh_kinds import kinds, sample as mesh_sample

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    n = 8
    R, L, B = 16, 512, 8  # rows, steps per row, batch: a sample is far smaller than a shard
    BB = 32  # the batch of a row_blocks=8 sample (the mixer's shares 8 and 24: 8 divides both)
    KINDS = kinds(R, L)
    EPOCH_KINDS = [k for k in KINDS if k not in ("queue", "mixer", "rate_limited")]

    def batch(i, t=4):
        return mesh_batch(i, R, t)

    def draw(buffer, key, blocks=1):  # the plain sample (of B, or of BB by blocks)
        return mesh_draw(buffer, key, B if blocks == 1 else BB, blocks)

    def sample(buffer, key, blocks=1):
        return mesh_sample(buffer, key, B if blocks == 1 else BB, blocks)

    @eqx.filter_jit(donate="all-except-first")
    def step(key, buffer, b, blocks):
        return sample(add(buffer, b), key, blocks)

    @eqx.filter_jit(donate="all")
    def prefill(buffer, b):
        return add(buffer, b)

    def shards(tree):
        return [l for l in jax.tree.leaves(tree) if any(l.sharding.spec)]

    def check(mesh, name, build, blocks=1, fill=0):
        one, split = build(), eb.shard_rows(build(), mesh, "envs")
        stored = shards(split)
        assert stored, name  # something is split
        if fill:  # `fill` steps per row first (the clustered blocks: items in every block)
            one = prefill(one, batch(-1, fill))
            put = jax.device_put(batch(-1, fill), NamedSharding(mesh, P("envs")))
            split = prefill(split, put)
        for i in range(4):
            key = jax.random.key(i)
            b = batch(i)
            one, s1 = step(key, one, b, blocks)
            b = jax.device_put(b, NamedSharding(mesh, P("envs")))
            split, s2 = step(key, split, b, blocks)
            for x, y in zip(jax.tree.leaves((one, s1)), jax.tree.leaves((split, s2))):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                                           err_msg=name)
            kept = all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
                       for a, b in zip(shards(split), stored, strict=True))
            assert kept, (name, [l.sharding.spec for l in jax.tree.leaves(split)],
                          [l.shape for l in jax.tree.leaves(split)])
        # `update` and `with_storage` (what `Archive.load` calls), eagerly and under jit.
        if hasattr(split, "update"):
            double = lambda step: {**step, "reward": step["reward"] * 2}
            for fn in (lambda x: x.update(double), lambda x: x.with_storage(x.storage)):
                for run_ in (fn, eqx.filter_jit(fn)):
                    for x, y in zip(jax.tree.leaves(run_(one)), jax.tree.leaves(run_(split)),
                                    strict=True):
                        np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                                      err_msg=name)
        shard = max(l.size // n for l in shards(split))  # one device's part of a stored leaf
        b = jax.device_put(batch(9), NamedSharding(mesh, P("envs")))
        key = jax.random.key(0)
        alone = draw if not isinstance(split, eb.Queue) else lambda q, k, blocks: q.sample()[1]
        return {"kind": name, "shard": shard, "add": moved(add, split, b),
                "sample": moved(lambda x, k: sample(x, k, blocks), split, key),
                "collectives": collectives(lambda x, b, k: sample(add(x, b), k, blocks),
                                           split, b, key),
                "alone": moved(lambda x, k: alone(x, k, blocks), split, key),
                "split": all(tuple(l.sharding.spec)[:1] == ("envs",)
                             for l in jax.tree.leaves(s2.experience)),
                "replicated": all(not any(l.sharding.spec)
                                  for l in jax.tree.leaves(s2.experience)),
                "batch": max(l.size for l in jax.tree.leaves(b)),
                "drawn": max(l.size for l in jax.tree.leaves(s2.experience))}

    @eqx.filter_jit
    def plan(buffer, key):
        return buffer.epoch(key, B)

    @eqx.filter_jit
    def fetch(buffer, epoch, i):
        return buffer.epoch_batch(epoch, i)

    def check_epoch(mesh, name, build):
        # An epoch planned and fetched batch by batch on the mesh gives the one-device batches.
        one, split = build(), eb.shard_rows(build(), mesh, "envs")
        one = prefill(one, batch(0, 8))
        split = prefill(split, jax.device_put(batch(0, 8), NamedSharding(mesh, P("envs"))))
        key = jax.random.key(3)
        e1, e2 = plan(one, key), plan(split, key)
        count = int(e1.num_batches())
        assert count == int(e2.num_batches()) > 1, name
        for i in range(count):
            got, want = fetch(split, e2, i), fetch(one, e1, i)
            for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
        return {"kind": name, "batches": count}

    def run(mesh, name, *args, how=check, **kw):
        name = f"{mesh.axis_types[0].name}:{name}"
        try:
            result = how(mesh, name, *args, **kw)
        except Exception as e:
            result = {"kind": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(result), flush=True)

    for axis_type in (AxisType.Auto, AxisType.Explicit):  # JAX's default since 0.7: Explicit
        mesh = jax.make_mesh((n,), ("envs",), axis_types=(axis_type,))
        for name, build in KINDS.items():
            run(mesh, name, build)
        # row_blocks=8: block d of the sample from device d's part. The clustered buffers are
        # filled first (128 steps of 16 rows: every cluster full), so that every block of
        # every cluster's slots holds items.
        for name in ("clustered", "prioritised_clustered", "mixer", "rate_limited"):
            fill = 128 if "clustered" in name else 0
            run(mesh, f"{name}_blocks", KINDS[name], blocks=n, fill=fill)
        for name in EPOCH_KINDS:
            run(mesh, f"{name}_epoch", KINDS[name], how=check_epoch)

    mesh = jax.make_mesh((n,), ("envs",), axis_types=(AxisType.Explicit,))
    uneven = eb.ClusteredBuffer(EXAMPLE, add_batch_size=R, num_clusters=3, cluster_capacity=12,
                                cluster_fn=cluster_of)
    try:
        eb.shard_rows(uneven, mesh, "envs")
    except ValueError as e:
        print(json.dumps({"kind": "uneven_clusters", "error": str(e)}))
    """
)

KINDS = [
    *("trajectory", "transition", "item", "prioritised", "prioritised_item", "episodes"),
    *("prioritised_episodes", "n_step", "queue", "clustered", "prioritised_clustered"),
    *("mixer", "rate_limited"),
]
BLOCK_KINDS = ["clustered", "prioritised_clustered", "mixer", "rate_limited"]
N = 8  # devices
AXIS_TYPES = ["Auto", "Explicit"]


@pytest.fixture(scope="module")
def results() -> dict:
    return json_lines_on_host_devices(SCRIPT, N, timeout=900, key="kind")


def _case(results: dict, name: str) -> dict:
    got = results["cases"].get(name)
    assert got is not None, f"{name} did not finish (hang or abort): {results['stderr']}"
    assert "error" not in got, got["error"]
    return got


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_kind_on_a_mesh_matches_one_device_and_moves_no_storage(results, kind, axis_type):
    got = _case(results, f"{axis_type}:{kind}")
    # Only scalars and (batch, ...) results cross devices: no collective of an add is larger
    # than the batch added (the clustered buffers route its items to the devices holding their
    # slots), none of a sample larger than the sample; both far from a shard of the storage.
    assert max(got["batch"], got["drawn"]) < got["shard"], got
    assert got["add"] <= got["batch"], got
    assert got["sample"] <= got["drawn"], got
    if axis_type == "Explicit" and kind != "queue":  # its type says so: on every device
        assert got["replicated"], got


@pytest.mark.parametrize("kind", [*KINDS, *(f"{k}_blocks" for k in BLOCK_KINDS)])
def test_explicit_axes_move_no_more_than_auto_axes(results, kind):
    """The step (add, sample, set_priorities) on an `Explicit` mesh moves between devices no
    more than on an `Auto` one: no more collectives, none larger, no more in all. (Most kinds
    compile to the same collectives; where XLA spreads a replicated sum tree's update over
    the devices on `Auto` axes, the `Explicit` step, whose methods pin it replicated, moves
    less.)"""
    auto, explicit = (_case(results, f"{t}:{kind}")["collectives"] for t in AXIS_TYPES)
    assert len(explicit) <= len(auto) and sum(explicit) <= sum(auto), (auto, explicit)
    assert max([0, *explicit]) <= max([0, *auto]), (auto, explicit)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_row_blocks_on_a_mesh_match_one_device_and_move_nothing(results, kind, axis_type):
    # The step (add, sample by blocks, set_priorities) gave the one-device results (checked
    # in the script) and moved no storage.
    got = _case(results, f"{axis_type}:{kind}_blocks")
    assert max(got["batch"], got["drawn"]) < got["shard"], got
    assert got["add"] <= got["batch"], got
    assert got["sample"] <= got["drawn"], got
    # The block sample alone: each device draws and gathers its block from its own part
    # (a few scalars at most cross devices), and the result stays split, block d on device d.
    assert got["alone"] <= N < got["drawn"], got
    assert got["split"], got


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("queue", "mixer", "rate_limited")])
def test_epochs_on_a_mesh_give_the_one_device_batches(results, kind, axis_type):
    assert _case(results, f"{axis_type}:{kind}_epoch")["batches"] > 1


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_queue_sample_stays_split_and_moves_nothing(results, axis_type):
    got = _case(results, f"{axis_type}:queue")
    # Each device reads its own rows' unread steps: no collective beyond scalars, and the
    # `(rows, sequence_length, ...)` result is split over the devices like the rows.
    assert got["sample"] <= N < got["drawn"], got
    assert got["alone"] <= N, got
    assert got["split"], got


def test_cluster_capacity_must_split_evenly(results):
    assert results["cases"]["uneven_clusters"]["error"] == (
        "shard_rows(): a clustered buffer of cluster_capacity=12 cannot split every cluster's "
        "slots evenly over the 8 devices of mesh axis 'envs'; use a multiple of 8."
    )
