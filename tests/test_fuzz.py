"""Bad input by the thousand (issue 49): random bad arguments, each refused with its own
message, and a refused call changes no data.

A refused `set_priorities` (indices out of range, as from another buffer's sample; a
negative, NaN or infinite priority; both; among valid entries and stale ones) leaves every
array of every prioritised kind as it was, the sum tree included: eagerly it raises, under
plain `jax.jit` the failure is recorded and `eb.check` raises it, under `eb.filter_jit` (with
donation) it raises with the buffer it returned in `error.output`. The buffers returned are
compared leaf by leaf with the buffer before the call."""

import collections
import math
import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings

import equibuffer as eb

from . import mesh_kinds
from .helpers import budget
from .test_frames import wrapper_stack
from .test_surfaced import _assert_same, _draw, PRIORITISED, ROWS


BATCH = 4  # the rows of every sample (a Mixer's: 2 from each source)
# Each kind's number of windows: an index at or past it, or negative, is out of range.
WINDOWS = {name: (3 * 16 if name == "clustered" else ROWS * 16) for name in PRIORITISED}
OUT_OF_RANGE = "every index must be in"
BAD_PRIORITY = "every priority must be non-negative and finite"
# The bad inputs tried, by kind and by the message that refused them (printed with `-s`).
TRIED: collections.Counter[tuple[str, str]] = collections.Counter()


def _filled(name: str):
    return mesh_kinds.add(PRIORITISED[name](), mesh_kinds.batch(1, ROWS, t=8))


_FILLED = {}
_SAMPLES = {}


def _buffer_and_sample(name: str):
    """A filled buffer of kind `name` and a sample drawn from it (made once per kind)."""
    if name not in _FILLED:
        buffer = _filled(name)
        _FILLED[name], _SAMPLES[name] = buffer, _draw(buffer, jax.random.key(0))
    return _FILLED[name], _SAMPLES[name]


def _rewritten(sample, indices, steps_shift):
    """`sample` with its `i`-th index replaced by `indices[i]` where that is not None, and
    its `steps` moved by `steps_shift` (stale windows: dropped, not refused). A Mixer's
    sample holds one `indices` leaf per source, its rows in order: they are counted on."""
    at = {"indices": 0, "steps": 0}

    def rows(field, n):
        start = at[field]
        at[field] += n
        return slice(start, start + n)

    def rewrite(path, x):
        name = jax.tree_util.keystr(path)
        if name.endswith(".indices"):
            given = indices[rows("indices", x.shape[0])]
            new = [old if v is None else v for old, v in zip(np.asarray(x), given, strict=True)]
            return jnp.asarray(np.array(new, np.int64).astype(np.int32))
        if name.endswith(".steps") and x.dtype == jnp.uint32:  # (not an n-step's count)
            return x + jnp.asarray(steps_shift[rows("steps", x.shape[0])], jnp.uint32)
        return x

    return jax.tree_util.tree_map_with_path(rewrite, sample)


BAD_FLOATS = st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -1e-30, -3e38])
GOOD_FLOATS = st.floats(0.0, 1e30, allow_subnormal=False)


@st.composite
def bad_updates(draw, name: str):
    """Indices (None: the sample's own), a shift of the steps and priorities: some indices
    out of range, some priorities bad, or both, among valid entries."""
    windows = WINDOWS[name]
    outside = st.one_of(
        st.integers(-(2**31), -1), st.integers(windows, 2**31 - 1), st.sampled_from([-1, windows])
    )
    which = draw(st.sampled_from(["indices", "priorities", "both"]))
    indices = [None] * BATCH
    priorities = draw(st.lists(GOOD_FLOATS, min_size=BATCH, max_size=BATCH))
    for bad, values, strategy in [
        ("indices", indices, outside),
        ("priorities", priorities, BAD_FLOATS),
    ]:
        if which in (bad, "both"):
            for at in draw(st.sets(st.integers(0, BATCH - 1), min_size=1)):
                values[at] = draw(strategy)
    shift = draw(st.lists(st.sampled_from([0, 0, 1, 2**31]), min_size=BATCH, max_size=BATCH))
    return np.array(indices, object), np.array(shift, np.uint32), np.array(priorities, np.float32)


