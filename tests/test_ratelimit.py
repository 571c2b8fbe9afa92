"""RateLimited: the sample-to-insert rate limiter against a pure-Python reference, its ratio over
a long run, jit/donation/vmap use, prioritised buffers and every error message."""

from fractions import Fraction

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import equibuffer as eb
from equibuffer._ratelimit import RateLimited

from .helpers import count_sequence, stateful_settings


EXAMPLE = {"x": jnp.float32(0)}


def _steps(rows: int, t: int | None, value: float = 0.0) -> dict:
    shape = (rows,) if t is None else (rows, t)
    return {"x": jnp.full(shape, value, jnp.float32)}


# --- The pure-Python reference -------------------------------------------------------------


class Reference:
    """The counters of the rate limiter as documented, in exact rational arithmetic, with the
    wrapped buffer's `can_sample()` recomputed from its configuration."""

    def __init__(self, spi, tol, rows, length, sequence_length, period, min_length):
        self.spi, self.tol = Fraction(spi), Fraction(tol)
        self.rows, self.length = rows, length
        self.sequence_length, self.period, self.min_length_time_axis = (
            sequence_length,
            period,
            min_length,
        )
        self.total = 0  # steps added per row
        self.credit = Fraction(0)

    def ready(self) -> bool:
        fill = min(self.total, self.length)
        if fill < self.min_length_time_axis:
            return False
        starts = range(self.total - fill, self.total - self.sequence_length + 1)
        return any(s % self.period == 0 for s in starts)

    def can_add(self, t: int) -> bool:
        return not self.ready() or self.credit + self.spi * self.rows * t <= self.tol

    def can_sample(self, b: int) -> bool:
        return self.ready() and self.credit - b >= -self.tol

    def add(self, t: int) -> None:
        self.total += t
        if self.ready():  # counted iff the buffer can be sampled after the add
            self.credit += self.spi * self.rows * t

    def sample(self, b: int) -> None:
        self.credit -= b


def _above_2(item):
    # One function object for every buffer built: `cluster_fn` is static, so a new lambda
    # per example would compile `_apply` again for every example.
    return (item["x"] > 2).astype(jnp.int32)


# (name, constructor, reference layout (rows, length, sequence_length, period, min_length)).
# The last one can be sampled only when its count of steps is odd (max_length 3, windows of 3
# starting at even steps), so the buffer's `can_sample()` turns false again after warm-up.
CONFIGS = {
    "item": (
        lambda: eb.ItemBuffer(
            EXAMPLE, add_batch_size=2, max_length_time_axis=4, min_length_time_axis=2
        ),
        (2, 4, 1, 1, 2),
    ),
    "trajectory": (
        lambda: eb.TrajectoryBuffer(
            EXAMPLE,
            add_batch_size=3,
            max_length_time_axis=6,
            sequence_length=2,
            min_length_time_axis=3,
        ),
        (3, 6, 2, 1, 3),
    ),
    "toggling": (
        lambda: eb.TrajectoryBuffer(
            EXAMPLE, add_batch_size=1, max_length_time_axis=3, sequence_length=3, period=2
        ),
        (1, 3, 3, 2, 3),
    ),
    # Items routed to two clusters by value (the ops add values 0, 1, 2, ...); it can be
    # sampled once anything was added (the reference's layout for that: windows of 1 from the
    # first step on).
    "clustered": (
        lambda: eb.ClusteredBuffer(
            EXAMPLE,
            add_batch_size=2,
            num_clusters=2,
            cluster_capacity=4,
            cluster_fn=_above_2,
        ),
        (2, 4, 1, 1, 1),
    ),
}
ADD_STEPS = (1, 2, 3)
BATCHES = (1, 2, 4)


