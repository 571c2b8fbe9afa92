"""The sampling law of a buffer sharded over 8 devices (`shard_rows`), by chi-square: `sample`
draws by the one-device law over the rows of every device, and `sample(..., row_blocks=8)`
draws each device's block of the sample from that device's rows only, by the buffer's rule
restricted to them; on a mesh whose axis is `Auto` and on one whose axis is `Explicit`. The
compiled block sample moves nothing between devices, and the Flashbax `pmap` recipe of
docs/scaling.md runs on the 8 devices.

Run in one subprocess with eight host CPU devices (the test process has one); the script
counts the draws and prints them, the chi-square tests are made here."""

import pathlib
import re
import textwrap

import numpy as np
import pytest

from .helpers import (
    _COLLECTIVE,
    _SHAPE,
    chi_square_pvalue,
    json_lines_on_host_devices,
    ReferenceRing,
)


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE_HEADING = "## Flashbax's pmap recipe on a mesh"

R, L, SEQ, T, N = 16, 8, 3, 11, 8  # rows, steps per row, window, steps added, devices
ALPHA, KEYS, BATCH = 0.6, 128, 256
AXIS_TYPES = ["Auto", "Explicit"]

SCRIPT = textwrap.dedent(
    f"""
    import json
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, PartitionSpec as P
    import equibuffer as eb
    from tests.helpers import largest_collective

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    R, L, SEQ, T, N, ALPHA, KEYS, BATCH = {R}, {L}, {SEQ}, {T}, {N}, {ALPHA}, {KEYS}, {BATCH}
    for AXIS in ("Auto", "Explicit"):  # JAX's default since 0.7: Explicit
        mesh = jax.make_mesh((N,), ("envs",), axis_types=(AxisType[AXIS],))
        ex = {{"obs": jnp.zeros(2)}}
        batch = {{"obs": jnp.arange(R * T * 2, dtype=jnp.float32).reshape(R, T, 2)}}

        def uniform():
            b = eb.TrajectoryBuffer(ex, add_batch_size=R, max_length_time_axis=L,
                                    sequence_length=SEQ)
            return eb.shard_rows(b, mesh, "envs").add(batch)

        def prioritised():
            b = eb.PrioritisedItemBuffer(ex, add_batch_size=R, max_length_time_axis=L,
                                         alpha=ALPHA)
            b = eb.shard_rows(b, mesh, "envs").add(batch)
            # Unequal priorities, some 0, set through set_priorities (items: held steps 3..10).
            priorities = np.random.default_rng(0).uniform(0.2, 3.0, R * L).astype(np.float32)
            priorities[::7] = 0.0
            rows, slots = np.divmod(np.arange(R * L), L)
            steps = (slots - T % L) % L + T - L  # the absolute step held in each slot
            b = b.set_priorities(jnp.arange(R * L), jnp.asarray(priorities),
                                 steps=jnp.asarray(steps, jnp.uint32))
            return b, priorities

        def draws(buffer, blocks):
            @eqx.filter_jit
            def many(buffer, keys):
                return jax.vmap(lambda k: buffer.sample(k, BATCH, row_blocks=blocks))(keys)
            s = many(buffer, jax.random.split(jax.random.key(blocks), KEYS))
            return s

        def counts(indices, blocks):
            # (blocks, R * L): how often each window was drawn in each block of the sample.
            per = np.asarray(indices).reshape(KEYS, blocks, BATCH // blocks)
            return [np.bincount(per[:, b].ravel(), minlength=R * L).tolist()
                    for b in range(blocks)]

        out = {{}}
        u = uniform()
        p, priorities = prioritised()
        out["priorities"] = priorities.tolist()
        for name, buffer in (("uniform", u), ("prioritised", p)):
            for blocks in (1, N):
                s = draws(buffer, blocks)
                case = {{"case": f"{{AXIS}}:{{name}}_{{blocks}}",
                         "counts": counts(s.indices, blocks)}}
                if name == "prioritised":
                    case["probabilities"] = np.asarray(s.probabilities).tolist()
                    case["weights"] = np.asarray(s.weights).tolist()
                    case["indices"] = np.asarray(s.indices).tolist()
                print(json.dumps(case), flush=True)

        # What the compiled sample moves, and where its result lands: on buffers far larger
        # than a sample (512 steps per row, 16 windows drawn).
        big = dict(add_batch_size=R, max_length_time_axis=512)
        for name, buffer in (("uniform", eb.TrajectoryBuffer(ex, sequence_length=SEQ, **big)),
                             ("prioritised", eb.PrioritisedItemBuffer(ex, **big))):
            buffer = eb.shard_rows(buffer, mesh, "envs").add(batch)
            for blocks in (1, N):
                fn = lambda b, k: b.sample(k, 2 * N, row_blocks=blocks)
                s = eqx.filter_jit(fn)(buffer, jax.random.key(0))
                print(json.dumps({{
                    "case": f"{{AXIS}}:moved_{{name}}_{{blocks}}",
                    "moved": largest_collective(fn, buffer, jax.random.key(0)),
                    "drawn": int(s.experience["obs"].size),
                    "shard": int(buffer.storage.data["obs"].size // N),
                    "split": tuple(s.experience["obs"].sharding.spec)[:1] == ("envs",),
                }}), flush=True)
        print(json.dumps({{"case": f"{{AXIS}}:priorities", "priorities": out["priorities"]}}),
              flush=True)
    """
)