def _message(name: str, indices, priorities) -> str:
    """The message the update is refused with: a source names an index out of range before a
    bad priority. A Mixer with a bad priority sends every source NaN priorities: the first
    source's message is raised, out of range only if its own rows (the first half) are."""
    out = [i is not None for i in indices]
    if name == "mixer" and not np.all(np.isfinite(priorities) & (priorities >= 0)):
        out = out[: BATCH // 2]
    return OUT_OF_RANGE if any(out) else BAD_PRIORITY


def _set(buffer, sample, priorities):
    return buffer.set_priorities(sample, priorities)


_JITTED = eqx.filter_jit(_set)
_CHECKED = eb.filter_jit(_set, donate="all")


@pytest.mark.parametrize("name", sorted(PRIORITISED))
@settings(max_examples=budget(40), deadline=None)
@given(data=st.data())
def test_a_refused_set_priorities_changes_nothing(name, data):
    buffer, sample = _buffer_and_sample(name)
    indices, shift, priorities = data.draw(bad_updates(name))
    # In any float dtype a user may hold them in (float64 enters as float32 without x64,
    # as JAX converts it; float16 and bfloat16 too, the bad values staying bad in each).
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.float16, jnp.bfloat16]))
    with np.errstate(over="ignore"):  # (-3e38 is -inf in float16: still bad)
        priorities = np.asarray(priorities, np.float32).astype(dtype)
    bad = _rewritten(sample, indices, shift)
    message = _message(name, indices, priorities)
    TRIED[name, message] += 1
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        _set(buffer, bad, priorities)  # eagerly: raised at once
    refused = _JITTED(buffer, bad, priorities)  # plain jit: recorded
    _assert_same(buffer, refused)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        eb.check(refused)
    donated = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, (buffer, bad))
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)) as caught:
        _CHECKED(*donated, priorities)
    _assert_same(buffer, caught.value.output)


def test_the_tree_is_the_one_the_kept_priorities_give():
    """After refused updates, every node of the tree is the sum of its children: the next
    draw follows the law of the priorities kept (the fuzzer's case: a sample of a buffer four
    times larger, under plain jit; the root went from 16 to 6,808)."""
    ex = {"x": jnp.float32(0)}
    small = eb.PrioritisedItemBuffer(ex, add_batch_size=1, capacity=16)
    big = eb.PrioritisedItemBuffer(ex, add_batch_size=1, capacity=64)
    small = small.add({"x": jnp.arange(16.0)[None]})
    big = big.add({"x": jnp.arange(64.0)[None]})
    sample = big.sample(jax.random.key(0), 8)
    assert int(jnp.max(sample.indices)) >= 16
    after = jax.jit(_set)(small, sample, jnp.full((8,), 5.0))
    tree = after.rule.tree
    np.testing.assert_array_equal(np.asarray(tree.nodes), np.asarray(small.rule.tree.nodes))
    assert float(tree.total()) == 16.0
    with pytest.raises(eqx.EquinoxRuntimeError, match=OUT_OF_RANGE):
        eb.check(after)


# Priorities that are not real numbers, and betas that are not a float: refused where they
# enter, by name, with what to pass (before, a string beta was taken as a number, complex
# priorities were taken, and None or strings failed inside JAX naming nothing of the user's).
NOT_PRIORITIES = [
    None,
    "high",
    np.array(["a", "b", "c", "d"]),
    np.ones(BATCH, np.complex64),
    np.ones(BATCH, bool),
    [object()] * BATCH,
]
NOT_BETAS = ["0.4", "high", None, True, 1j, np.array("x"), np.complex64(1)]


@pytest.fixture
def as_users_run(monkeypatch):
    """The library's own checks, without the tests' jaxtyping hook, which would refuse these
    first (by the annotation): what a user, who runs without it, reads."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


@pytest.mark.parametrize("name", sorted(PRIORITISED))
def test_priorities_that_are_not_real_numbers_are_refused_by_name(name, as_users_run):
    buffer, sample = _buffer_and_sample(name)
    for bad in NOT_PRIORITIES:
        with pytest.raises(TypeError, match="`priorities` must be real numbers") as caught:
            buffer.set_priorities(sample, bad)
        assert type(bad).__name__ in str(caught.value)
        TRIED[name, "`priorities` must be real numbers"] += 1


@pytest.mark.parametrize("name", sorted(PRIORITISED))
def test_a_beta_that_is_not_a_float_is_refused_by_name(name, as_users_run):
    buffer, _ = _buffer_and_sample(name)
    for bad in NOT_BETAS:
        with pytest.raises(TypeError, match="`beta` must be a float") as caught:
            buffer.sample(jax.random.key(0), BATCH, beta=bad)
        assert repr(bad) in str(caught.value)
        TRIED[name, "`beta` must be a float"] += 1


PAST_INT32 = [2**31, 2**40]
ALL_KINDS = mesh_kinds.kinds(ROWS, 16)


@pytest.mark.parametrize("name", sorted(set(ALL_KINDS) - {"queue"}))  # (it takes no batch size)
def test_a_batch_size_past_int32_is_refused_by_name(name):
    """Before, 2**40 ended the process (SIGFPE inside XLA) and 2**31 failed in JAX's
    dispatcher, naming nothing of the user's."""
    buffer = mesh_kinds.add(ALL_KINDS[name](), mesh_kinds.batch(1, ROWS, t=8))
    for size in PAST_INT32:
        with pytest.raises(ValueError, match=f"`batch_size`={size} is more than a buffer can"):
            buffer.sample(jax.random.key(0), size)
        TRIED[name, "`batch_size` past int32"] += 1