@eb.filter_jit
def _apply(limited, op, i):
    """Op `op` (an add of `ADD_STEPS[op]` steps, then a sample of `BATCHES[op - 3]` windows,
    or nothing for the last index) as one `lax.switch`, so each configuration compiles once;
    then every predicate, the credit and the buffer's `can_sample()`."""
    rows = limited.buffer.add_batch_size
    value = i.astype(jnp.float32)

    def add(t):
        return lambda lim: lim.add(_steps(rows, None if t == 1 else t, value))

    def sample(b):
        return lambda lim: lim.sample(jax.random.fold_in(jax.random.key(0), i), b)[0]

    branches = [add(t) for t in ADD_STEPS] + [sample(b) for b in BATCHES] + [lambda lim: lim]
    limited = jax.lax.switch(op, branches, limited)
    adds = jnp.stack([limited.can_add(t) for t in ADD_STEPS])
    samples = jnp.stack([limited.can_sample(b) for b in BATCHES])
    return limited, adds, samples, limited.credit(), limited.buffer.can_sample()


# (config, samples_per_insert, margin above the smallest tolerance): `samples_per_insert` and
# `tolerance` are static, so each setup compiles once; every value is dyadic, so the reference's
# exact rationals and the limiter agree exactly. The last one sits at the deadlock boundary.
SETUPS = [
    ("item", 0.75, 0.25),
    ("trajectory", 0.25, 1.5),
    ("toggling", 3.0, 0.0),
    ("clustered", 1.5, 0.5),
]


@pytest.mark.stateful
@stateful_settings(max_examples=20)
@given(
    setup=st.sampled_from(SETUPS),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "sample"]), st.integers(0, 2)), min_size=1, max_size=20
    ),
)
def test_counters_match_reference(setup, ops):
    count_sequence("test_counters_match_reference")
    config, spi, extra = setup
    make, layout = CONFIGS[config]
    rows = layout[0]
    # The smallest tolerance that the largest batch and add allow, plus a dyadic margin.
    tol = (max(BATCHES) + spi * rows * max(ADD_STEPS)) / 2 + extra
    limited = RateLimited(make(), samples_per_insert=spi, tolerance=tol)
    ref = Reference(spi, tol, *layout)
    nothing = len(ADD_STEPS) + len(BATCHES)
    for i, (op, which) in enumerate([("start", 0), *ops]):
        # The ops ignore the predicates on purpose (they advise, never refuse), except that
        # a buffer that cannot be sampled is not.
        if op == "add":
            code = which
            ref.add(ADD_STEPS[which])
        elif op == "sample" and ref.ready():
            code = len(ADD_STEPS) + which
            ref.sample(BATCHES[which])
        else:
            code = nothing
        limited, adds, samples, credit, ready = _apply(limited, jnp.int32(code), jnp.int32(i))
        assert bool(ready) == ref.ready()
        assert adds.tolist() == [ref.can_add(t) for t in ADD_STEPS]
        assert samples.tolist() == [ref.can_sample(b) for b in BATCHES]
        assert Fraction(float(credit)) == ref.credit  # exact: every value is dyadic


@eb.filter_jit
def _flags(limited):
    """`can_add(1), can_add(2)`, `can_sample(1..4)` and the credit, in one compiled call."""
    adds = [limited.can_add(t) for t in (1, 2)]
    samples = [limited.can_sample(b) for b in (1, 2, 3, 4)]
    return jnp.stack(adds), jnp.stack(samples), limited.credit()


def _flag_lists(limited):
    adds, samples, credit = _flags(limited)
    return adds.tolist(), samples.tolist(), float(credit)


def test_warm_up_rule():
    """Adds before the buffer can be sampled are not counted (and are always allowed); the add
    that makes it sampleable counts all its steps."""
    buffer = eb.ItemBuffer(
        EXAMPLE, add_batch_size=2, max_length_time_axis=8, min_length_time_axis=3
    )
    limited = RateLimited(buffer, samples_per_insert=1.0, tolerance=3.0)
    add = eb.filter_jit(lambda lim, b: lim.add(b))
    sample = eb.filter_jit(lambda lim, k: lim.sample(k, 3)[0])
    for _ in range(2):
        assert _flag_lists(limited)[:2] == ([True, True], [False] * 4)
        assert _flag_lists(limited)[2] == 0.0
        limited = add(limited, _steps(2, None))
    assert _flag_lists(limited)[:2] == ([True, True], [False] * 4)
    assert _flag_lists(limited)[2] == 0.0
    limited = add(limited, _steps(2, 2))  # fill 2 -> 4 >= min_length: counts 1 * 2 * 2
    adds, samples, credit = _flag_lists(limited)
    assert credit == 4.0 and adds == [False, False] and samples == [True] * 4  # 4 + 2 > 3
    limited = sample(limited, jax.random.key(0))
    adds, samples, credit = _flag_lists(limited)
    assert credit == 1.0 and adds == [True, False]  # 1 + 2 <= 3 < 1 + 4
    assert samples == [True] * 4  # 1 - 4 >= -3
    limited = sample(limited, jax.random.key(1))
    adds, samples, credit = _flag_lists(limited)
    assert credit == -2.0 and adds == [True, True]
    assert samples == [True, False, False, False]  # -3 >= -3 > -4


