"""Every check the buffers make inside jit raises its own message from a step sharded over 8
devices (`shard_rows`), at once, never hanging or aborting: the same message as on one device.

Run in one subprocess with eight host CPU devices (the test process has one), which prints one
line per case as it finishes; a hang fails the cases not yet printed instead of blocking the
suite."""

import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer._errors
from equibuffer._errors import error_if

from .helpers import json_lines_on_host_devices, run_on_host_devices


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


SCRIPT = textwrap.dedent(
    """
    import json, os, time
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import equibuffer as eb

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 8
    axis_type = AxisType[os.environ["TEST_AXIS_TYPE"]]
    mesh = jax.make_mesh((8,), ("envs",), axis_types=(axis_type,))
    from tests.mesh_errors import CASES, run, run_hidden

    for name, case in CASES.items():
        one, _ = run(*case())  # donated: each run gets its own state
        placed, step = case()
        placed = eb.shard_rows(placed, mesh, "envs")
        assert any(len(l.sharding.device_set) == 8 for l in jax.tree.leaves(placed))
        sharded, seconds = run(placed, step)
        placed, step = case()
        hidden = run_hidden(eb.shard_rows(placed, mesh, "envs"), step)
        print(json.dumps({"case": name, "one": one, "sharded": sharded, "seconds": seconds,
                          "hidden": hidden}), flush=True)
    """
)

# Each case's message (a regular expression it must match, on one device and sharded alike).
EXPECTED = {
    "too_early": r"^TrajectoryBuffer.sample\(\): .*cannot be sampled yet",
    "transition_too_early": r"^TransitionBuffer.sample\(\): .*cannot be sampled yet",
    "item_too_early": r"^ItemBuffer.sample\(\): .*cannot be sampled yet",
    "prioritised_too_early": r"^PrioritisedTrajectoryBuffer.sample\(\): .*cannot be sampled",
    "episode_no_window": r"no window of sequence_length=3",
    "prioritised_episode_no_window": r"no window of sequence_length=3",
    "nstep_too_early": r"n_step \+ 1 = 4",
    "zero_priorities": r"every valid window has priority 0",
    "negative_beta": r"`beta` must be finite and >= 0",
    "negative_priority": r"every priority must be non-negative and finite",
    "nan_priority": r"every priority must be non-negative and finite",
    "priority_index": r"every index must be in \[0, ",
    "queue_full": r"^Queue.add\(\): the queue is full",
    "queue_empty": r"^Queue.sample\(\): the queue holds fewer than sequence_length=2",
    "cluster_id": r"outside \[0, num_clusters=2\)",
    "cluster_nothing_held": r"no cluster of positive weight",
    "prioritised_cluster_nothing_held": r"no cluster of positive weight holds",
    "prioritised_cluster_beta": r"`beta` must be finite and >= 0",
    "sumtree_get": r"^SumTree.get\(\): ",
    "sumtree_set": r"^SumTree.set\(\): every value must be non-negative and finite",
    "mixer_too_early": r"cannot be sampled yet",
    "rate_limited_too_early": r"cannot be sampled yet",
    "rate_limited_credit_high": r"credit passed 2\*\*30 windows",
    "rate_limited_credit_low": r"credit fell below -2\*\*30 windows",
    "steps_added_past_uint32": r"2\*\*32 or more, more than a uint32 holds",
}