EX = mesh_kinds.EXAMPLE
SIZED = {
    "add_batch_size": lambda n: eb.ItemBuffer(EX, add_batch_size=n, capacity=8),
    "capacity": lambda n: eb.ItemBuffer(EX, add_batch_size=1, capacity=n),
    "max_length_time_axis": lambda n: eb.TrajectoryBuffer(
        EX, add_batch_size=1, sequence_length=2, max_length_time_axis=n
    ),
    "sequence_length": lambda n: eb.TrajectoryBuffer(
        EX, add_batch_size=1, sequence_length=n, max_length_time_axis=8
    ),
    "period": lambda n: eb.TrajectoryBuffer(
        EX, add_batch_size=1, sequence_length=2, period=n, max_length_time_axis=8
    ),
    "num_clusters": lambda n: eb.ClusteredBuffer(
        EX, add_batch_size=1, num_clusters=n, cluster_capacity=8, cluster_fn=mesh_kinds.cluster_of
    ),
    "cluster_capacity": lambda n: eb.ClusteredBuffer(
        EX, add_batch_size=1, num_clusters=3, cluster_capacity=n, cluster_fn=mesh_kinds.cluster_of
    ),
}


@pytest.mark.parametrize("argument", sorted(SIZED))
def test_a_size_past_int32_is_refused_by_name_before_allocating(argument):
    """Before, such sizes reached XLA's allocator ("Out of memory allocating N bytes") or
    failed later with an `OverflowError`, naming no argument."""
    for size in PAST_INT32:
        with pytest.raises(ValueError, match=f"`{argument}`={size} is more than a buffer can"):
            SIZED[argument](size)


BIG = {"obs": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}  # 4 MiB a step
BEYOND_MEMORY = {  # within int32, but 2**20 steps of 4 MiB: 4 TiB
    "add_batch_size": lambda: eb.ItemBuffer(BIG, add_batch_size=2**20, capacity=8),
    "capacity": lambda: eb.ItemBuffer(BIG, add_batch_size=1, capacity=2**20),
    "max_length_time_axis": lambda: eb.TrajectoryBuffer(
        BIG, add_batch_size=2, sequence_length=2, max_length_time_axis=2**19
    ),
    "num_clusters": lambda: eb.ClusteredBuffer(
        BIG, add_batch_size=1, num_clusters=2**10, cluster_capacity=2**10, cluster_fn=lambda x: 0
    ),
    "length": lambda: eb.RingStorage(BIG, rows=2**10, length=2**10),
}


@pytest.mark.parametrize("argument", sorted(BEYOND_MEMORY))
def test_a_ring_larger_than_the_memory_is_refused_by_name_before_allocating(argument):
    """Before, XLA's allocator refused it ("Out of memory allocating 4398046511104 bytes"),
    naming no argument. A template of the same buffer (`eqx.filter_eval_shape`, to place with
    `shard_rows` or restore a checkpoint into) allocates nothing and is made."""
    with pytest.raises(ValueError, match=rf"`{argument}`=\d+ .* GB: more than the .* GB "):
        BEYOND_MEMORY[argument]()
    assert isinstance(eqx.filter_eval_shape(BEYOND_MEMORY[argument]), eqx.Module)


def test_a_ring_of_more_steps_than_int32_is_refused_by_name():
    """Each size within int32 but their product past it: before, the allocation or a later
    index overflowed."""
    with pytest.raises(
        ValueError,
        match=r"`add_batch_size`=65536 and `max_length_time_axis`="
        r"65536 make a ring of 65536 rows of 65536 steps, 4294967296 steps in all",
    ):
        eb.TrajectoryBuffer(EX, add_batch_size=2**16, sequence_length=2, max_length_time_axis=2**16)