# --- A loop that follows the limiter achieves the ratio -------------------------------------


def _run(limited, batch_size, iterations):
    """Act when `can_add()`, learn when `can_sample(batch_size)`, in a jitted scan. Returns the
    limiter and per-iteration (added, counted, sampled) flags."""

    def body(limited, i):
        act = limited.can_add()
        limited = jax.lax.cond(
            act,
            lambda lim: lim.add(_steps(lim.buffer.add_batch_size, None)),
            lambda lim: lim,
            limited,
        )
        counted = act & limited.buffer.can_sample()
        learn = limited.can_sample(batch_size)
        limited = jax.lax.cond(
            learn,
            lambda lim: lim.sample(jax.random.fold_in(jax.random.key(0), i), batch_size)[0],
            lambda lim: lim,
            limited,
        )
        return limited, (act, counted, learn)

    return eb.filter_jit(lambda lim: jax.lax.scan(body, lim, jnp.arange(iterations)))(limited)


@pytest.mark.parametrize("spi", [0.25, 4.0, 0.1])
def test_following_the_limiter_achieves_the_ratio(spi):
    rows, batch_size = 4, 8
    buffer = eb.ItemBuffer(EXAMPLE, add_batch_size=rows, capacity=64, min_length_time_axis=4)
    tol = (batch_size + spi * rows) / 2 + 2.0
    limited = RateLimited(buffer, samples_per_insert=spi, tolerance=tol)
    limited, (act, counted, learn) = _run(limited, batch_size, 3000)
    act, counted, learn = np.asarray(act), np.asarray(counted), np.asarray(learn)
    assert (act | learn).all()  # never stuck
    inserted = rows * counted.sum()
    sampled = batch_size * learn.sum()
    assert sampled > 1000  # a long run
    # The credit stays within the documented band, so the ratio is within tolerance of spi.
    assert -tol <= spi * inserted - sampled <= tol
    assert abs(sampled / inserted - spi) <= tol / inserted
    # ... and the counter holds spi * inserted - sampled with no drift (exact when dyadic).
    exact = Fraction(spi) * int(inserted) - int(sampled)
    assert abs(Fraction(float(limited.credit())) - exact) <= (0 if spi in (0.25, 4.0) else 1e-3)
    # Every add before the warm-up ended was uncounted, none after it.
    first = int(np.argmax(counted))
    assert not counted[:first].any() and (counted[first:] == act[first:]).all()
    assert first == buffer.min_length_time_axis - 1