@pytest.fixture(
    scope="module",
    params=[(mode, axis) for mode in ("recorded", "raise") for axis in ("Auto", "Explicit")],
    ids=lambda p: "-".join(p),
)
def results(request) -> dict:
    """The cases' results by default (failures recorded, raised by `eb.filter_jit` when the
    call returns) and in the debugging mode (`EQX_ON_ERROR=raise`: raised inside the call,
    from every device), on a mesh whose axis is `Auto` and on one whose axis is `Explicit`."""
    mode, axis = request.param
    env = {"TEST_AXIS_TYPE": axis} | ({} if mode == "recorded" else {"EQX_ON_ERROR": "raise"})
    return json_lines_on_host_devices(SCRIPT, 8, timeout=420, key="case", **env)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_raises_its_message_from_every_device(results, name):
    case = results["cases"].get(name)
    assert case is not None, f"the case did not finish (hang or abort): {results['stderr']}"
    assert case["one"] is not None, "no error on one device"
    assert re.search(EXPECTED[name], case["one"]), case["one"]
    assert case["sharded"] == case["one"]
    assert case["seconds"] < 20, case  # raised at once, not after XLA's collective timeout
    # The step as users write it (in a scan body, the failing value not returned) too.
    assert case["hidden"] == case["one"]


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec as P
    from equibuffer._errors import error_if

    mesh = jax.make_mesh((8,), ("envs",), axis_types=(AxisType.Auto,))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.6
        from jax.experimental.shard_map import shard_map

    def local(x):  # per device; then a collective the other devices would wait in
        y = error_if(x, jnp.sum(x) > 0, "device-local check failed")
        return jax.lax.psum(jnp.sum(y), "envs")

    step = eqx.filter_jit(shard_map(local, mesh=mesh, in_specs=P("envs"), out_specs=P()))
    x = jnp.zeros(16)
    print("fine", float(step(x)))
    try:
        step(x.at[13].set(1.0))  # only device 6 sees the fault
    except eqx.EquinoxRuntimeError as e:
        print("raised", "device-local check failed" in str(e))
    """
)


def test_a_check_failing_on_one_device_under_shard_map_raises_on_all():
    out = run_on_host_devices(SHARD_MAP_SCRIPT, 8, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["fine", "0.0", "raised", "True"]


OFF_SCRIPT = textwrap.dedent(
    """
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import AxisType
    import equibuffer as eb

    mesh = jax.make_mesh((8,), ("envs",), axis_types=(AxisType.Auto,))
    buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(2)}, add_batch_size=8,
                                 max_length_time_axis=8, sequence_length=4)
    buffer = eb.shard_rows(buffer, mesh, "envs")
    sample = eb.filter_jit(lambda b: b.sample(jax.random.key(0), 8))
    hlo = jax.jit(lambda b: b.sample(jax.random.key(0), 8)).lower(buffer).compile().as_text()
    print("callback" in hlo, sample(buffer).experience["obs"].shape)
    """
)


def test_eqx_on_error_off_removes_the_checks_on_a_mesh():
    out = run_on_host_devices(OFF_SCRIPT, 8, timeout=60, EQX_ON_ERROR="off")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "(8,", "4,", "2)"]
    out = run_on_host_devices(OFF_SCRIPT.replace("print(", "print(1, "), 8, timeout=60)
    assert "EquinoxRuntimeError" in out.stderr and "cannot be sampled yet" in out.stderr


CHECKS = (eqx.error_if, error_if)  # Equinox's, and the one the buffers use on several devices


@pytest.fixture(autouse=True)
def _as_on_several_devices(monkeypatch):
    """This process has one device, where the buffers use Equinox's check as it is; the
    tests below compare the every-device check of the debugging mode (`EQX_ON_ERROR=raise`)
    with it, so they make it be used here."""
    monkeypatch.setattr(equibuffer._errors, "several_devices", lambda: True)
    monkeypatch.setattr(equibuffer._errors, "MODE", "raise")


def _checked(check):
    def inner(x):
        return check(2 * x, jnp.sum(x) > 3, "the sum is above 3") + 1

    return inner


@pytest.mark.parametrize("transform", ["filter_jit", "eager", "vmap"])
def test_one_device_reads_as_eqx_error_if(transform):
    """The check raises Equinox's error, with Equinox's report, on one device as well."""
    results = []
    for check in CHECKS:
        f = _checked(check)
        if transform == "filter_jit":
            f = eqx.filter_jit(f)
        elif transform == "vmap":
            f = eqx.filter_jit(jax.vmap(f))
        x = jnp.arange(4.0) if transform != "vmap" else jnp.stack([jnp.zeros(4), jnp.ones(4)])
        fine = f(jnp.zeros_like(x))
        with pytest.raises(eqx.EquinoxRuntimeError) as error:
            f(x)
        results.append((np.asarray(fine), str(error.value)))
    (fine_eqx, text_eqx), (fine_ours, text_ours) = results
    np.testing.assert_array_equal(fine_eqx, fine_ours)
    assert "the sum is above 3" in text_ours
    # The same report, the stack inside jit included (it names the line that called the check).
    assert text_ours.replace("error_if(", "").count("\n") == text_eqx.count("\n")
    assert (
        text_ours.split("Below is the stack inside of JIT:")[0]
        == (text_eqx.split("Below is the stack inside of JIT:")[0])
    )
    assert (
        text_ours.split("equinox.EquinoxRuntimeError:")[1]
        == (text_eqx.split("equinox.EquinoxRuntimeError:")[1])
    )


def test_plain_jax_jit_still_carries_the_message():
    with pytest.raises(Exception, match="the sum is above 3"):
        jax.jit(_checked(error_if))(jnp.arange(4.0))


def test_under_grad_the_tangent_passes_and_the_check_still_runs():
    # Equinox's check is removed there as dead code (only its tangent is used); a debug
    # callback never is, so this one still raises.
    grads = [eqx.filter_jit(jax.grad(lambda x, c=c: jnp.sum(_checked(c)(x)))) for c in CHECKS]
    np.testing.assert_array_equal(grads[0](jnp.zeros(4)), grads[1](jnp.zeros(4)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="the sum is above 3"):
        grads[1](jnp.arange(4.0))