BAD_LEAVES = [
    (np.array(["a", "b"]), TypeError, "has dtype <U1"),
    (np.array([object(), object()]), TypeError, "has dtype object"),
    (jnp.zeros((0,)), ValueError, r"has shape \(0,\): a dimension of size 0"),
    (jnp.zeros((2, 0, 3)), ValueError, r"has shape \(2, 0, 3\): a dimension of size 0"),
]
CONSTRUCTORS = {
    "item": lambda ex: eb.ItemBuffer(ex, add_batch_size=2, capacity=8),
    "transition": lambda ex: eb.PrioritisedTransitionBuffer(ex, add_batch_size=2, capacity=8),
    "queue": lambda ex: eb.Queue(ex, add_batch_size=2, sequence_length=2, max_length_time_axis=8),
    "clustered": lambda ex: eb.ClusteredBuffer(
        ex, add_batch_size=2, num_clusters=2, cluster_capacity=4, cluster_fn=lambda item: 0
    ),
}


@pytest.mark.parametrize("kind", sorted(CONSTRUCTORS))
@pytest.mark.parametrize("leaf,error,message", BAD_LEAVES, ids=["str", "object", "0", "2-0-3"])
def test_an_example_leaf_that_holds_nothing_or_no_numbers_is_refused_by_name(
    kind, leaf, error, message
):
    """Before, an example leaf of shape (0,) or (2, 0, 3) was accepted and the first `add` or
    `sample` failed with `ZeroDivisionError`; strings and objects failed naming no leaf."""
    example = {"reward": jnp.float32(0), "obs": leaf}
    with pytest.raises(error, match=r"example leaf \['obs'\] " + message):
        CONSTRUCTORS[kind](example)


def test_numpy_data_is_taken_as_jax_converts_it_and_refused_where_it_would_change():
    """NumPy `float64`/`int64` data go into `float32`/`int32` leaves as JAX converts them (at
    any jit boundary, without x64); an eager `add`, which still sees the NumPy array, refuses
    a value that conversion would change (before, `2**40 + 5` was stored truncated)."""
    example = {"count": jnp.int32(0), "reward": jnp.float32(0)}
    buffer = eb.ItemBuffer(example, add_batch_size=2, capacity=8)
    good = {"count": np.array([1, -(2**31)], np.int64), "reward": np.array([0.5, 1e38])}
    added = buffer.add(good)
    stored = jax.tree.map(lambda x: np.asarray(x[:, 0]), added.storage.data)
    np.testing.assert_array_equal(stored["count"], good["count"].astype(np.int32))
    np.testing.assert_array_equal(stored["reward"], good["reward"].astype(np.float32))
    assert eqx.filter_jit(lambda b, x: b.add(x))(buffer, good).storage.data["count"].dtype == (
        jnp.int32
    )
    for bad, message in [
        ({"count": np.array([1, 2**40 + 5])}, r"leaf \['count'\] holds 1099511627781, which int32"),
        ({"count": np.array([-(2**31) - 1, 0])}, r"leaf \['count'\] holds -2147483649"),
        ({"reward": np.array([1.0, -1e39])}, r"leaf \['reward'\] holds -1e\+39, past the largest"),
    ]:
        with pytest.raises(ValueError, match=message):
            buffer.add({**good, **bad})
    # Infinite and NaN values are what they are in either dtype: taken.
    buffer.add({**good, "reward": np.array([np.inf, np.nan])})


def test_sequences_given_as_one_thing_are_refused_by_name(as_users_run):
    """Before, `Mixer(buffers=one_buffer)` and a single float as `proportions` or `weights`
    failed inside Python's `tuple()` ("object is not iterable"), naming no argument; a share
    given as a string was taken by `float()`."""
    one = ALL_KINDS["item"]()
    with pytest.raises(
        TypeError,
        match=r"`buffers` must be a sequence .* got one ItemBuffer; for one, pass a tuple",
    ):
        eb.Mixer(one, proportions=(1.0,))
    with pytest.raises(TypeError, match="`proportions` must be a sequence"):
        eb.Mixer((one,), proportions=1.0)
    with pytest.raises(TypeError, match="`proportions` must be a sequence"):
        eb.Mixer((one,), proportions="1")
    clustered = dict(add_batch_size=1, num_clusters=2, cluster_capacity=4, cluster_fn=lambda x: 0)
    with pytest.raises(TypeError, match="`weights` must be a sequence"):
        eb.ClusteredBuffer(EX, weights=0.5, **clustered)
    with pytest.raises(TypeError, match=r"weights\[0\] must be a Python float, got '0.5'"):
        eb.ClusteredBuffer(EX, weights=("0.5", "0.5"), **clustered)
    with pytest.raises(
        ValueError, match=r"1 weights for 2 clusters \(`num_clusters`=2\); give one each"
    ):
        eb.ClusteredBuffer(EX, weights=(1.0,), **clustered)
    assert eb.ClusteredBuffer(EX, weights=np.array([0.25, 0.75]), **clustered).weights == (
        0.25,
        0.75,
    )


