"""Size arguments: one spelling per unit on every buffer, Flashbax's names meaning what they
mean in Flashbax (or refused with an error naming what to pass), the count of steps added."""

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb


EXAMPLE = {"obs": jnp.zeros(3), "reward": jnp.float32(0), "terminated": jnp.bool_(False),
           "truncated": jnp.bool_(False), "done": jnp.bool_(False)}  # fmt: skip

# (constructor, extra arguments, flat: whether Flashbax's counterpart is a flat/item buffer)
KINDS = [
    (eb.TrajectoryBuffer, dict(sequence_length=3), False),
    (eb.PrioritisedTrajectoryBuffer, dict(sequence_length=3), False),
    (eb.EpisodeTrajectoryBuffer, dict(sequence_length=3), False),
    (eb.PrioritisedEpisodeTrajectoryBuffer, dict(sequence_length=3), False),
    (eb.TransitionBuffer, {}, True),
    (eb.TransitionBuffer, dict(n_step=2, discount=0.9), True),
    (eb.PrioritisedTransitionBuffer, {}, True),
    (eb.ItemBuffer, {}, True),
    (eb.PrioritisedItemBuffer, {}, True),
]
IDS = [f"{k.__name__}{'-nstep' if 'n_step' in kw else ''}" for k, kw, _ in KINDS]


def _window(kw: dict, cls: type) -> int:
    if "sequence_length" in kw:
        return kw["sequence_length"]
    if "n_step" in kw:
        return kw["n_step"] + 1
    return 1 if "Item" in cls.__name__ else 2


@pytest.mark.parametrize("cls,kw,flat", KINDS, ids=IDS)
def test_total_and_per_row_spellings_agree(cls, kw, flat):
    rows = 6
    names = ["capacity", "max_size"] + (["max_length"] if flat else [])
    for name in names:
        buffer = cls(EXAMPLE, add_batch_size=rows, **{name: 32}, **kw)
        # A total is rounded up to whole rows: never smaller than asked for.
        assert buffer.max_length_time_axis == math.ceil(32 / rows) == 6
        assert buffer.capacity == 36
    per_row = cls(EXAMPLE, add_batch_size=rows, max_length_time_axis=6, **kw)
    assert per_row.capacity == 36 and per_row.max_length_time_axis == 6
    window = _window(kw, cls)
    # The minimum before sampling: default one window per row; totals rounded up to rows.
    assert per_row.min_length_time_axis == window and per_row.min_size == window * rows
    totals = ["min_size"] + (["min_length"] if flat else [])
    for name in totals:
        buffer = cls(EXAMPLE, add_batch_size=rows, capacity=36, **{name: 20}, **kw)
        assert buffer.min_length_time_axis == max(window, math.ceil(20 / rows)) == 4
        assert buffer.min_size == 24
    buffer = cls(EXAMPLE, add_batch_size=rows, capacity=36, min_length_time_axis=5, **kw)
    assert buffer.min_length_time_axis == 5 and buffer.min_size == 30


@pytest.mark.parametrize("cls,kw,flat", [k for k in KINDS if not k[2]], ids=IDS[:4])
def test_flashbax_flat_names_refused_on_trajectory_buffers(cls, kw, flat):
    where = f"{cls.__name__}()"
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{where}: `max_length` is not taken here: it is Flashbax's name for a flat or item "
            "buffer's total, and trajectory buffers count per row. Pass "
            "`max_length_time_axis=` (steps per row) or `capacity=` (steps in total)."
        ),
    ):
        cls(EXAMPLE, add_batch_size=2, max_length=16, **kw)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{where}: `min_length` is not taken here: it is Flashbax's name for a flat or item "
            "buffer's total, and trajectory buffers count per row. Pass "
            "`min_length_time_axis=` (steps per row) or `min_size=` (steps in total)."
        ),
    ):
        cls(EXAMPLE, add_batch_size=2, capacity=16, min_length=4, **kw)


def _every_constructor():
    """One call per public constructor, each taking keyword arguments to add."""
    partial = functools.partial
    calls = [
        (f"{cls.__name__}{'-nstep' if 'n_step' in kw else ''}",
         partial(cls, EXAMPLE, add_batch_size=2, capacity=16, **kw))
        for cls, kw, _ in KINDS
    ]  # fmt: skip
    queue = partial(eb.Queue, EXAMPLE, add_batch_size=2, capacity=16, sequence_length=2)
    calls.append(("Queue", queue))
    for cls in (eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer):
        clustered = partial(cls, EXAMPLE, add_batch_size=2, num_clusters=2, cluster_capacity=4,
                            cluster_fn=lambda step: step["done"].astype(jnp.int32))  # fmt: skip
        calls.append((cls.__name__, clustered))
    source = eb.TransitionBuffer(EXAMPLE, add_batch_size=2, capacity=16)
    calls.append(("Mixer", partial(eb.Mixer, [source, source], [0.5, 0.5])))
    limited = partial(eb.RateLimited, source, samples_per_insert=1.0, tolerance=2.0)
    calls.append(("RateLimited", limited))
    return calls


