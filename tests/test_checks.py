"""The checks inside jit cost no wait for the host (issue 25): in the default configuration the
compiled `add`, `sample` and `set_priorities` of every kind hold no host callback and no
conditional chosen by data; a failure is recorded in the buffer's and the sample's own arrays
and raised at the next host-side use (`eb.check`, `eb.filter_jit`, an eager method)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
import equibuffer._errors

from . import mesh_kinds
from .helpers import spread


ROWS, LENGTH = 2, 16
KINDS = mesh_kinds.kinds(ROWS, LENGTH)
CALLBACKS = {"debug_callback", "pure_callback", "io_callback", "callback"}


def _subjaxprs(eqn, platform: str):
    """The programs nested in `eqn` that run on `platform`: of a conditional on the platform
    (`lax.platform_dependent`, resolved by the compiler) only the branch for `platform`."""
    values = list(eqn.params.values())
    chosen = eqn.params.get("branches_platforms")
    if eqn.primitive.name == "cond" and chosen is not None:
        which = [i for i, ps in enumerate(chosen) if ps is not None and platform in ps]
        which = which or [i for i, ps in enumerate(chosen) if ps is None]
        values = [eqn.params["branches"][which[0]]]
    for value in values:
        for v in value if isinstance(value, list | tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def host_waits(jaxpr, platform: str = "cuda") -> dict[str, int]:
    """Host callbacks, and conditionals whose branch is chosen by data (not by the platform,
    as `lax.platform_dependent` does, which the compiler resolves), in the program `jaxpr`
    and the programs nested in it, as compiled for `platform`."""
    counts = {"callbacks": 0, "data_conds": 0}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CALLBACKS:
            counts["callbacks"] += 1
        if eqn.primitive.name == "cond" and eqn.params.get("branches_platforms") is None:
            counts["data_conds"] += 1
        for sub in _subjaxprs(eqn, platform):
            for k, n in host_waits(sub, platform).items():
                counts[k] += n
    return counts


def _filled(name: str):
    buffer = KINDS[name]()
    for i in range(3):
        buffer = mesh_kinds.add(buffer, mesh_kinds.batch(i, ROWS))
    if isinstance(buffer, eb.Queue):  # room for the step's add
        buffer, _ = buffer.sample()
    return buffer


def _step(buffer, batch, key):
    """One call of each method users run in a training step: add, then sample (and for a
    prioritised source, `set_priorities` from the sample)."""
    return mesh_kinds.sample(mesh_kinds.add(buffer, batch), key, 4)


def _jaxpr(fn, *args):
    return jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr


@pytest.mark.parametrize("name", spread(sorted(KINDS)))
def test_no_host_wait_in_a_default_step(name):
    """On a GPU (or TPU) nothing makes the device wait for the host; on the CPU, where a
    conditional costs no such wait, no callback either (the Queue's slice-or-gather and a
    wrapping add's copy-or-scatter are conditionals there, by measurement)."""
    buffer = _filled(name)
    batch, key = mesh_kinds.batch(7, ROWS, t=1), jax.random.key(0)
    jaxpr = _jaxpr(_step, buffer, batch, key)
    for platform in ("cuda", "rocm", "tpu"):
        assert host_waits(jaxpr, platform) == {"callbacks": 0, "data_conds": 0}
    assert host_waits(jaxpr, "cpu")["callbacks"] == 0
    # Under `lax.scan`, as a training loop runs it.
    batches = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)

    def loop(buffer, batches, key):
        def body(buffer, b):
            buffer, _ = _step(buffer, b, key)
            return buffer, None

        return jax.lax.scan(body, buffer, batches)[0]

    assert host_waits(_jaxpr(loop, buffer, batches, key)) == {"callbacks": 0, "data_conds": 0}