@pytest.fixture(autouse=True)
def _report_bad_inputs(request):
    """Each test's bad inputs, by kind and message, in its report: the terminal summary
    counts them (tests/conftest.py), also across xdist workers."""
    before = collections.Counter(TRIED)
    yield
    tried = {f"{k}\t{m}": n - before[k, m] for (k, m), n in TRIED.items() if n > before[k, m]}
    if tried:
        request.node.user_properties.append(("bad_inputs", tried))


# --------------------------------------------- every refused write: random bad input, no change


def refused_three_ways(fn, state, args, message: str, kept=lambda out: out) -> None:
    """`fn(state, *args)` is refused with `message` eagerly (raised at once), under plain jit
    (recorded: `eb.check` raises it) and under `eb.filter_jit` with donation (raised, the
    state it returned in `error.output`), and in each the state it returns (`kept(out)`)
    holds every array `state` held."""
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        fn(state, *args)
    refused = eqx.filter_jit(fn)(state, *args)
    _assert_same(state, kept(refused))
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        eb.check(refused)
    donated = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, (state, args))
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)) as caught:
        eb.filter_jit(fn, donate="all")(donated[0], *donated[1])
    _assert_same(state, kept(caught.value.output))


K = 3  # frames a stack holds
FRAMED_EX = {"obs": jnp.zeros((2, K), jnp.int32), "done": jnp.bool_(False)}
FRAMES = eb.Frames("obs", K, episode_end="done")
RING = dict(add_batch_size=2, max_length_time_axis=8)
FRAMED = {
    "transition": lambda: eb.TransitionBuffer(FRAMED_EX, frames=FRAMES, **RING),
    "prioritised": lambda: eb.PrioritisedTrajectoryBuffer(
        FRAMED_EX, sequence_length=2, frames=FRAMES, **RING
    ),
    "rate_limited": lambda: eb.RateLimited(
        eb.ItemBuffer(FRAMED_EX, frames=FRAMES, **RING), 4.0, 64.0
    ),
    "queue": lambda: eb.Queue(FRAMED_EX, sequence_length=1, frames=FRAMES, **RING),
}
_FRAMED_EMPTY: dict = {}


def _stacks(frames, dones, steps):
    """The wrapper's stacks of one row at `steps` (tests/test_frames.py's reference)."""
    return np.stack([wrapper_stack(frames, dones, t, K, "reset", -1) for t in steps])


def _add(buffer, batch):
    return buffer.add(batch)


_ADD = eqx.filter_jit(_add)  # (to fill a buffer before the refused call)


@st.composite
def disagreeing_stacks(draw):
    """The `held` steps per row a framed buffer holds and the next `t` steps as the wrapper
    stacks them but for one frame `k - 2` of one step of one row, changed."""
    held, t = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    frames = [[np.array([r, n]) * 100 + n for n in range(held + t)] for r in range(2)]
    dones = [draw(st.lists(st.booleans(), min_size=held + t, max_size=held + t)) for _ in range(2)]
    stacks = np.stack([_stacks(frames[r], dones[r], range(held + t)) for r in range(2)])
    done = np.array(dones)
    row, step = draw(st.integers(0, 1)), draw(st.integers(held, held + t - 1))
    bad = stacks.copy()
    bad[row, step, draw(st.integers(0, 1)), K - 2] += draw(st.sampled_from([1, -1, 7, 2**30]))
    return {"obs": stacks[:, :held], "done": done[:, :held]}, {
        "obs": bad[:, held:],
        "done": done[:, held:],
    }


@pytest.mark.parametrize("name", sorted(FRAMED))
@settings(max_examples=budget(10), deadline=None)
@given(case=disagreeing_stacks())
def test_a_refused_stack_changes_nothing(name, case):
    """A stack whose frame `k - 2` is not the row's previous frame (nor the padding at an
    episode's first step) refuses the whole add: no frame, no step count, no priority, no
    credit of a rate limiter, no unread step of a queue changes."""
    held_steps, batch = case
    if name not in _FRAMED_EMPTY:
        _FRAMED_EMPTY[name] = FRAMED[name]()
    buffer = _ADD(_FRAMED_EMPTY[name], jax.tree.map(jnp.asarray, held_steps))
    batch = jax.tree.map(jnp.asarray, batch)
    refused_three_ways(_add, buffer, (batch,), "disagree with the frames the buffer holds")
    TRIED[name, "a stack disagreeing with the frames held"] += 1


QUEUE_EX = {"x": jnp.float32(0)}
_QUEUE = eb.Queue(QUEUE_EX, add_batch_size=2, max_length_time_axis=8, sequence_length=2)


def _steps(start: int, t: int) -> dict:
    return {"x": jnp.arange(start, start + 2 * t, dtype=jnp.float32).reshape(2, t)}