CONSTRUCTORS = _every_constructor()
# Flashbax's factory arguments equibuffer has no argument for, and the spelling the error names.
FLASHBAX_ONLY = {
    "sample_batch_size": (4, "pass the batch size to each call instead: `buffer.sample(key, "),
    "sample_sequence_length": (3, "pass `sequence_length=`"),
    "add_sequences": (True, "drop it: `add` takes one step `(add_batch_size, *leaf)` or `T` "),
    "add_batches": (True, "drop it: every `add` has the leading `add_batch_size` axis"),
    "priority_exponent": (0.6, "pass `alpha=`"),
    "device": ("gpu", "drop it: one sum tree runs on every platform"),
}


@pytest.mark.parametrize("name", sorted(FLASHBAX_ONLY))
@pytest.mark.parametrize("make", [c[1] for c in CONSTRUCTORS], ids=[c[0] for c in CONSTRUCTORS])
def test_flashbax_only_arguments_name_what_to_pass(make, name):
    cls = make.func
    make()  # the call is valid without the Flashbax argument
    if name in ("add_batches", "add_sequences") and cls in (
        eb.ItemBuffer,
        eb.PrioritisedItemBuffer,
    ):
        return  # (taken there, as Flashbax's item buffer takes them: tests/test_item_adds.py)
    value, hint = FLASHBAX_ONLY[name]
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{cls.__name__}(): `{name}` is a Flashbax factory argument that equibuffer does not "
            f"take: {hint}"
        ),
    ):
        make(**{name: value})


def test_flashbax_only_check_keeps_signatures_and_real_typos():
    """The check changes neither the signature a user (or an IDE) reads nor Python's error for
    a keyword that is no one's."""
    import inspect

    params = inspect.signature(eb.TrajectoryBuffer).parameters
    assert "sequence_length" in params and "sample_batch_size" not in params
    with pytest.raises(TypeError, match="unexpected keyword argument 'perod'"):
        eb.TrajectoryBuffer(EXAMPLE, add_batch_size=2, capacity=16, sequence_length=2, perod=2)  # pyright: ignore[reportCallIssue]


def test_queue_sizes():
    queue = eb.Queue(EXAMPLE, add_batch_size=3, capacity=10, sequence_length=2)
    assert queue.max_length_time_axis == 4 and queue.capacity == 12
    assert (
        eb.Queue(EXAMPLE, add_batch_size=3, max_length_time_axis=4, sequence_length=2).capacity
        == 12
    )
    with pytest.raises(TypeError, match=r"`max_length` is not taken here.*`max_length_time_axis=`"):
        eb.Queue(EXAMPLE, add_batch_size=3, max_length=4, sequence_length=2)
    for name in ("min_size", "min_length", "min_length_time_axis"):
        with pytest.raises(TypeError, match=f"Queue\\(\\): `{name}` is not taken: a queue has no"):
            eb.Queue(EXAMPLE, add_batch_size=3, capacity=12, sequence_length=2, **{name: 2})


@pytest.mark.parametrize("make,extra,flat", KINDS, ids=lambda k: getattr(k, "__name__", ""))
def test_sizes_are_one_keyword_dict(make, extra, flat):
    """Every buffer takes its sizes as `**sizes` (`eb.Sizes`): a dict of them is splatted into
    any kind, and a keyword that is neither a size nor the constructor's own is refused with
    the list of sizes."""
    sizes: eb.Sizes = {"capacity": 12, "min_size": 12}
    buffer = make(EXAMPLE, add_batch_size=3, **extra, **sizes)
    assert buffer.capacity == 12 and buffer.max_length_time_axis == 4
    assert buffer.min_length_time_axis == 4
    listed = "takes the sizes capacity, max_size, max_length, max_length_time_axis, min_size"
    with pytest.raises(TypeError, match=f"unexpected keyword argument 'capacty'.*{listed}"):
        make(EXAMPLE, add_batch_size=3, **extra, capacty=12)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(capacity=12, max_length_time_axis=4), "give only one of"),
        (dict(capacity=12, max_size=12), "give only one of"),
        (dict(min_size=4, min_length_time_axis=2), "give only one of"),
        (dict(min_size=4, min_length=4), "give only one of"),
        (dict(min_size=13), "min_size=13 is more than the buffer holds (12 steps: 3 rows of 4)"),
        (dict(min_length=13), "min_length=13 is more than the buffer holds (12 steps"),
        (dict(min_size=0), "`min_size` must be at least 1, got 0"),
    ],
)
def test_bad_sizes(kw, message):
    kw = {"capacity": 12, **kw} if "max_length_time_axis" not in kw and "max_size" not in kw else kw
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        eb.TransitionBuffer(EXAMPLE, add_batch_size=3, **kw)


