import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb


EXAMPLE = {"obs": jnp.zeros(3), "action": jnp.int32(0)}


def _traj(**kw):
    args = dict(add_batch_size=4, max_length_time_axis=10, sequence_length=3)
    args.update(kw)
    return eb.TrajectoryBuffer(EXAMPLE, **args)


def _batch(rows=4, t=None):
    lead = (rows,) if t is None else (rows, t)
    return {"obs": jnp.zeros((*lead, 3)), "action": jnp.zeros(lead, jnp.int32)}


def test_wrong_tree_structure_names_missing_and_extra_leaves():
    with pytest.raises(
        ValueError, match=r"missing leaves \['action'\].*unexpected leaves \['act'\]"
    ):
        _traj().add({"obs": jnp.zeros((4, 3)), "act": jnp.zeros(4, jnp.int32)})


def test_a_list_of_arrays_for_a_leaf_is_named_as_such():
    # One observation per environment in a list, instead of one array for the leaf.
    batch = {"obs": [jnp.zeros(3)] * 4, "action": jnp.zeros(4, jnp.int32)}
    msg = (
        "TrajectoryBuffer.add(): the tree does not match the example the buffer was built "
        "from: leaf ['obs'] is a container of 4 leaves (['obs'][0], ...), not an array: "
        "pass one array per leaf (e.g. jnp.asarray(...))."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        _traj().add(batch)


def test_wrong_leaf_shape_names_leaf_expected_and_received():
    msg = (
        "TrajectoryBuffer.add(): leaf ['obs'] has shape (4, 5), expected (add_batch_size=4, 3) "
        "for one step "
        "or (add_batch_size=4, T, 3) for T steps."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        _traj().add({"obs": jnp.zeros((4, 5)), "action": jnp.zeros(4, jnp.int32)})


def test_wrong_add_batch_size_names_the_argument():
    with pytest.raises(
        ValueError, match=re.escape("leaf ['action'] has shape (8,), expected (add_batch_size=4,)")
    ):
        _traj().add(_batch(rows=8))


def test_wrong_dtype_is_not_cast():
    with pytest.raises(
        TypeError, match=re.escape("leaf ['action'] has dtype float32, expected int32")
    ):
        _traj().add({"obs": jnp.zeros((4, 3)), "action": jnp.zeros(4, jnp.float32)})


def test_leaves_with_different_step_counts():
    with pytest.raises(
        ValueError, match=r"leaf \['obs'\] holds 2 steps but leaf \['action'\] holds one step"
    ):
        _traj().add({"action": jnp.zeros(4, jnp.int32), "obs": jnp.zeros((4, 2, 3))})


def test_zero_steps():
    with pytest.raises(ValueError, match="0 time steps"):
        _traj().add(_batch(t=0))


def test_errors_also_at_trace_time_under_jit():
    with pytest.raises(TypeError, match="expected int32"):
        eb.filter_jit(lambda b, x: b.add(x))(
            _traj(), {"obs": jnp.zeros((4, 3)), "action": jnp.zeros(4)}
        )


def test_sequence_length_larger_than_ring():
    with pytest.raises(
        ValueError, match=r"sequence_length=11 is larger than the ring \(max_length_time_axis=10"
    ):
        _traj(sequence_length=11)


def test_period_below_one():
    with pytest.raises(ValueError, match="`period` must be at least 1, got 0"):
        _traj(period=0)


@pytest.mark.parametrize("min_length", [2, 11])
def test_min_length_out_of_range(min_length):
    with pytest.raises(
        ValueError,
        match=f"min_length_time_axis={min_length} is out of range: a row must hold at least "
        "the 3 steps one sample spans and at most the 10 steps it keeps",
    ):
        _traj(min_length_time_axis=min_length)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(add_batch_size=0), "add_batch_size"),
        (dict(max_length_time_axis=0), "max_length_time_axis"),
        (dict(max_length_time_axis=None, capacity=-5), "capacity"),
        (dict(max_length_time_axis=None, max_size=0), "max_size"),
        (dict(sequence_length=0), "sequence_length"),
    ],
)
def test_non_positive_sizes(kw, name):
    with pytest.raises(ValueError, match=f"`{name}` must be at least 1"):
        _traj(**kw)


def test_exactly_one_size():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "TrajectoryBuffer(): give only one of `capacity` (alias `max_size`), steps in total, "
            "or `max_length_time_axis`, per row, got {'capacity': 100, 'max_length_time_axis': 10}."
        ),
    ):
        _traj(capacity=100)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "TransitionBuffer(): give the buffer's size: `capacity` (alias `max_size`, "
            "`max_length`), steps in total, or `max_length_time_axis`, steps per row."
        ),
    ):
        eb.TransitionBuffer(EXAMPLE, add_batch_size=2)


def test_transition_buffer_needs_two_steps_per_row():
    with pytest.raises(
        ValueError,
        match=r"2 steps \(one transition\) is larger than the ring \(max_length_time_axis=1 ",
    ):
        eb.TransitionBuffer(EXAMPLE, add_batch_size=4, capacity=4)


