"""Errors reach the user from the step they write (issue 36).

Under `eb.filter_jit` every failure recorded anywhere in the traced step is raised when the call
returns, with the check's own message: at the top level and inside `scan`, `fori_loop`,
`while_loop`, `cond` and `switch`, under `vmap` and `shard_map`, whether or not the step
returns the sample. Under plain `jax.jit` / `eqx.filter_jit` a misuse still shows in what the
step returns (NaN floating leaves of a failed sample; the failure recorded in the buffers a
failed method returns). A refused operation changes no array of data, also under donation,
where the error's `output` holds what the call returned. The compiled checked step holds no
host callback."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import equibuffer as eb

from . import mesh_kinds
from .helpers import spread
from .test_checks import host_waits


ROWS, LENGTH = 2, 16
KINDS = mesh_kinds.kinds(ROWS, LENGTH)
PRIORITISED = mesh_kinds.prioritised_kinds(ROWS, LENGTH)
# What each kind says when it is sampled empty (a Mixer and a RateLimited: their source's).
NOT_READY = {
    "queue": "Queue.sample(): the queue holds fewer than sequence_length=3 unread steps",
    "clustered": "ClusteredBuffer.sample(): no cluster of positive weight holds an item yet",
    "prioritised_clustered": "PrioritisedClusteredBuffer.sample(): no cluster of positive",
}
NOT_READY_RING = r"[A-Za-z]+\.sample\(\): the buffer cannot be sampled yet"


def _message(name: str) -> str:
    return re.escape(NOT_READY[name]) if name in NOT_READY else NOT_READY_RING


def _draw(buffer, key):
    """The sample a training step draws from `buffer` (the queue's: all it holds)."""
    if isinstance(buffer, eb.Queue):
        return buffer.sample()[1]
    if isinstance(buffer, eb.RateLimited):
        return buffer.sample(key, 4)[1]
    return mesh_kinds.draw(buffer, key, 4)


def _loss(sample) -> jax.Array:
    """A stand-in for a loss: the sum of every floating leaf of the experience."""
    leaves = jax.tree.leaves(sample.experience)
    return sum(jnp.sum(x) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))


def _top_level(buffer, key):
    return _loss(_draw(buffer, key))  # the sample feeds the loss and is not returned


def _in_scan(buffer, key):
    def body(total, k):
        return total + _loss(_draw(buffer, k)), None

    return jax.lax.scan(body, jnp.float32(0), jax.random.split(key, 3))[0]