@pytest.mark.parametrize("cls", [eb.ClusteredBuffer, eb.PrioritisedClusteredBuffer])
def test_a_clustered_buffer_is_limited_like_any_buffer(cls):
    # Its items count as steps; it can be sampled (and adds count) from the first add on.
    rows, batch_size, spi = 2, 4, 1.5
    buffer = cls(
        EXAMPLE,
        add_batch_size=rows,
        num_clusters=2,
        cluster_capacity=8,
        cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32),
    )
    tol = (batch_size + spi * rows) / 2 + 0.5
    limited = RateLimited(buffer, samples_per_insert=spi, tolerance=tol)
    limited, (act, counted, learn) = _run(limited, batch_size, 400)
    act, counted, learn = np.asarray(act), np.asarray(counted), np.asarray(learn)
    assert (act | learn).all() and (counted == act).all()
    inserted, sampled = rows * int(act.sum()), batch_size * int(learn.sum())
    assert sampled > 200 and -tol <= spi * inserted - sampled <= tol
    assert Fraction(float(limited.credit())) == Fraction(spi) * inserted - sampled
    # `_run` adds zeros: every item went to cluster 0, which holds its newest 8.
    assert limited.buffer.cluster_sizes().tolist() == [8, 0]
    limited, sample = limited.sample(jax.random.key(0), batch_size)
    assert sample.experience["x"].shape == (4,) and (np.asarray(sample.cluster) == 0).all()
    if cls is eb.ClusteredBuffer:
        assert isinstance(sample, eb.ClusteredSample)
        with pytest.raises(TypeError, match="the wrapped ClusteredBuffer has no priorities"):
            limited.set_priorities(sample, jnp.ones(batch_size))
        return
    assert isinstance(sample, eb.PrioritisedClusteredSample)
    before = limited.credit()
    limited = limited.set_priorities(sample, jnp.full(batch_size, 4.0))
    assert float(limited.buffer.max_priority) == 4.0 and limited.credit() == before


# --- jit, donation, vmap ----------------------------------------------------------------------


def test_training_loop_under_donating_jit_traces_once():
    rows, batch_size = 2, 4
    buffer = eb.TransitionBuffer(
        {"obs": jnp.zeros(3), "t": jnp.int32(0)}, add_batch_size=rows, capacity=32
    )
    limited = RateLimited(buffer, samples_per_insert=2.0, tolerance=6.0)

    @eb.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(limited, key, t):
        batch = {"obs": jnp.full((rows, 3), t.astype(jnp.float32)), "t": jnp.full(rows, t)}
        limited = jax.lax.cond(
            limited.can_add(), lambda lim: lim.add(batch), lambda lim: lim, limited
        )

        def learn(lim):
            lim, sample = lim.sample(key, batch_size)
            return lim, jnp.max(sample.experience.second["t"])

        return jax.lax.cond(
            limited.can_sample(batch_size), learn, lambda lim: (lim, jnp.int32(-1)), limited
        )

    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), limited)
    newest = []
    for i in range(12):
        limited, got = step(limited, jax.random.key(i), jnp.int32(i))
        newest.append(int(got))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), limited) == shapes
    assert newest[0] == -1  # one step held: no transition yet
    assert all(n >= 1 for n in newest[1:] if n != -1) and newest.count(-1) < 12
    assert -6.0 <= float(limited.credit()) <= 6.0  # the band a loop following the limiter keeps


def test_vmapped_training_runs_with_cond_on_can_sample():
    """DESIGN's batched use: the predicates depend on counters only, so under `jax.vmap` over
    seeds `lax.cond(limited.can_sample(B), learn, skip)` stays a cond and the buffer's
    empty-sample error does not fire during warm-up."""
    rows, batch_size = 2, 3

    def train(seed):
        buffer = eb.TrajectoryBuffer(
            EXAMPLE,
            add_batch_size=rows,
            max_length_time_axis=16,
            sequence_length=3,
            min_length_time_axis=4,
        )
        limited = RateLimited(buffer, samples_per_insert=1.0, tolerance=3.0)

        def body(limited, t):
            key = jax.random.fold_in(jax.random.key(seed), t)
            obs = jax.random.normal(key, (rows,))
            act = limited.can_add()
            limited = jax.lax.cond(act, lambda lim: lim.add({"x": obs}), lambda lim: lim, limited)

            def learn(lim):
                lim, sample = lim.sample(key, batch_size)
                return lim, jnp.sum(sample.experience["x"])

            learn_now = limited.can_sample(batch_size)
            limited, loss = jax.lax.cond(
                learn_now, learn, lambda lim: (lim, jnp.float32(0)), limited
            )
            return limited, (act, learn_now, loss)

        return jax.lax.scan(body, limited, jnp.arange(12))

    limited, (act, learn, loss) = jax.jit(jax.vmap(train))(jnp.arange(3))
    act, learn, loss = np.asarray(act), np.asarray(learn), np.asarray(loss)
    assert act.shape == (3, 12)
    # The decisions depend on counters only: the same for every seed, while the data differ.
    assert (act == act[0]).all() and (learn == learn[0]).all()
    assert not learn[:, :3].any() and learn[0].sum() >= 3  # warm-up: min_length 4
    assert not np.allclose(loss[0][learn[0]], loss[1][learn[1]])
    np.testing.assert_array_equal(np.asarray(limited.credit_whole), limited.credit_whole[0])