def _recipe() -> str:
    """The ```python block of the pmap recipe section of docs/scaling.md."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    section = text.split(RECIPE_HEADING, 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return textwrap.dedent(code)


RECIPE_SCRIPT = (
    "import json, jax\n"
    + _recipe()
    + "\nprint(json.dumps({'case': 'recipe', 'devices': jax.device_count()}))\n"
)


@pytest.fixture(scope="module")
def results() -> dict:
    got = json_lines_on_host_devices(SCRIPT, N, timeout=500, key="case")
    recipe = json_lines_on_host_devices(RECIPE_SCRIPT, N, timeout=300, key="case")
    got["cases"].update(recipe["cases"])
    got["stderr"] += recipe["stderr"]
    return got


def _case(results: dict, name: str) -> dict:
    got = results["cases"].get(name)
    assert got is not None, f"{name} did not finish: {results['stderr']}"
    return got


def _valid_windows() -> np.ndarray:
    """The flat indices `row * L + slot` of the valid windows of the uniform buffer."""
    ref = ReferenceRing(R, L, SEQ, 1)
    ref.add(np.zeros((R, T)))
    slots = [s % L for s in ref.valid_starts()]
    return np.array([row * L + s for row in range(R) for s in slots])


def _uniform_target(rows: range) -> np.ndarray:
    target = np.zeros(R * L)
    valid = _valid_windows()
    valid = valid[np.isin(valid // L, list(rows))]
    target[valid] = 1.0
    return target


def _priority_target(results: dict, rows: range) -> np.ndarray:
    p = np.asarray(_case(results, "Auto:priorities")["priorities"], np.float64)
    target = np.where(p > 0, p**ALPHA, 0.0)
    outside = ~np.isin(np.arange(R * L) // L, list(rows))
    target[outside] = 0.0
    return target


@pytest.mark.parametrize("axis", AXIS_TYPES)
def test_global_sample_is_uniform_over_every_window_of_every_device(results, axis):
    (counts,) = _case(results, f"{axis}:uniform_1")["counts"]
    assert sum(counts) == KEYS * BATCH
    assert chi_square_pvalue(np.asarray(counts), _uniform_target(range(R))) > 1e-3


@pytest.mark.parametrize("axis", AXIS_TYPES)
def test_global_prioritised_sample_is_proportional_over_every_device(results, axis):
    (counts,) = _case(results, f"{axis}:prioritised_1")["counts"]
    target = _priority_target(results, range(R))
    assert chi_square_pvalue(np.asarray(counts), target) > 1e-3
    case = _case(results, f"{axis}:prioritised_1")
    indices = np.asarray(case["indices"])
    np.testing.assert_allclose(case["probabilities"], target[indices] / target.sum(), rtol=1e-4)


@pytest.mark.parametrize("axis", AXIS_TYPES)
@pytest.mark.parametrize("kind", ["uniform", "prioritised"])
def test_each_device_block_draws_from_its_own_rows_by_the_rule(results, kind, axis):
    blocks = _case(results, f"{axis}:{kind}_{N}")["counts"]
    rows_per = R // N
    for b, counts in enumerate(blocks):
        rows = range(b * rows_per, (b + 1) * rows_per)
        target = _uniform_target(rows) if kind == "uniform" else _priority_target(results, rows)
        counts = np.asarray(counts)
        assert counts.sum() == KEYS * BATCH // N
        # Zero-target windows (other devices' rows, invalid or zero-priority windows) are
        # never drawn: `chi_square_pvalue` asserts it.
        assert chi_square_pvalue(counts, target) > 1e-3, (kind, b)


@pytest.mark.parametrize("axis", AXIS_TYPES)
def test_block_probabilities_and_weights_are_the_devices_own(results, axis):
    case = _case(results, f"{axis}:prioritised_{N}")
    indices = np.asarray(case["indices"]).reshape(KEYS, N, BATCH // N)
    probabilities = np.asarray(case["probabilities"]).reshape(indices.shape)
    weights = np.asarray(case["weights"]).reshape(indices.shape)
    rows_per = R // N
    for b in range(N):
        target = _priority_target(results, range(b * rows_per, (b + 1) * rows_per))
        expected = target[indices[:, b]] / target.sum()
        np.testing.assert_allclose(probabilities[:, b], expected, rtol=1e-4)
        # beta=1: (P / min P of the block) ** -1, the largest weight of each block 1.
        mins = probabilities[:, b].min(axis=1, keepdims=True)
        np.testing.assert_allclose(weights[:, b], mins / probabilities[:, b], rtol=1e-5)


@pytest.mark.parametrize("axis", AXIS_TYPES)
@pytest.mark.parametrize("kind", ["uniform", "prioritised"])
def test_sample_moves_no_stored_experience(results, kind, axis):
    for blocks in (1, N):
        got = _case(results, f"{axis}:moved_{kind}_{blocks}")
        # A global sample combines its (batch, ...) result across devices, never the storage.
        assert got["moved"] <= got["drawn"] < got["shard"], got
    got = _case(results, f"{axis}:moved_{kind}_{N}")
    # By blocks, each device gathers its block from its own rows: no experience is combined
    # (at most a few scalars: XLA spreads the prioritised blocks' search and their check over
    # the devices), and the sample stays split over the devices, block `b` on device `b`.
    assert got["moved"] <= N < got["drawn"], got
    assert got["split"], got


def test_the_pmap_recipe_runs_on_8_devices(results):
    assert _case(results, "recipe")["devices"] == N


def test_collective_pattern_reads_tuple_results():
    found = _COLLECTIVE.search("%a = (f32[28,4]{1,0}, s32[]) all-reduce-start(%b), x")
    assert found and _SHAPE.findall(found.group(1)) == ["28,4", ""]
    assert re.search(_COLLECTIVE, "%c = f32[8]{0} add(%a, %b)") is None