def _data(tree) -> dict[str, np.ndarray]:
    """Every array of `tree` but its recorded failure words, as NumPy, by path."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array)):
        name, x = jax.tree_util.keystr(path), np.asarray(x)
        if name.endswith(".error"):
            continue
        out[name] = x[..., :4] if name.endswith("storage.counters") else x
    return out


def _assert_same(before, after) -> None:
    a, b = _data(before), _data(after)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# ------------------------------------------------------------ every kind, step as users write


@pytest.mark.parametrize("where", [_top_level, _in_scan], ids=["top_level", "scan_body"])
@pytest.mark.parametrize("name", spread(sorted(KINDS)))
def test_a_sample_that_is_not_returned_raises_from_the_checked_step(name, where):
    with pytest.raises(eqx.EquinoxRuntimeError, match=_message(name)) as caught:
        eb.filter_jit(where)(KINDS[name](), jax.random.key(0))
    assert np.isnan(caught.value.output)  # what the call returned: the loss of failed draws


@pytest.mark.parametrize("name", spread(sorted(KINDS)))
def test_plain_jit_shows_the_failure_in_the_loss(name):
    """Without `eb.filter_jit` nothing raises, but the loss computed from a sample that
    could not be drawn is NaN, for `eqx.filter_jit` and `jax.jit` alike."""
    buffer, key = KINDS[name](), jax.random.key(0)
    assert np.isnan(eqx.filter_jit(_in_scan)(buffer, key))
    assert np.isnan(jax.jit(_top_level)(buffer, key))


def test_a_ready_step_raises_nothing_and_returns_its_values():
    buffer = KINDS["transition"]()
    buffer = buffer.add(mesh_kinds.batch(0, ROWS))
    loss = eb.filter_jit(_in_scan)(buffer, jax.random.key(0))
    assert np.isfinite(loss) and loss == eqx.filter_jit(_in_scan)(buffer, jax.random.key(0))


# ------------------------------------------------------------------------- every control flow


def _empty():
    return eb.TransitionBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)


def _x(buffer, key):
    return jnp.sum(buffer.sample(key, 4).experience.first["x"])


FLOWS = {
    "fori_loop": lambda b, k: jax.lax.fori_loop(0, 2, lambda i, c: c + _x(b, k), 0.0),
    "fori_loop_traced": lambda b, k: jax.lax.fori_loop(
        0, b.storage.head + 2, lambda i, c: c + _x(b, k), 0.0
    ),
    "while_loop": lambda b, k: jax.lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + _x(b, k)), (0, 0.0)
    )[1],
    "cond": lambda b, k: jax.lax.cond(b.storage.head == 0, _x, lambda b, k: 0.0, b, k),
    "switch": lambda b, k: jax.lax.switch(b.storage.head, [_x, lambda b, k: 0.0], b, k),
    "vmap": lambda b, k: jnp.sum(jax.vmap(lambda k: _x(b, k))(jax.random.split(k, 3))),
    "vmap_of_buffers": lambda b, k: jnp.sum(
        jax.vmap(_x, in_axes=(None, 0))(b, jax.random.split(k, 3))
    ),
    "grad": lambda b, k: jax.grad(lambda w: w * _x(b, k))(1.0),
    "checkpoint": lambda b, k: jax.checkpoint(_x)(b, k),
    "grad_of_checkpoint": lambda b, k: jax.grad(jax.checkpoint(lambda w: w * _x(b, k)))(1.0),
    "inner_jit": lambda b, k: eqx.filter_jit(_x)(b, k),
    "inner_checked": lambda b, k: eb.filter_jit(_x)(b, k),
}


@pytest.mark.parametrize("flow", sorted(FLOWS))
def test_every_control_flow_passes_the_failure_out(flow):
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.filter_jit(FLOWS[flow])(_empty(), jax.random.key(0))


def test_a_branch_not_taken_raises_nothing():
    step = eb.filter_jit(lambda b, k: jax.lax.cond(b.can_sample(), _x, lambda b, k: 0.0, b, k))
    assert float(step(_empty(), jax.random.key(0))) == 0.0


def test_shard_map_passes_the_failure_out():
    mesh = jax.make_mesh((1,), ("rows",))

    def per_device(buffer, key):
        return jax.shard_map(
            lambda b, k: _x(b, k)[None], mesh=mesh, in_specs=(P(), P()), out_specs=P("rows")
        )(buffer, key)

    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.filter_jit(per_device)(_empty(), jax.random.key(0))


def test_vmapped_training_guarded_by_can_sample_raises_nothing_at_step_0():
    """The batched-use invariant under the checked step: `vmap` over seeds of a loop whose
    learn branch is guarded by `lax.cond(buffer.can_sample(), ...)`."""

    def train(seed):
        def body(buffer, i):
            key = jax.random.fold_in(jax.random.key(seed), i)
            buffer = buffer.add({"x": jnp.full((1, 2), i, jnp.float32)})
            loss = jax.lax.cond(buffer.can_sample(), _x, lambda b, k: 0.0, buffer, key)
            return buffer, loss

        return jax.lax.scan(body, _empty(), jnp.arange(4))[1]

    losses = eb.filter_jit(jax.vmap(train))(jnp.arange(3))
    assert np.isfinite(losses).all() and (np.asarray(losses)[:, 0] == 0).all()


def test_the_checked_step_holds_no_host_callback():
    """The failures leave the compiled program as values: no callback, no conditional chosen
    by data, in the traced program and in the compiled one (`.lower`, as eqx.filter_jit)."""
    buffer = PRIORITISED["transition"]().add(mesh_kinds.batch(0, ROWS))

    def step(buffer, key):
        def body(buffer, k):
            sample = buffer.sample(k, 4)
            return buffer.set_priorities(sample, _loss(sample) + jnp.ones(4)), None

        return jax.lax.scan(body, buffer, jax.random.split(key, 3))[0]

    checked = eb.filter_jit(step, donate="all")
    traced = jax.make_jaxpr(lambda b, k: checked.__wrapped__(b, k))(buffer, jax.random.key(0))
    assert host_waits(traced.jaxpr) == {"callbacks": 0, "data_conds": 0}
    compiled = checked.lower(buffer, jax.random.key(0)).compile().compiled.as_text()
    assert not re.search(r"custom_call_target=\"[^\"]*callback", compiled)


def test_plain_jit_keeps_its_fast_dispatch():
    """Outside the checked step the carried failure is no operation and no effect (an effect
    takes a jitted call off JAX's fast C++ dispatch)."""
    buffer = PRIORITISED["transition"]().add(mesh_kinds.batch(0, ROWS))
    jaxpr = jax.make_jaxpr(lambda b, k: mesh_kinds.sample(b, k, 4))(buffer, jax.random.key(0))
    assert not jaxpr.effects


# ---------------------------------------------------------------------------------- refusals


def _queue():
    queue = eb.Queue(
        {"x": jnp.zeros(())}, add_batch_size=1, max_length_time_axis=4, sequence_length=2
    )
    return queue.add({"x": jnp.arange(4.0)[None]})  # full: 4 unread steps


def test_a_full_queue_refuses_the_add_and_keeps_every_step():
    queue = _queue()
    refused = jax.jit(lambda q: q.add({"x": jnp.full((1, 2), 9.0)}))(queue)
    assert refused.storage.data["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
    _assert_same(queue, refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full"):
        eb.check(refused)


def test_a_refused_add_under_donation_is_held_by_the_error():
    step = eb.filter_jit(lambda q: q.add({"x": jnp.full((1, 2), 9.0)}), donate="all")
    queue = _queue()
    expected = _data(queue)
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full") as caught:
        step(queue)
    kept = caught.value.output
    assert kept.storage.data["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert _data(kept).keys() == expected.keys()
    for name, x in expected.items():
        np.testing.assert_array_equal(_data(kept)[name], x)


def test_a_short_queue_sample_takes_nothing():
    queue = eb.Queue(
        {"x": jnp.zeros(())}, add_batch_size=1, max_length_time_axis=4, sequence_length=2
    )
    queue = queue.add({"x": jnp.arange(1.0)[None]})  # 1 unread step, fewer than 2
    after, sample = jax.jit(lambda q: q.sample())(queue)
    assert np.isnan(sample.experience["x"]).all() and int(after.unread) == 1


def test_a_rate_limiter_refuses_an_add_past_its_bound():
    limited = KINDS["rate_limited"]().add(mesh_kinds.batch(0, ROWS))
    near = eqx.tree_at(lambda r: r.credit_whole, limited, jnp.int32(2**30 - 1))
    refused = jax.jit(lambda r: r.add(mesh_kinds.batch(1, ROWS)))(near)
    _assert_same(near, refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match="credit passed 2\\*\\*30"):
        eb.check(refused)
    accepted = jax.jit(lambda r: r.add(mesh_kinds.batch(1, ROWS)))(limited)
    assert accepted.buffer.storage.steps_added() == 8  # (an add within the bound is made)


def test_a_rate_limiter_refuses_a_sample_past_its_bound():
    limited = KINDS["rate_limited"]().add(mesh_kinds.batch(0, ROWS))
    near = eqx.tree_at(lambda r: r.credit_whole, limited, jnp.int32(-(2**30) + 1))
    after, sample = jax.jit(lambda r: r.sample(jax.random.key(0), 4))(near)
    assert int(after.credit_whole) == -(2**30) + 1 and np.isnan(sample.experience["obs"]).all()


@pytest.mark.parametrize("bad", [np.nan, -1.0, np.inf])
@pytest.mark.parametrize("name", spread(sorted(PRIORITISED)))
def test_a_bad_priority_changes_no_priority(name, bad):
    buffer = mesh_kinds.add(PRIORITISED[name](), mesh_kinds.batch(1, ROWS, t=8))
    sample = mesh_kinds.draw(buffer, jax.random.key(0), 4)
    if isinstance(buffer, eb.RateLimited):
        sample = sample[1]
    buffer = buffer.set_priorities(sample, jnp.arange(1.0, 5.0))  # priorities of their own
    priorities = jnp.array([2.0, bad, 3.0, 4.0], jnp.float32)
    refused = eqx.filter_jit(lambda b, s, p: b.set_priorities(s, p))(buffer, sample, priorities)
    _assert_same(buffer, refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-negative and finite"):
        eb.check(refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-negative and finite") as caught:
        eb.filter_jit(lambda b, s, p: b.set_priorities(s, p), donate="all")(
            buffer, sample, priorities
        )
    _assert_same(refused, caught.value.output)


def test_a_failed_sample_sets_no_priority():
    buffer = PRIORITISED["transition"]()
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 4))(buffer, jax.random.key(0))
    filled = buffer.add(mesh_kinds.batch(0, ROWS))
    refused = eqx.filter_jit(lambda b, s: b.set_priorities(s, jnp.full(4, 7.0)))(filled, sample)
    _assert_same(filled, refused)


@pytest.mark.parametrize("name", spread(sorted(PRIORITISED)))
def test_a_caught_refusal_leaves_buffers_that_go_on(name):
    """The failure the checked step raised is not raised again by the buffers in
    `error.output`: `eb.check` passes, they sample eagerly and are stepped again."""
    buffer = mesh_kinds.add(PRIORITISED[name](), mesh_kinds.batch(1, ROWS, t=8))
    sample = _draw(buffer, jax.random.key(0))
    step = eb.filter_jit(lambda b, s, p: b.set_priorities(s, p), donate="all")
    expected = _data(buffer)
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-negative and finite") as caught:
        step(buffer, sample, jnp.array([2.0, np.nan, 3.0, 4.0], jnp.float32))
    kept = caught.value.output
    assert _data(kept).keys() == expected.keys()
    for key, x in expected.items():
        np.testing.assert_array_equal(_data(kept)[key], x, err_msg=key)
    eb.check(kept)  # raised once, by the step: not again
    sample = _draw(kept, jax.random.key(1))  # an eager call on it
    updated = step(kept, sample, jnp.arange(1.0, 5.0))  # and the step again, checked
    eb.check(updated)


def test_a_caught_full_queue_is_drained_and_filled_again():
    step = eb.filter_jit(lambda q: q.add({"x": jnp.full((1, 2), 9.0)}), donate="all")
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full") as caught:
        step(_queue())
    queue, sample = caught.value.output.sample()  # eager, as the message advises
    assert sample.experience["x"].tolist() == [[0.0, 1.0]]  # the oldest 2 unread steps
    queue = step(queue)  # room again for 2
    assert int(queue.unread) == 4
    assert queue.sample()[1].experience["x"].tolist() == [[2.0, 3.0]]


def test_a_caught_refusal_writes_to_an_archive(tmp_path):
    buffer = eb.PrioritisedTrajectoryBuffer(
        {"x": jnp.zeros(2)}, add_batch_size=1, max_length_time_axis=8, sequence_length=2
    ).add({"x": jnp.arange(8.0).reshape(1, 4, 2)})
    sample = buffer.sample(jax.random.key(0), 4)
    step = eb.filter_jit(lambda b, s: b.set_priorities(s, jnp.full(4, -1.0)), donate="all")
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-negative and finite") as caught:
        step(buffer, sample)
    archive = eb.Archive(tmp_path / "a.zarr", like=caught.value.output)
    archive.write(caught.value.output)
    np.testing.assert_array_equal(archive.read()["x"][0], np.arange(8.0).reshape(4, 2))


def test_a_caught_failure_stays_in_a_sample_and_another_stays_in_a_buffer():
    """What `error.output` keeps recorded: a failed sample's failure (its leaves are NaN),
    and a buffer's earlier failure (recorded under plain jit, never raised) other than the
    one raised."""
    full = jax.jit(lambda q: q.add({"x": jnp.full((1, 2), 9.0)}))(_queue())  # recorded

    @eb.filter_jit
    def drain(queue):
        for _ in range(2):  # the 4 unread steps
            queue, _ = queue.sample()
        return queue.sample()  # none left: raised

    with pytest.raises(eqx.EquinoxRuntimeError, match="fewer than sequence_length") as caught:
        drain(full)
    queue, sample = caught.value.output
    assert np.isnan(sample.experience["x"]).all()
    with pytest.raises(eqx.EquinoxRuntimeError, match="fewer than sequence_length"):
        eb.check(sample)
    with pytest.raises(eqx.EquinoxRuntimeError, match="the queue is full"):
        eb.check(queue)


def test_a_clustered_add_with_an_id_out_of_range_writes_nothing():
    def cluster_fn(item):  # the steps of batch 9 go to cluster 7 of 3
        return jnp.where(item["obs"][0] > 5000, 7, mesh_kinds.cluster_of(item))

    buffer = eb.PrioritisedClusteredBuffer(
        mesh_kinds.EXAMPLE, add_batch_size=ROWS, num_clusters=3, cluster_capacity=LENGTH,
        cluster_fn=cluster_fn,
    ).add(mesh_kinds.batch(0, ROWS))  # fmt: skip
    refused = eqx.filter_jit(lambda b: b.add(mesh_kinds.batch(9, ROWS)))(buffer)
    _assert_same(buffer, refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match="cluster id outside"):
        eb.check(refused)


def test_a_stale_epoch_batch_is_nan_and_recorded():
    buffer = eb.TrajectoryBuffer(
        {"x": jnp.zeros(())}, add_batch_size=1, max_length_time_axis=8, sequence_length=2
    ).add({"x": jnp.arange(8.0)[None]})
    epoch = buffer.epoch(jax.random.key(0), 4)
    overwritten = buffer.add({"x": jnp.zeros((1, 8))})

    @eb.filter_jit
    def first_loss(buffer, epoch):
        sample, valid = buffer.epoch_batch(epoch, 0)
        return jnp.sum(jnp.where(valid[:, None], sample.experience["x"], 0.0))

    with pytest.raises(eqx.EquinoxRuntimeError, match="written over") as caught:
        first_loss(overwritten, epoch)
    assert np.isnan(caught.value.output)
    assert np.isnan(eqx.filter_jit(first_loss.__wrapped__)(overwritten, epoch))


def test_every_buffer_a_failed_method_returns_records_it():
    """Under plain jit the failure goes on to what the failing call returns: the queue of
    a refused add, a Mixer's every source after a refused `set_priorities`."""
    mixer = mesh_kinds.add(PRIORITISED["mixer"](), mesh_kinds.batch(0, ROWS))
    sample = mixer.sample(jax.random.key(0), 4)
    refused = jax.jit(lambda m, s: m.set_priorities(s, jnp.full(4, -1.0)))(mixer, sample)
    for source in refused.buffers:
        assert int(source.storage.error) != 0
    _assert_same(mixer, refused)


def test_a_checkify_check_of_your_own_raises_from_the_checked_step():
    """The checked step runs `checkify`'s user checks too, instead of refusing to lower them."""
    from jax.experimental import checkify

    def step(x):
        checkify.check(x > 0, "x must be positive, got {x}", x=x)
        return x + 1

    with pytest.raises(checkify.JaxRuntimeError, match="x must be positive") as caught:
        eb.filter_jit(step)(jnp.float32(-1))
    assert float(caught.value.output) == 0.0
    assert float(eb.filter_jit(step)(jnp.float32(2))) == 3.0


def test_where_checkify_takes_no_rule_the_checked_step_checks_its_output(monkeypatch):
    """A JAX whose `checkify` no longer takes the library's rule (`_carried.AVAILABLE`
    false): the checked step still raises what the step returns, as before issue 36."""
    import equibuffer._carried

    monkeypatch.setattr(equibuffer._carried, "AVAILABLE", False)
    step = eb.filter_jit(lambda b, k: (b, b.sample(k, 4)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        step(_empty(), jax.random.key(0))
    buffer, sample = step(_empty().add({"x": jnp.ones((1, 3, 2))}), jax.random.key(0))
    assert sample.experience.first["x"].shape == (4, 2)