# --- Prioritised buffers ------------------------------------------------------------------


def test_prioritised_buffer_forwards_beta_and_set_priorities():
    buffer = eb.PrioritisedTransitionBuffer(EXAMPLE, add_batch_size=2, capacity=16)
    limited = RateLimited(buffer, samples_per_insert=1.0, tolerance=8.0)
    limited = eb.filter_jit(lambda lim, b: lim.add(b))(limited, _steps(2, 4, 1.0))
    key = jax.random.key(3)

    @eb.filter_jit
    def both(limited, key, beta):
        new, sample = limited.sample(key, 6, beta=beta)
        return new, sample, limited.buffer.sample(key, 6, beta=beta)

    @eb.filter_jit
    def update(limited, sample, priorities):
        return limited.set_priorities(sample, priorities)

    _, _, direct = both(limited, key, jnp.float32(0.0))
    limited = update(limited, direct, jnp.arange(1.0, 7.0, dtype=jnp.float32))
    assert float(limited.buffer.max_priority) == 6.0
    before = float(limited.credit())
    for beta in (0.0, 0.7):
        new, sample, direct = both(limited, key, jnp.float32(beta))
        assert isinstance(sample, eb.AbstractPrioritisedSample)
        np.testing.assert_array_equal(sample.weights, direct.weights)
        np.testing.assert_array_equal(sample.indices, direct.indices)
        assert float(new.credit()) == before - 6
        assert np.allclose(sample.weights, 1.0) == (beta == 0.0)  # beta reached the buffer
    new, sample, _ = both(limited, key, jnp.float32(0.4))
    updated = update(new, sample, jnp.full(6, 9.0, jnp.float32))
    assert float(updated.buffer.max_priority) == 9.0
    assert float(updated.credit()) == float(new.credit())  # priorities do not move the credit


# --- Errors ---------------------------------------------------------------------------------


def _limited(spi=1.0, tol=4.0, rows=2):
    return RateLimited(eb.ItemBuffer(EXAMPLE, add_batch_size=rows, capacity=16), spi, tol)


def _typed(name: str) -> str:
    """The message for an argument of the wrong type: beartype's (on in the tests) refuses it
    before the constructor's own check would."""
    return f"`{name}` must be a Python float|parameter '{name}'"


def test_bad_configuration():
    queue = eb.Queue(EXAMPLE, add_batch_size=2, max_length_time_axis=4, sequence_length=2)
    # Beartype (on in the tests) refuses it first; without it the constructor does.
    with pytest.raises(TypeError, match="must be a replay buffer.*got Queue|parameter 'buffer'"):
        RateLimited(queue, 1.0, 4.0)  # pyright: ignore[reportArgumentType]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"`samples_per_insert` must be finite and > 0"):
            _limited(spi=bad)
    for bad in (True, "4", None):
        with pytest.raises(TypeError, match=_typed("samples_per_insert")):
            _limited(spi=bad)  # pyright: ignore[reportArgumentType]
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"`tolerance` must be finite and >= 0"):
            _limited(tol=bad)
    with pytest.raises(TypeError, match=f"{_typed('tolerance')}"):
        _limited(tol=jnp.float32(4.0))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`tolerance` must be at most 2\*\*28"):
        _limited(tol=2.0**29)
    with pytest.raises(
        ValueError, match=r"samples_per_insert \* add_batch_size \* steps = .*2\*\*28"
    ):
        _limited(spi=2.0**28, rows=2)
    assert _limited(tol=0.0).tolerance == 0.0  # a tolerance of 0 is valid with spi * rows = 2


