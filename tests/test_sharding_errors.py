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
    import json, time
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import equibuffer as eb

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("envs",), axis_types=(AxisType.Auto,))
    R = 8  # rows: one per device
    ex = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
    key = jax.random.key(0)

    def steps(t, done=False):
        return {"obs": jnp.ones((R, t, 2)), "done": jnp.full((R, t), done)}

    def traj(**kw):
        return eb.TrajectoryBuffer(ex, add_batch_size=R, max_length_time_axis=8,
                                   sequence_length=4, **kw)

    def prio(**kw):
        return eb.PrioritisedTrajectoryBuffer(ex, add_batch_size=R, max_length_time_axis=8,
                                              sequence_length=2, **kw)

    def sample(b):
        return b.sample(key, 8)

    def psample(beta):
        return lambda b: b.sample(key, 8, beta=beta)

    def set_prio(indices, values):
        def step(b):
            s = b.sample(key, 2)
            s = eqx.tree_at(lambda s: s.indices, s, jnp.asarray(indices, jnp.int32))
            return b.set_priorities(s, jnp.asarray(values, jnp.float32))
        return step

    def zero_priorities(b):
        s = b.sample(key, 64)
        return b.set_priorities(s, jnp.zeros(64))

    def ids(x):
        return x["obs"][0].astype(jnp.int32)

    def clustered(prioritised=False, fn=ids):
        cls = eb.PrioritisedClusteredBuffer if prioritised else eb.ClusteredBuffer
        return cls(ex, add_batch_size=R, num_clusters=2, cluster_capacity=8, cluster_fn=fn)

    def with_credit(limited, whole):
        return eqx.tree_at(lambda r: r.credit_whole, limited, jnp.int32(whole))

    def count_past_uint32(b):
        storage = b.storage.with_counters(steps_added=2**32)
        return eqx.tree_at(lambda b: b.storage, b, storage)

    item = lambda: eb.ItemBuffer(ex, add_batch_size=R, capacity=8 * R)
    queue = lambda: eb.Queue(ex, add_batch_size=R, max_length_time_axis=4, sequence_length=2)
    nstep = lambda: eb.TransitionBuffer(ex | {"reward": jnp.float32(0),
                                              "terminated": jnp.bool_(False),
                                              "truncated": jnp.bool_(False)},
                                        add_batch_size=R, max_length_time_axis=8, n_step=3,
                                        discount=0.9)
    nstep_steps = lambda t: jax.tree.map(lambda x: jnp.zeros((R, t, *x.shape), x.dtype),
                                         nstep().storage.example())

    # name: () -> (state, step run on it, jitted). Each state is run as built (one device) and
    # placed with shard_rows on the mesh.
    CASES = {
        "too_early": lambda: (traj().add(steps(2)), sample),
        "transition_too_early": lambda: (eb.TransitionBuffer(ex, add_batch_size=R, capacity=8 * R),
                                 sample),
        "item_too_early": lambda: (item(), sample),
        "prioritised_too_early": lambda: (prio(), psample(0.5)),
        "episode_no_window": lambda: (
            eb.EpisodeTrajectoryBuffer(ex, add_batch_size=R, max_length_time_axis=8,
                                       sequence_length=3).add(steps(4, done=True)), sample),
        "prioritised_episode_no_window": lambda: (
            eb.PrioritisedEpisodeTrajectoryBuffer(ex, add_batch_size=R, max_length_time_axis=8,
                                                  sequence_length=3).add(steps(4, done=True)),
            psample(0.5)),
        "nstep_too_early": lambda: (nstep().add(nstep_steps(3)), sample),
        "zero_priorities": lambda: (zero_priorities(prio().add(steps(4))), psample(0.5)),
        "negative_beta": lambda: (prio().add(steps(4)), psample(jnp.float32(-1.0))),
        "negative_priority": lambda: (prio().add(steps(4)), set_prio([0, 1], [1.0, -1.0])),
        "nan_priority": lambda: (prio().add(steps(4)), set_prio([0, 1], [jnp.nan, 1.0])),
        "priority_index": lambda: (prio().add(steps(4)), set_prio([0, 64], [1.0, 1.0])),
        "queue_full": lambda: (queue().add(steps(4)), lambda q: q.add(steps(1))),
        "queue_empty": lambda: (queue().add(steps(1)), lambda q: q.sample()),
        "cluster_id": lambda: (
            clustered(), lambda b: b.add(steps(1) | {"obs": jnp.full((R, 1, 2), 5.0)})),
        "cluster_nothing_held": lambda: (clustered(), sample),
        "prioritised_cluster_nothing_held": lambda: (clustered(True), psample(0.5)),
        "prioritised_cluster_beta": lambda: (
            clustered(True).add(steps(1)), lambda b: b.sample(key, 4, beta=jnp.float32(-1))),
        "sumtree_get": lambda: ({"tree": eb.SumTree(16), "b": traj()},
                        lambda s: s["tree"].get(jnp.array([3, 16]))),
        "sumtree_set": lambda: ({"tree": eb.SumTree(16), "b": traj()},
                        lambda s: s["tree"].set(jnp.array([3]), jnp.array([-2.0]))),
        "mixer_too_early": lambda: (eb.Mixer((traj().add(steps(4)), traj()), (0.5, 0.5)), sample),
        "rate_limited_too_early": lambda: (eb.RateLimited(traj(), 1.0, 4.0), sample),
        "rate_limited_credit_high": lambda: (
            with_credit(eb.RateLimited(traj(), 1.0, 4.0), 2**30), lambda r: r.add(steps(4))),
        "rate_limited_credit_low": lambda: (
            with_credit(eb.RateLimited(traj(), 1.0, 4.0).add(steps(4)), -(2**30) + 2),
            lambda r: r.sample(key, 8)),
        "steps_added_past_uint32": lambda: (count_past_uint32(traj()), lambda b: b.steps_added()),
    }

    def message(error):
        text = str(error)
        head = "equinox.EquinoxRuntimeError: "
        return text[text.index(head) + len(head):text.index("\\n\\n-------------------")]

    def run(state, step):
        @eqx.filter_jit(donate="all")
        def jitted(state):
            return step(state)
        start = time.perf_counter()
        try:
            jax.block_until_ready(jitted(state))
        except eqx.EquinoxRuntimeError as e:
            return message(e), time.perf_counter() - start
        return None, time.perf_counter() - start

    for name, case in CASES.items():
        one, _ = run(*case())  # donated: each run gets its own state
        placed, step = case()
        placed = eb.shard_rows(placed, mesh, "envs")
        assert any(len(l.sharding.device_set) == 8 for l in jax.tree.leaves(placed))
        sharded, seconds = run(placed, step)
        print(json.dumps({"case": name, "one": one, "sharded": sharded, "seconds": seconds}),
              flush=True)
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


@pytest.fixture(scope="module")
def results() -> dict:
    return json_lines_on_host_devices(SCRIPT, 8, timeout=240, key="case")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_raises_its_message_from_every_device(results, name):
    case = results["cases"].get(name)
    assert case is not None, f"the case did not finish (hang or abort): {results['stderr']}"
    assert case["one"] is not None, "no error on one device"
    assert re.search(EXPECTED[name], case["one"]), case["one"]
    assert case["sharded"] == case["one"]
    assert case["seconds"] < 20, case  # raised at once, not after XLA's collective timeout


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
    sample = eqx.filter_jit(lambda b: b.sample(jax.random.key(0), 8))
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
    tests below compare the every-device check with it, so they make it be used here."""
    monkeypatch.setattr(equibuffer._errors, "several_devices", lambda: True)


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