def test_example_leaves_are_taken_as_jnp_asarray_takes_them():
    """Python and NumPy numbers, bools and NumPy arrays in the example are taken as
    `jnp.asarray` takes them, as Flashbax takes them (issue 47: a ported agent's
    `info={"episode_return": 0.0, "episode_length": 0}`); strings and other objects are
    still refused, naming the leaf."""
    example = {
        "reward": 0.0,
        "length": 0,
        "done": False,
        "obs": np.zeros(3),  # float64: float32 without x64, as jnp.asarray makes it
        "action": np.int64(2),
        "info": {"episode_return": 0.0},
    }
    buffer = eb.ItemBuffer(example, add_batch_size=1, max_length_time_axis=2)
    expected = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), example
    )
    assert buffer.storage.example() == expected
    batch = jax.tree.map(lambda x: jnp.asarray(x)[None], example)
    sample = eqx.filter_jit(lambda b: b.add(batch).sample(jax.random.key(0), 2))(buffer)
    assert sample.experience["info"]["episode_return"].dtype == jnp.float32
    for leaf, message in [
        ("a", r"example leaf \['reward'\] is str 'a'; every leaf must be a number, a bool"),
        (object(), r"example leaf \['reward'\] is object <object"),
        (2**40, r"example leaf \['reward'\] is 1099511627776, which JAX's default int32 cannot"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            eb.ItemBuffer({"reward": leaf}, add_batch_size=1, max_length_time_axis=2)


def test_example_leaf_must_not_be_a_typed_key():
    with pytest.raises(TypeError, match=r"example leaf \['key'\] is a typed PRNG key \(key<fry>\)"):
        eb.ItemBuffer({"key": jax.random.key(0)}, add_batch_size=1, max_length_time_axis=2)
    # Its data is stored, and wrapped back.
    data = jax.random.key_data(jax.random.key(3))
    buffer = eb.ItemBuffer({"key": data}, add_batch_size=1, max_length_time_axis=2)
    sample = buffer.add({"key": data[None]}).sample(jax.random.key(0), 1)
    assert jax.random.wrap_key_data(sample.experience["key"][0]) == jax.random.key(3)


def test_sample_batch_size_must_be_positive():
    buffer = _traj().add(_batch(t=3))
    with pytest.raises(ValueError, match="`batch_size` must be at least 1"):
        buffer.sample(jax.random.key(0), 0)


@pytest.mark.parametrize("jit", [True, False])
def test_sampling_too_early_raises_instead_of_zeros(jit):
    buffer = _traj().add(_batch(t=2))  # 2 steps per row < sequence_length 3
    sample = lambda b, k: b.sample(k, 5)  # noqa: E731
    if jit:
        sample = eb.filter_jit(sample)
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet.*buffer.can_sample"):
        jax.block_until_ready(sample(buffer, jax.random.key(0)))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_numpy_64_bit_inputs_agree_eager_and_jitted(jitted):
    """A NumPy float64/int64 batch is what JAX makes of it: float32/int32 without x64 (accepted,
    eagerly as under jit, where JAX converts it before `add` sees it), float64/int64 with x64
    (refused by a float32 buffer, both ways). A dtype JAX keeps (float16) is refused."""
    import numpy as np

    example = {"x": jnp.zeros(3), "i": jnp.int32(0)}
    add = eb.filter_jit(lambda b, x: b.add(x)) if jitted else (lambda b, x: b.add(x))
    buffer = eb.TrajectoryBuffer(example, add_batch_size=2, capacity=16, sequence_length=2)
    batch = {"x": np.arange(6.0).reshape(2, 3), "i": np.arange(2)}
    assert batch["x"].dtype == np.float64 and batch["i"].dtype == np.int64
    added = add(buffer, batch)
    assert added.storage.data["x"].dtype == jnp.float32
    assert added.storage.data["x"][:, 0].tolist() == batch["x"].tolist()
    with pytest.raises(TypeError, match=r"leaf \['x'\] has dtype float16, expected float32"):
        add(buffer, {"x": np.ones((2, 3), np.float16), "i": np.arange(2)})
    with jax.enable_x64(True):
        buffer = eb.TrajectoryBuffer(example, add_batch_size=2, capacity=16, sequence_length=2)
        with pytest.raises(TypeError, match=r"has dtype (float64|int64), expected (float32|int32)"):
            add(buffer, batch)


def test_one_device_checks_keep_jits_fast_path():
    """In a process with one device the checks are Equinox's own (a pure callback): no debug
    callback, an effect that takes a jitted call off JAX's fast dispatch (6x per call)."""
    buffer = eb.PrioritisedTransitionBuffer({"x": jnp.zeros(2)}, add_batch_size=1, capacity=8)
    buffer = buffer.add({"x": jnp.ones((1, 3, 2))})
    sample = buffer.sample(jax.random.key(0), 4)
    for fn in (
        lambda b: b.sample(jax.random.key(0), 4),
        lambda b: b.set_priorities(sample, jnp.ones(4)),
    ):
        jaxpr = jax.make_jaxpr(fn)(buffer)
        assert "debug_callback" not in str(jaxpr) and not jaxpr.effects