@settings(max_examples=budget(20), deadline=None)
@given(unread=st.integers(0, 8), t=st.integers(1, 8), read=st.integers(0, 3))
def test_a_refused_queue_add_or_sample_changes_nothing(unread, t, read):
    """An add that would overwrite unread steps, and a sample of fewer unread steps than a
    sequence, take and change nothing (after `read` samples have moved the oldest unread
    step around the ring)."""
    queue = _ADD(_QUEUE, _steps(0, 2 * read)) if read else _QUEUE
    for _ in range(read):
        queue = eqx.filter_jit(lambda q: q.sample()[0])(queue)
    if unread:
        queue = _ADD(queue, _steps(100, unread))
    if unread + t > 8:
        refused_three_ways(_add, queue, (_steps(200, t),), "the queue is full")
        TRIED["queue", "an add over unread steps"] += 1
    if unread < 2:
        refused_three_ways(
            lambda q: q.sample(), queue, (), "fewer than sequence_length=2", kept=lambda out: out[0]
        )
        TRIED["queue", "a sample of too few unread steps"] += 1


def _id(item):
    return item["id"]


CLUSTERED_EX = {"id": jnp.int32(0), "x": jnp.float32(0)}
CLUSTERED = {
    "clustered": lambda: eb.ClusteredBuffer(
        CLUSTERED_EX, add_batch_size=2, num_clusters=3, cluster_capacity=4, cluster_fn=_id
    ),
    "prioritised_clustered": lambda: eb.PrioritisedClusteredBuffer(
        CLUSTERED_EX, add_batch_size=2, num_clusters=3, cluster_capacity=4, cluster_fn=_id
    ),
}


@settings(max_examples=budget(20), deadline=None)
@given(
    name=st.sampled_from(sorted(CLUSTERED)),
    held=st.lists(st.integers(0, 2), min_size=2, max_size=2),
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=2).filter(
        lambda ids: any(not 0 <= i < 3 for i in ids)
    ),
)
def test_an_add_with_a_cluster_id_out_of_range_changes_nothing(name, held, ids):
    """`cluster_fn` returning an id outside `[0, num_clusters)` for any item refuses the
    whole add: no item of it is stored, no count or priority changes."""
    buffer = _ADD(CLUSTERED[name](), {"id": jnp.array(held), "x": jnp.ones(2)})
    batch = {"id": jnp.array(ids, jnp.int32), "x": jnp.full(2, 5.0)}
    refused_three_ways(_add, buffer, (batch,), "returned a cluster id outside [0, num_clusters=3)")
    TRIED[name, "a cluster id out of range"] += 1


# ------------------------------------- random bad arguments to every constructor and to sample

FUZZ_EX = {
    "obs": jnp.zeros(3),
    "reward": jnp.float32(0),
    "done": jnp.bool_(False),
    "terminated": jnp.bool_(False),
    "truncated": jnp.bool_(False),
}
_RING = dict(add_batch_size=2, max_length_time_axis=8)
_CLUSTERS = dict(add_batch_size=2, num_clusters=2, cluster_capacity=4, cluster_fn=lambda item: 0)
# Each kind with every argument it takes given (a valid value), one of them replaced below.
FUZZ_KINDS = {
    "TrajectoryBuffer": (eb.TrajectoryBuffer, dict(_RING, sequence_length=2, period=1)),
    "TransitionBuffer": (eb.TransitionBuffer, dict(_RING, n_step=2, discount=0.9)),
    "ItemBuffer": (eb.ItemBuffer, dict(add_batch_size=2, capacity=8, min_size=2)),
    "PrioritisedTrajectoryBuffer": (
        eb.PrioritisedTrajectoryBuffer,
        dict(_RING, sequence_length=2, alpha=0.6),
    ),
    "PrioritisedTransitionBuffer": (
        eb.PrioritisedTransitionBuffer,
        dict(_RING, alpha=0.6, n_step=2, discount=0.9, mode="never_cross"),
    ),
    "EpisodeTrajectoryBuffer": (
        eb.EpisodeTrajectoryBuffer,
        dict(_RING, sequence_length=2, episode_end="done", mode="pad", min_length_time_axis=2),
    ),
    "Queue": (eb.Queue, dict(_RING, sequence_length=2, add_sequence_length=1)),
    "ClusteredBuffer": (eb.ClusteredBuffer, dict(_CLUSTERS, weights=(0.5, 0.5))),
    "PrioritisedClusteredBuffer": (eb.PrioritisedClusteredBuffer, dict(_CLUSTERS, alpha=0.6)),
}
# fmt: off
POOL = [None, "3", "done", "nope", "pad", "never_cross", 3.5, -1, 0, True, 2**40, np.nan,
        np.inf, -0.5, 1e30, [2], (), object(), 1j, np.float32(2.0), np.int64(-3), lambda x: x]