def test_flashbax_flat_quickstart_sizes():
    """Flashbax's flat-buffer quickstart sizes (max_length=32, min_length=8, add_batch_size=6)
    are accepted with Flashbax's meaning: totals. It samples once 8 steps in all are held."""
    example = {"obs": jnp.zeros(()), "reward": jnp.float32(0)}
    buffer = eb.TransitionBuffer(example, add_batch_size=6, max_length=32, min_length=8)
    assert buffer.capacity >= 32 and buffer.min_size >= 8
    batch = {"obs": jnp.zeros(6), "reward": jnp.zeros(6)}
    assert not buffer.can_sample()
    buffer = buffer.add(batch)
    assert not buffer.can_sample()  # 6 steps held, one per row: no transition yet
    buffer = buffer.add(batch)
    assert buffer.can_sample() and int(buffer.size()) == 12
    sample = buffer.sample(jax.random.key(0), batch_size=4)
    assert sample.experience.first["obs"].shape == (4,)


def test_not_ready_message_names_only_what_the_user_set():
    item = eb.ItemBuffer(EXAMPLE, add_batch_size=2, capacity=8, min_size=4)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "ItemBuffer.sample(): the buffer cannot be sampled yet: it needs at least 2 items "
            "per row. Check `buffer.can_sample()` first."
        ),
    ):
        item.add({k: v[None].repeat(2, 0) for k, v in EXAMPLE.items()}).sample(
            jax.random.key(0), batch_size=1
        )


@pytest.mark.parametrize("cls,kw,flat", KINDS, ids=IDS)
def test_steps_added_outside_and_inside_jit(cls, kw, flat):
    buffer = cls(EXAMPLE, add_batch_size=2, max_length_time_axis=4, **kw)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    count = eqx.filter_jit(lambda b: b.steps_added())
    batch = jax.tree.map(lambda x: jnp.zeros((2, 3, *x.shape), x.dtype), EXAMPLE)
    total = 0
    for _ in range(3):
        buffer = add(buffer, batch)
        total += 3
        assert int(buffer.steps_added()) == total == int(count(buffer))
        assert buffer.steps_added().dtype == jnp.uint32
    assert buffer.storage.steps_added() == total


def test_steps_added_beyond_uint32():
    buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=2)
    storage = buffer.storage.with_counters(steps_added=2**32)
    buffer = eqx.tree_at(lambda b: b.storage, buffer, storage)
    assert buffer.storage.steps_added() == 2**32
    with pytest.raises(Exception, match="2\\*\\*32 or more, more than a uint32 holds"):
        eqx.filter_jit(lambda b: b.steps_added())(buffer)


def test_steps_added_x64():
    with jax.enable_x64(True):
        buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=2)
        storage = buffer.storage.with_counters(steps_added=3 * 2**32)
        buffer = eqx.tree_at(lambda b: b.storage, buffer, storage).add({"x": jnp.zeros((1, 5))})
        got = eqx.filter_jit(lambda b: b.steps_added())(buffer)
        assert got.dtype == jnp.uint64 and int(got) == 3 * 2**32 + 5


def test_queue_can_add():
    example = {"x": jnp.zeros(())}
    queue = eb.Queue(example, add_batch_size=2, capacity=8, sequence_length=2)
    with pytest.raises(TypeError, match=re.escape("Queue.can_add(): say how many steps per row")):
        queue.can_add()
    assert bool(queue.can_add(4)) and not bool(queue.can_add(5))
    fixed = eb.Queue(
        example, add_batch_size=2, capacity=8, sequence_length=2, add_sequence_length=3
    )
    assert bool(fixed.can_add())
    fixed = fixed.add({"x": jnp.zeros((2, 3))})
    assert not bool(fixed.can_add()) and bool(fixed.can_add(1))
    assert int(fixed.steps_added()) == 3
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Queue.add(): the batch holds 2 steps per row but the queue was built with "
            "add_sequence_length=3."
        ),
    ):
        fixed.add({"x": jnp.zeros((2, 2))})
    with pytest.raises(ValueError, match="add_sequence_length=5 is larger than the queue"):
        eb.Queue(example, add_batch_size=2, capacity=8, sequence_length=2, add_sequence_length=5)


def test_sizes_in_numpy_reference_terms():
    """A total size is the smallest whole number of rows holding it (NumPy reference)."""
    for rows in range(1, 9):
        for total in range(1, 40):
            buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=rows, capacity=total)
            assert buffer.capacity == int(np.ceil(total / rows)) * rows >= total
            assert buffer.capacity - total < rows