@pytest.mark.parametrize("name", ["trajectory", "prioritised", "queue", "rate_limited"])
def test_the_debugging_mode_keeps_immediate_checks(name, monkeypatch):
    """With `EQX_ON_ERROR=raise` each check is Equinox's own, a conditional that calls back
    into Python: what the default removes (and what `host_waits` detects)."""
    monkeypatch.setattr(equibuffer._errors, "MODE", "raise")
    buffer = _filled(name)
    waits = host_waits(_jaxpr(_step, buffer, mesh_kinds.batch(7, ROWS, t=1), jax.random.key(0)))
    assert waits["callbacks"] >= 1 and waits["data_conds"] >= 1


def test_the_compiled_cpu_program_calls_no_host():
    """The optimised CPU program of a prioritised step holds no host callback custom-call."""
    buffer = _filled("prioritised")
    compiled = (
        jax.jit(_step)
        .lower(buffer, mesh_kinds.batch(7, ROWS, t=1), jax.random.key(0))
        .compile()
        .as_text()
    )
    assert not re.search(r"custom_call_target=\"[^\"]*callback", compiled)


# ---------------------------------------------------------------- when each error surfaces


def _empty():
    return eb.TrajectoryBuffer(
        {"x": jnp.zeros(2)}, add_batch_size=1, max_length_time_axis=8, sequence_length=3
    )


def test_a_sample_records_its_failure_and_check_raises_it():
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 4))(_empty(), jax.random.key(0))
    assert sample.error.dtype == jnp.uint32 and int(sample.error) != 0
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet.*can_sample"):
        eb.check(sample)
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.check({"anything": [1.0, (sample,)]})  # found anywhere in a pytree


def test_eager_calls_raise_at_once():
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        _empty().sample(jax.random.key(0), 4)


def test_filter_jit_raises_after_the_call():
    @eb.filter_jit(donate="all")
    def step(buffer, key):
        return buffer, buffer.sample(key, 4)

    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        step(_empty(), jax.random.key(0))
    buffer = _empty().add({"x": jnp.ones((1, 4, 2))})
    buffer, sample = step(buffer, jax.random.key(0))  # nothing failed: no error
    assert sample.experience["x"].shape == (4, 3, 2)


def test_a_failed_buffer_raises_at_its_next_eager_use_and_keeps_the_first_failure():
    queue = eb.Queue(
        {"x": jnp.zeros(())}, add_batch_size=1, max_length_time_axis=2, sequence_length=1
    )
    add = eqx.filter_jit(lambda q, x: q.add(x))
    queue = add(queue, {"x": jnp.zeros((1, 2))})
    queue = add(queue, {"x": jnp.zeros((1, 1))})  # full: recorded
    queue, _ = eqx.filter_jit(lambda q: q.sample())(queue)  # a later call keeps the first
    assert int(queue.storage.error) != 0
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full"):
        eb.check(queue)
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full"):
        queue.sample()  # an eager method raises the recorded failure first


def test_set_priorities_passes_the_sample_failure_on_to_the_buffer():
    buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=8)

    @eqx.filter_jit
    def step(buffer, key):
        sample = buffer.sample(key, 4)  # too early: the sample is not returned
        return buffer.set_priorities(sample, jnp.ones(4))

    buffer = step(buffer, jax.random.key(0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.check(buffer)


def test_check_refuses_traced_words():
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda b: eb.check(b))(_empty())


def test_vmapped_training_with_the_cond_records_nothing():
    """The vmapped loop with `lax.cond(can_sample, learn, skip)`: the learn branch is not
    taken at first, so nothing is recorded; and the error word stays unbatched with the
    counters, so the cond stays a cond."""

    def train(key):
        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=8)

        def body(buffer, i):
            buffer = buffer.add({"x": i.astype(jnp.float32)[None]})

            def learn(buffer):
                sample = buffer.sample(jax.random.fold_in(key, i), 2)
                return buffer.set_priorities(sample, sample.experience["x"] + 1.0)

            return jax.lax.cond(buffer.can_sample(), learn, lambda b: b, buffer), None

        return jax.lax.scan(body, buffer, jnp.arange(5))[0]

    buffers = jax.jit(jax.vmap(train))(jax.random.split(jax.random.key(0), 3))
    eb.check(buffers)
    assert np.asarray(buffers.storage.error).tolist() == [0, 0, 0]
