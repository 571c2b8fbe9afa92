import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import equibuffer as eb


def _storage(rows=2, length=5):
    return eb.RingStorage({"x": jnp.zeros((), jnp.float32)}, rows=rows, length=length)


def _steps(rows, t, start=0):
    return {"x": jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.float32), (rows, t))}


def test_write_one_and_many_steps():
    s = _storage()
    s = s.write({"x": jnp.array([1.0, 2.0])})  # one step
    s = s.write(_steps(2, 3, start=10))  # three steps
    assert (int(s.head), int(s.fill), s.steps_added()) == (4, 4, 4)
    np.testing.assert_array_equal(s.data["x"][0], [1, 10, 11, 12, 0])


def test_wrap_around_keeps_newest():
    s = _storage(rows=1, length=5)
    s = s.write(_steps(1, 4))
    s = s.write(_steps(1, 3, start=4))  # steps 4, 5, 6 -> slots 4, 0, 1
    assert (int(s.head), int(s.fill), s.steps_added()) == (2, 5, 7)
    np.testing.assert_array_equal(s.data["x"][0], [5, 6, 2, 3, 4])


@pytest.mark.parametrize("t", [5, 6, 13])
def test_write_longer_than_ring(t):
    s = _storage(rows=1, length=5).write(_steps(1, 2))
    s = s.write(_steps(1, t, start=2))
    total = 2 + t
    assert (int(s.head), int(s.fill), s.steps_added()) == (total % 5, 5, total)
    # Slot of absolute step a is a % 5; only the newest five steps are kept.
    expect = np.zeros(5)
    for a in range(total - 5, total):
        expect[a % 5] = a
    np.testing.assert_array_equal(s.data["x"][0], expect)


def test_count_carries_into_high_word():
    s = _storage(rows=1, length=4).write(_steps(1, 4))
    near = 2**32 - 2
    s = s.with_counters(steps_added=near, head=near % 4)
    s = s.write(_steps(1, 3))
    assert (int(s.count_hi), int(s.count_lo)) == (1, 1)
    assert s.steps_added() == 2**32 + 1
    assert int(s.head) == (2**32 + 1) % 4


def test_count_carries_under_jit():
    s = _storage(rows=1, length=4)
    s = s.with_counters(steps_added=2**32 - 1)
    s = eqx.filter_jit(lambda s, b: s.write(b))(s, _steps(1, 1))
    assert s.steps_added() == 2**32


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(0, 2**64 - 1),
    modulus=st.one_of(
        st.integers(1, 300), st.sampled_from([2**16 - 1, 2**16 + 1, 2**20, 999_983, 2**30 + 3])
    ),
)
def test_count_mod_is_exact(total, modulus):
    s = _storage(rows=1, length=4)
    s = s.with_counters(steps_added=total)
    assert s.steps_added() == total
    assert int(s.count_mod(modulus)) == total % modulus


def test_example_accepts_shape_dtype_structs():
    s = eb.RingStorage({"x": jax.ShapeDtypeStruct((3,), jnp.int8)}, rows=2, length=4)
    assert s.data["x"].shape == (2, 4, 3) and s.data["x"].dtype == jnp.int8
    assert s.example() == {"x": jax.ShapeDtypeStruct((3,), jnp.int8)}


def test_leaves_are_separate_allocations():
    s = eb.RingStorage({"a": jnp.zeros(()), "b": jnp.zeros(())}, rows=1, length=2)
    leaves = jax.tree.leaves(s)
    ptrs = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(ptrs)) == len(ptrs)


def test_with_counters_refuses_values_the_ring_cannot_hold():
    s = _storage(rows=1, length=4)
    with pytest.raises(ValueError, match=r"with_counters\(\): head=4 is not a slot of length=4"):
        s.with_counters(head=4)
    with pytest.raises(ValueError, match=r"with_counters\(\): fill=5 is not in \[0, length=4\]"):
        s.with_counters(fill=5)
    with pytest.raises(ValueError, match=r"steps_added=-1 is not in \[0, 2\*\*64\)"):
        s.with_counters(steps_added=-1)
    kept = s.write(_steps(1, 3)).with_counters(fill=2)
    assert (int(kept.head), int(kept.fill), kept.steps_added()) == (3, 2, 3)