# fmt: on
# The pool first (Hypothesis draws small indices first: each of it is tried), then any
# integer (but those between 64 and 2**31, which may be sizes this machine can allocate and
# so make buffers of gigabytes), float or text.
BAD_VALUES = st.one_of(
    st.sampled_from(POOL),
    st.integers(-(2**1100), 64) | st.integers(2**31, 2**1100),
    st.floats(),
    st.text(max_size=3),
)


def _real(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _size(v, base) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= 1


# The values that are valid for an argument (of a kind given `base`): anything else must be
# refused.
VALID = {
    **dict.fromkeys(
        ["add_batch_size", "max_length_time_axis", "capacity", "sequence_length", "period"]
        + ["n_step", "num_clusters", "cluster_capacity"],
        _size,
    ),
    "alpha": lambda v, base: _real(v) and 0 <= v < math.inf,  # (any exponent >= 0)
    "discount": lambda v, base: _real(v) and 0 <= v <= 1,
    # ("pad" is how episode-aware transitions end: without `episode_end` it is refused)
    "mode": lambda v, base: v == "never_cross" or (v == "pad" and "episode_end" in base),
    "episode_end": lambda v, base: v == "done",
    # (None: the default, the steps one sample spans)
    "min_size": lambda v, base: v is None or _size(v, base),
    "min_length_time_axis": lambda v, base: v is None or _size(v, base),
    "add_sequence_length": lambda v, base: v is None or _size(v, base),
    "weights": lambda v, base: v is None,
    # (a rate: any finite positive number up to 2**28)
    "samples_per_insert": lambda v, base: _real(v) and 0 < v <= 2**28,
    "tolerance": lambda v, base: _real(v) and 0 <= v <= 2**28,
}


# (`as_users_run` is the same for every example: suppressing the check is safe.)
AS_USERS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# The wrappers, built from buffers (their `example` argument unused).
_ITEMS = eb.ItemBuffer(FUZZ_EX, add_batch_size=2, capacity=8)
WRAPPERS = {
    "RateLimited": (
        lambda _, **kw: eb.RateLimited(**kw),
        dict(buffer=_ITEMS, samples_per_insert=1.0, tolerance=64.0),
    ),
    "Mixer": (
        lambda _, **kw: eb.Mixer(**kw),
        dict(buffers=(_ITEMS, _ITEMS), proportions=(0.5, 0.5)),
    ),
}


@pytest.mark.parametrize(
    "kind,argument",
    [(k, a) for k, (_, base) in sorted({**FUZZ_KINDS, **WRAPPERS}.items()) for a in base],
)
@settings(max_examples=budget(60), **AS_USERS)
@given(value=BAD_VALUES)
def test_random_bad_constructor_arguments_are_refused_naming_them(
    kind, argument, value, as_users_run
):
    """Any argument of any kind replaced by a value of the wrong type, sign, size or name:
    a `TypeError` or `ValueError` whose message names the argument (nothing else: no
    `ZeroDivisionError`, `OverflowError`, XLA error or crash), unless the value is one the
    argument takes."""
    cls, base = {**FUZZ_KINDS, **WRAPPERS}[kind]
    try:
        cls(FUZZ_EX, **{**base, argument: value})
    except (TypeError, ValueError) as error:
        assert argument in str(error), str(error)
        TRIED[kind, f"a bad `{argument}`"] += 1
    else:
        assert VALID.get(argument, lambda v, base: False)(value, base), (
            f"{argument}={value!r} taken"
        )


_FUZZ_SAMPLED = {}


def _fuzz_sampled(name: str):
    """A buffer of kind `name` (its `FUZZ_KINDS` arguments) with one batch added."""
    if name not in _FUZZ_SAMPLED:
        cls, base = FUZZ_KINDS[name]
        _FUZZ_SAMPLED[name] = _ADD(
            cls(FUZZ_EX, **base), jax.tree.map(jnp.asarray, _good_batch(name))
        )
    return _FUZZ_SAMPLED[name]


NOT_KEYS = st.sampled_from(
    [None, 0, 7, "key", 3.5, np.int64(1), jnp.zeros(3, jnp.uint32), jnp.zeros(2, jnp.float32)]
)
SAMPLE_ARGUMENTS = {  # (the argument a call names, the call)
    "key": ("key", lambda b, v: b.sample(v, 4)),
    "batch_size": ("batch_size", lambda b, v: b.sample(jax.random.key(0), v)),
    "row_blocks": ("row_blocks", lambda b, v: b.sample(jax.random.key(0), 4, row_blocks=v)),
    "beta": ("beta", lambda b, v: b.sample(jax.random.key(0), 4, beta=v)),
    "epoch key": ("key", lambda b, v: b.epoch(v, 4)),
    "epoch batch_size": ("batch_size", lambda b, v: b.epoch(jax.random.key(0), v)),
}


@settings(max_examples=budget(100), **AS_USERS)
@given(
    kind=st.sampled_from(sorted(set(FUZZ_KINDS) - {"Queue"})),  # (its sample takes nothing)
    call=st.sampled_from(sorted(SAMPLE_ARGUMENTS)),
    data=st.data(),
)
def test_random_bad_sample_arguments_are_refused_naming_them(kind, call, data, as_users_run):
    """A bad key, batch size, number of row blocks or `beta` (prioritised kinds) to
    `sample`, or a bad key or batch size to `epoch`: refused naming it. A `beta` may be a
    traced number (annealed inside jit), so a negative or NaN one given as an array is
    refused by the traced check, which names it too."""
    buffer = _fuzz_sampled(kind)
    argument, method = SAMPLE_ARGUMENTS[call]
    if argument == "beta" and "Prioritised" not in kind:
        return
    value = data.draw(NOT_KEYS if argument == "key" else BAD_VALUES, label="value")
    try:
        method(buffer, value)
    except (TypeError, ValueError, eqx.EquinoxRuntimeError) as error:
        assert f"`{argument}`" in str(error) or argument in str(error), str(error)
        method_name = "epoch" if call.startswith("epoch") else "sample"
        TRIED[kind, f"a bad `{argument}` to {method_name}"] += 1
    else:
        taken = {
            "beta": VALID["alpha"],
            "batch_size": _size,
            "row_blocks": lambda v, base: _size(v, base) and 4 % v == 0,  # (of a batch of 4)
        }
        assert taken.get(argument, lambda v, base: False)(value, {}), f"{argument}={value!r} taken"


def _good_batch(kind: str, rows: int = 2) -> dict:
    steps = 1 if kind == "Queue" else 4  # (its `add_sequence_length`)
    batch = jax.tree.map(lambda x: np.ones((rows, steps, *x.shape), x.dtype), FUZZ_EX)
    return jax.tree.map(lambda x: x[:, 0], batch) if "Clustered" in kind else batch


# What a bad batch does to one leaf (`None`: the whole batch, one row too many).
BAD_BATCHES = {
    "missing": lambda b, leaf: {k: v for k, v in b.items() if k != leaf},
    "extra": lambda b, leaf: {**b, "extra": b[leaf]},
    "dtype": lambda b, leaf: {
        **b,
        leaf: b[leaf].astype(np.int32 if b[leaf].dtype != np.int32 else np.float32),
    },
    "trailing shape": lambda b, leaf: {**b, leaf: np.ones((*b[leaf].shape, 2), b[leaf].dtype)},
    "None": lambda b, leaf: {**b, leaf: None},
    "list": lambda b, leaf: {**b, leaf: b[leaf].tolist()},
    "strings": lambda b, leaf: {**b, leaf: np.full(b[leaf].shape, "a")},
}


@settings(max_examples=budget(100), **AS_USERS)
@given(
    kind=st.sampled_from(sorted(FUZZ_KINDS)),
    bad=st.sampled_from(sorted(BAD_BATCHES) + ["rows"]),
    leaf=st.sampled_from(sorted(FUZZ_EX)),
    jit=st.booleans(),
)
def test_random_bad_batches_are_refused_naming_the_leaf(kind, bad, leaf, jit, as_users_run):
    """A batch missing a leaf, with an extra one, a leaf of another dtype or trailing shape,
    given as None, a list or strings, or one row too many: refused when the add is traced
    (eagerly or under jit alike), by a `TypeError` or `ValueError` naming the leaf (or
    `add_batch_size`), and the buffer is untouched (it is immutable: the add returns no
    buffer at all)."""
    cls, base = FUZZ_KINDS[kind]
    buffer = _fuzz_sampled(kind)
    if bad == "rows":
        batch, named = _good_batch(kind, rows=3), "add_batch_size"
    else:
        batch, named = BAD_BATCHES[bad](_good_batch(kind), leaf), leaf
        named = "extra" if bad == "extra" else named
    with pytest.raises((TypeError, ValueError)) as caught:
        (eqx.filter_jit(_add) if jit else _add)(buffer, batch)
    if jit and bad == "strings":  # (refused by JAX at the jit boundary, before any library code)
        assert "as an abstract array" in str(caught.value), str(caught.value)
    else:
        assert named in str(caught.value), str(caught.value)
    TRIED[kind, f"a batch with {bad}"] += 1