def test_deadlock_is_refused_at_trace_time():
    limited = _limited(spi=4.0, tol=5.0, rows=2)  # one-step adds bring 8 windows of credit
    with pytest.raises(
        ValueError,
        match=r"can_sample\(\): tolerance=5\.0 can deadlock.*batch_size=4 and one-step adds"
        r".*4 \+ 4\.0 \* 2 \* 1.*at least 6\.0",
    ):
        limited.can_sample(4)
    assert limited.min_tolerance(4) == 6.0
    assert not bool(limited.can_sample(2))  # (2 + 8) / 2 = 5: allowed
    with pytest.raises(
        ValueError, match=r"can_add\(\): tolerance=5\.0 can deadlock.*steps=2.*at least 8\.5"
    ):
        limited.can_add(2)
    assert bool(limited.can_add(1))
    # The same refusal at trace time inside jit: a plain Python error, not a runtime one.
    with pytest.raises(ValueError, match="can deadlock"):
        eb.filter_jit(lambda lim: lim.can_sample(8))(limited)


def test_bad_arguments():
    limited = _limited()
    with pytest.raises(ValueError, match=r"can_sample\(\): `batch_size` must be at least 1"):
        limited.can_sample(0)
    with pytest.raises(
        TypeError, match=r"can_sample\(\): `batch_size` must be an int|parameter .batch_size."
    ):
        limited.can_sample(2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`batch_size` must be at most 2\*\*28"):
        limited.can_sample(2**28 + 1)
    with pytest.raises(ValueError, match=r"can_add\(\): `steps` must be at least 1"):
        limited.can_add(0)
    with pytest.raises(ValueError, match=r"min_tolerance\(\): `steps` must be at least 1"):
        limited.min_tolerance(4, steps=0)
    with pytest.raises(ValueError, match=r"RateLimited\.add\(\): leaf \['x'\] has shape \(3,\)"):
        limited.add(_steps(3, None))
    with pytest.raises(TypeError, match=r"RateLimited\.add\(\): leaf \['x'\] has dtype int32"):
        limited.add({"x": jnp.zeros(2, jnp.int32)})
    with pytest.raises(ValueError, match=r"RateLimited\.sample\(\): `batch_size` must be at least"):
        limited.sample(jax.random.key(0), 0)
    with pytest.raises(TypeError, match="the wrapped ItemBuffer has no priorities"):
        limited.set_priorities(
            eb.Sample(
                experience=None, indices=jnp.zeros(1, jnp.int32), steps=jnp.zeros(1, jnp.uint32)
            ),
            jnp.ones(1),
        )
    big = RateLimited(eb.ItemBuffer(EXAMPLE, add_batch_size=1, capacity=8), 2.0**27, 2.0**28)
    with pytest.raises(ValueError, match=r"134217728.0 \* 1 \* 3 = 402653184.0 is above 2\*\*28"):
        big.add(_steps(1, 3))


def test_sampling_an_empty_buffer_raises_the_buffers_error():
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot be sampled yet"):
        eb.filter_jit(lambda lim, k: lim.sample(k, 2))(_limited(), jax.random.key(0))


def test_a_loop_that_ignores_the_limiter_is_stopped_not_overflowed():
    # Adding without ever sampling: 2**28 windows of credit per add, past 2**30 on the 5th.
    limited = RateLimited(eb.ItemBuffer(EXAMPLE, add_batch_size=1, capacity=8), 2.0**28, 2.0**28)
    add = eb.filter_jit(lambda lim, b: lim.add(b))
    for _ in range(4):
        limited = add(limited, _steps(1, None))
    assert int(limited.credit_whole) == 2**30
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"credit passed 2\*\*30 windows.*can_add"):
        add(limited, _steps(1, None))
    # Sampling without adding, from a credit just above the bound.
    limited = _limited().add(_steps(2, None))
    limited = eqx.tree_at(lambda r: r.credit_whole, limited, jnp.array(-(2**30) + 3, jnp.int32))
    sample = eb.filter_jit(lambda lim, k: lim.sample(k, 3)[0])
    limited = sample(limited, jax.random.key(0))
    assert int(limited.credit_whole) == -(2**30)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"fell below -2\*\*30.*can_sample"):
        sample(limited, jax.random.key(1))
