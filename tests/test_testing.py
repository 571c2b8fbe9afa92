"""`equibuffer.testing`: its strategies draw what they say (every kind, sized by `capacity=`,
batches that fit), its reference model agrees with every buffer kind and catches a wrong
sample, and Hypothesis stays optional."""

import dataclasses
import pathlib
import subprocess
import sys
import tomllib

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, HealthCheck, Phase, settings
from hypothesis.vendor.pretty import pretty

import equibuffer as eb
from equibuffer.testing import (
    batches,
    buffer_configs,
    BufferConfig,
    BufferReference,
    buffers,
    EpisodeRule,
    examples,
    filled_buffers,
    flat_index,
    History,
    ItemView,
    leaves,
    n_step,
    NStepView,
    PairView,
    Priorities,
    QueueReference,
    UniformRule,
    window_of,
    WindowView,
)

from .helpers import budget, spread


ROOT = pathlib.Path(__file__).parent.parent
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
KINDS = [
    eb.TrajectoryBuffer,
    eb.TransitionBuffer,
    eb.ItemBuffer,
    eb.PrioritisedTrajectoryBuffer,
    eb.PrioritisedTransitionBuffer,
    eb.PrioritisedItemBuffer,
    eb.EpisodeTrajectoryBuffer,
    eb.PrioritisedEpisodeTrajectoryBuffer,
    eb.Queue,
]


# --- Hypothesis stays optional --------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_import_equibuffer_does_not_import_hypothesis():
    out = _run("import sys, equibuffer; print('hypothesis' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_testing_without_hypothesis_says_how_to_install():
    code = (
        "import sys\n"
        "sys.modules['hypothesis'] = None  # what an environment without it gives\n"
        "import equibuffer\n"
        "try:\n"
        "    import equibuffer.testing\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "pip install equibuffer[testing]" in out.stdout


def test_the_testing_extra_installs_hypothesis():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("hypothesis") for d in project["optional-dependencies"]["testing"])
    assert not any(d.startswith("hypothesis") for d in project["dependencies"])


# --- leaves and examples ----------------------------------------------------------------------


@settings(max_examples=budget(30), database=None)
@given(leaves(), leaves(shape=(2, 5), dtype=jnp.uint8), leaves(dtype=st.just(jnp.float16)))
def test_leaves_draw_zero_arrays_of_the_shape_and_dtype(anything, chosen, half):
    assert isinstance(anything, jax.Array) and anything.ndim <= 2
    assert all(1 <= d <= 3 for d in anything.shape) and not anything.any()
    assert chosen.shape == (2, 5) and chosen.dtype == jnp.uint8
    assert half.dtype == jnp.float16


@settings(max_examples=budget(40), database=None, deadline=None)
@given(examples(min_leaves=2, max_leaves=5))
def test_random_examples_build_a_buffer(example):
    assert isinstance(example, dict)
    assert 2 <= len(jax.tree.leaves(example)) <= 5
    buffer = eb.ItemBuffer(example, add_batch_size=2, capacity=4)
    spec = buffer.storage.example()
    assert jax.tree.structure(spec) == jax.tree.structure(example)
    for got, want in zip(jax.tree.leaves(spec), jax.tree.leaves(example), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_random_examples_are_sometimes_nested_and_never_when_told():
    nested = find(
        examples(min_leaves=3),
        lambda e: any(isinstance(v, dict | tuple) for v in e.values()),
        settings=settings(database=None, phases=[Phase.generate]),  # (found: not shrunk)
    )
    assert len(jax.tree.leaves(nested)) >= 3

    @settings(max_examples=budget(20), database=None)
    @given(examples(nested=False, max_leaves=3))
    def flat(example):
        assert all(isinstance(v, jax.Array) for v in example.values())
        assert 1 <= len(example) <= 3

    flat()


class Step(eqx.Module):
    obs: jax.Array
    action: jax.Array


@settings(max_examples=budget(20), database=None)
@given(
    examples({"obs": leaves(shape=(4,)), "done": jax.ShapeDtypeStruct((), jnp.bool_)}),
    examples(Step(obs=leaves(dtype=jnp.float32), action=jnp.int32(0))),  # pyright: ignore
    examples(extra={"reward": jnp.float32(0)}, dtype=jnp.int8),
)
def test_examples_keep_a_chosen_structure(chosen, module, extra):
    assert chosen["obs"].shape == (4,) and chosen["done"].dtype == jnp.bool_
    assert chosen["done"].shape == ()
    assert isinstance(module, Step) and module.obs.dtype == jnp.float32
    assert module.action.dtype == jnp.int32 and module.action.shape == ()
    assert extra["reward"].dtype == jnp.float32
    others = [v for k, v in extra.items() if k != "reward"]
    assert all(x.dtype == jnp.int8 for x in jax.tree.leaves(others))


def test_examples_refuse_what_is_not_a_leaf():
    with pytest.raises(ValueError, match="min_leaves <= max_leaves"):
        examples(min_leaves=3, max_leaves=2)

    @settings(max_examples=1, database=None)
    @given(examples({"obs": 0.0}))
    def python_float(example):
        pass

    with pytest.raises(TypeError, match=r"every leaf of `structure` must be an array"):
        python_float()


# --- buffer configurations --------------------------------------------------------------------


@pytest.mark.parametrize("kind", spread(KINDS), ids=lambda k: k.__name__)
def test_every_kind_is_drawn_and_builds(kind):
    config = find(
        buffer_configs(),
        lambda c: c.cls is kind,
        settings=settings(database=None, max_examples=2000, phases=[Phase.generate]),
    )
    buffer = config.build()
    assert type(buffer) is kind
    assert buffer.capacity >= config.kwargs["capacity"]


@settings(max_examples=budget(60), deadline=None, database=None)
@given(buffer_configs())
def test_configs_are_sized_by_capacity_only_and_build(config):
    assert isinstance(config, BufferConfig)
    kwargs = config.kwargs
    assert not {"max_length", "min_length", "max_size"} & set(kwargs)
    rows, capacity = kwargs["add_batch_size"], kwargs["capacity"]
    buffer = config.build()
    length = -(-capacity // rows)  # rounded up per row
    assert buffer.add_batch_size == rows and buffer.capacity == rows * length
    if isinstance(buffer, eb.AbstractBuffer):
        assert buffer.sequence_length <= length
    assert repr(config).startswith(f"{config.cls.__name__}(example=")


def test_the_options_reach_the_kinds_that_take_them():
    # (the first config drawn: each holds for any, shrinking to a smaller one proves nothing)
    quiet = settings(database=None, phases=[Phase.generate])
    nstep = find(
        buffer_configs(eb.PrioritisedTransitionBuffer, n_step=3, episodes=True, mode="pad"),
        lambda c: True,
        settings=quiet,
    )
    assert nstep.kwargs["n_step"] == 3 and nstep.kwargs["mode"] == "pad"
    buffer = nstep.build()
    assert buffer.sequence_length == 4 and buffer.capacity // buffer.add_batch_size >= 4
    pairs = find(
        buffer_configs(eb.TransitionBuffer, n_step=None, episodes=True), bool, settings=quiet
    )
    assert "n_step" not in pairs.kwargs and pairs.kwargs["episode_end"] == "done"
    assert pairs.example["done"].dtype == jnp.bool_
    fixed = find(
        buffer_configs(eb.TrajectoryBuffer, add_batch_size=4, capacity=10, sequence_length=3),
        bool,
        settings=quiet,
    )
    assert fixed.kwargs["capacity"] == 10 and fixed.build().capacity == 12


def test_configs_use_a_given_example_and_its_leaves():
    example = {"obs": jnp.zeros(2), "reward": jnp.float32(0), "terminated": jnp.bool_(False)}
    quiet = settings(database=None, max_examples=30, phases=[Phase.generate])

    @quiet
    @given(buffer_configs(example=example))
    def given_example(config):
        assert config.example is example  # episode kinds need a `done` leaf: left out
        assert config.cls not in (eb.EpisodeTrajectoryBuffer, eb.PrioritisedEpisodeTrajectoryBuffer)
        assert config.kwargs.get("truncated") is None  # no truncated leaf

    given_example()
    config = find(
        buffer_configs(eb.TransitionBuffer, example=example, n_step=2), bool, settings=quiet
    )
    assert config.kwargs["n_step"] == 2 and config.kwargs["truncated"] is None
    config.build()


def test_configs_refuse_what_the_example_cannot_serve():
    example = {"obs": jnp.zeros(2)}
    with pytest.raises(ValueError, match=r"episode-aware kinds need a 0-d bool leaf \['done'\]"):
        find(buffer_configs(eb.EpisodeTrajectoryBuffer, example=example), bool)
    with pytest.raises(ValueError, match="n-step transitions need 0-d leaves 'reward'"):
        find(buffer_configs(eb.TransitionBuffer, example=example, n_step=2), bool)
    with pytest.raises(ValueError, match="episode-aware transitions need a 0-d bool leaf"):
        find(buffer_configs(eb.TransitionBuffer, example=example, episodes=True), bool)
    with pytest.raises(ValueError, match="'Mixer' is not a buffer kind"):
        buffer_configs(eb.Mixer)


def test_buffer_config_repr_reads_like_the_call():
    config = BufferConfig(
        eb.EpisodeTrajectoryBuffer,
        {"x": jnp.zeros((2, 3), jnp.uint8), "done": jnp.bool_(False)},
        {"add_batch_size": 1, "capacity": 5, "sequence_length": 2, "episode_end": "done"},
    )
    assert repr(config) == (
        "EpisodeTrajectoryBuffer(example={'done': bool[], 'x': uint8[2, 3]}, add_batch_size=1, "
        "capacity=5, sequence_length=2, episode_end='done')"
    )
    assert isinstance(config.build(), eb.EpisodeTrajectoryBuffer)
    assert pretty(config) == repr(config)  # how Hypothesis reports a failing example


@settings(max_examples=budget(20), deadline=None, database=None)
@given(buffers([eb.PrioritisedItemBuffer, eb.Queue], add_batch_size=2))
def test_buffers_draw_built_empty_buffers(buffer):
    assert isinstance(buffer, eb.PrioritisedItemBuffer | eb.Queue)
    assert buffer.add_batch_size == 2 and int(buffer.size()) == 0


# --- batches ----------------------------------------------------------------------------------


@settings(SLOW, max_examples=budget(25))
@given(st.data())
def test_batches_fit_the_buffer(data):
    buffer = data.draw(buffers(), label="buffer")
    batch = data.draw(batches(buffer), label="batch")
    t = buffer.steps_in(batch)  # checks structure, rows, shapes and dtypes
    length = buffer.capacity // buffer.add_batch_size
    assert t is None or 1 <= t <= length + 2
    if isinstance(buffer, eb.Queue):
        assert bool(buffer.can_add(1 if t is None else t))
    buffer.add(batch)


def test_batches_for_a_queue_fit_its_room_and_refuse_a_full_one():
    queue = eb.Queue({"x": jnp.float32(0)}, add_batch_size=1, capacity=4, sequence_length=2)
    queue = queue.add({"x": jnp.zeros((1, 3))})

    @settings(max_examples=budget(20), database=None)
    @given(batches(queue))
    def room(batch):
        assert queue.steps_in(batch) in (None, 1)

    room()
    with pytest.raises(ValueError, match="the queue is full"):
        batches(queue.add({"x": jnp.zeros(1)}))


def test_batches_take_steps_and_elements():
    buffer = eb.TrajectoryBuffer(
        {"obs": jnp.zeros(2, jnp.float16), "n": jnp.int32(0), "b": jnp.bool_(False)},
        add_batch_size=3,
        capacity=12,
        sequence_length=2,
    )

    def elements(dtype):
        return st.just(np.ones((), dtype)[()])

    @settings(max_examples=budget(10), database=None)
    @given(batches(buffer, steps=5, elements=elements))
    def fixed(batch):
        assert batch["obs"].shape == (3, 5, 2) and batch["obs"].dtype == jnp.float16
        assert (batch["n"] == 1).all() and batch["b"].all()

    fixed()


@settings(max_examples=budget(30), database=None, deadline=None)
@given(
    batches(eb.ItemBuffer({"f": jnp.float32(0), "i": jnp.int8(0)}, add_batch_size=8, capacity=8))
)
def test_batch_values_are_finite_and_bounded(batch):
    assert bool(jnp.isfinite(batch["f"]).all()) and float(jnp.abs(batch["f"]).max()) <= 100
    assert batch["i"].dtype == jnp.int8 and int(jnp.abs(batch["i"].astype(jnp.int32)).max()) <= 100


# --- filled buffers against the reference: every kind -----------------------------------------


def _agrees(buffer, reference, key):
    """Every counter of `buffer` equals the reference's, and a sample (or the refusal) too."""
    if isinstance(buffer, eb.Queue):
        assert int(buffer.size()) == reference.size()
        assert bool(buffer.can_sample()) == reference.can_sample()
        assert bool(buffer.can_add(2)) == reference.can_add(2)
        if reference.can_sample():
            _, sample = buffer.sample()
            reference.check_sample(sample)
        return
    assert int(buffer.size()) == reference.size()
    assert bool(buffer.can_sample()) == reference.ready()
    assert int(buffer.num_windows()) == reference.num_windows()
    assert int(buffer.num_valid_windows()) == reference.num_valid_windows()
    refusal = reference.refusal()
    if refusal is None:
        reference.check_sample(_sample(buffer, key), beta=1.0)
    elif refusal != "too early":  # (an error raised inside jit)
        with pytest.raises(eqx.EquinoxRuntimeError):
            _sample(buffer, key)


@eb.filter_jit
def _sample(buffer, key):
    return buffer.sample(key, 16)


@settings(SLOW, max_examples=budget(50))
@given(filled_buffers(reference=True), st.integers(0, 2**31 - 1))
def test_filled_buffers_agree_with_their_reference(filled, seed):
    buffer, reference = filled
    _agrees(buffer, reference, jax.random.key(seed))


@settings(SLOW, max_examples=budget(10))
@given(filled_buffers(buffers(eb.ItemBuffer, add_batch_size=2), adds=3, steps=1))
def test_filled_buffers_take_adds_and_steps(buffer):
    assert isinstance(buffer, eb.ItemBuffer)
    assert int(buffer.size()) == min(3, buffer.capacity // 2) * 2


def test_filled_queues_stop_when_full():
    queue = eb.Queue({"x": jnp.int32(0)}, add_batch_size=1, capacity=3, sequence_length=1)

    @settings(SLOW, max_examples=budget(10))
    @given(filled_buffers(queue, adds=6, reference=True))
    def full(filled):
        queue, reference = filled
        assert int(queue.size()) == reference.size() == 3

    full()


# --- the reference model ----------------------------------------------------------------------


def test_flat_index_and_window_of_are_inverse():
    for window in [(0, 0), (1, 6), (2, 13)]:
        assert window_of(flat_index(window, 5), window[1], 5) == window
    assert window_of(jnp.int32(6), jnp.uint32(6), 4) == (1, 6)
    with pytest.raises(AssertionError, match="does not hold step 5"):
        window_of(6, 5, 4)


def test_history_holds_the_newest_steps_of_any_tree():
    history = History(rows=2, length=3)
    with pytest.raises(ValueError, match="nothing was added"):
        _ = history.steps
    steps = {"a": np.arange(8).reshape(2, 4), "b": (np.ones((2, 4, 2), np.float32),)}
    history.add(steps)
    history.add(jax.tree.map(lambda x: x[:, :1] + 100, steps))
    assert (history.total, history.fill, history.oldest) == (5, 3, 2)
    assert repr(history) == "History(rows=2, length=3, total=5)"
    assert history.held()["a"].tolist() == [[2, 3, 100], [6, 7, 104]]
    assert history.held()["b"][0].shape == (2, 3, 2)
    assert history.window(0, 3, 4)["a"].tolist() == [3, 100, 0, 0]
    assert history.at(1, 4)["b"][0].tolist() == [101.0, 101.0]
    with pytest.raises(ValueError, match="3 rows, expected 2"):
        history.add({"a": np.zeros((3, 1), int), "b": (np.zeros((3, 1, 2), np.float32),)})
    with pytest.raises(ValueError, match="structure"):
        history.add({"a": np.zeros((2, 1), int)})


def test_uniform_rule_counts_aligned_held_windows():
    history = History(rows=2, length=5)
    history.add({"x": np.zeros((2, 9))})  # steps 4-8 held
    assert UniformRule(2, period=3).valid(history) == {(r, t) for r in (0, 1) for t in (6,)}
    assert UniformRule(1).valid(history) == {(r, t) for r in (0, 1) for t in range(4, 9)}
    assert UniformRule(5).valid(history) == {(0, 4), (1, 4)}


@pytest.mark.parametrize("as_function", [False, True])
def test_episode_rule_by_name_or_function(as_function):
    history = History(rows=1, length=6)
    history.add({"d": np.array([[0, 0, 1, 0, 0, 0, 0, 1]], bool)})  # steps 2-7 held
    end = (lambda step: step["d"]) if as_function else "d"
    never = EpisodeRule(3, 1, "never_cross", end)
    assert never.valid(history) == {(0, 3), (0, 4), (0, 5)}
    pad = EpisodeRule(3, 2, "pad", end)
    assert pad.valid(history) == {(0, 2), (0, 4), (0, 6)}
    assert pad.mask(history, (0, 6)).tolist() == [True, True, False]
    assert never.mask(history, (0, 3)).all()
    history.add({"d": np.array([[True]])})  # the flags follow the history
    assert pad.ends(history).shape == (1, 9) and pad.ends(history)[0, -1]
    with pytest.raises((ValueError, TypeError), match="mode"):  # (beartype checks first)
        EpisodeRule(3, 1, "sometimes")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_n_step_agrees_with_n_step_transition(n):
    rng = np.random.default_rng(n)
    steps = {
        "reward": rng.normal(size=(1, 9)).astype(np.float32),
        "terminated": rng.random((1, 9)) < 0.2,
        "truncated": rng.random((1, 9)) < 0.2,
    }
    history = History(rows=1, length=9)
    history.add(steps)
    windows = np.stack([np.arange(t, t + n + 1) for t in range(9 - n)])  # (starts, n + 1)
    out = eb.n_step_transition(
        {k: jnp.asarray(v[0][windows]) for k, v in steps.items()}, n=n, discount=0.9
    )
    for t in range(9 - n):
        m, reward, bootstrap = n_step(history, (0, t), n, 0.9)
        assert m == int(out.steps[t])
        np.testing.assert_allclose(reward, float(out.reward[t]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bootstrap, float(out.discount[t]), rtol=1e-6)


def test_views_give_one_window_of_a_sample():
    history = History(rows=1, length=8)
    steps = {
        "x": np.arange(1, 6)[None],
        "reward": np.ones((1, 5), np.float32),
        "terminated": np.array([[False, True, False, False, False]]),
    }
    history.add(steps)
    cut = np.array([True, True, False])
    assert WindowView(3).experience(history, (0, 0), cut)["x"].tolist() == [1, 2, 0]
    assert ItemView().experience(history, (0, 4), np.ones(1, bool))["x"] == 5
    first, second = PairView().experience(history, (0, 1), np.array([True, False]))
    assert (first["x"], second["x"]) == (2, 0)
    view = NStepView(2, 0.5, truncated=None)
    out = view.experience(history, (0, 0), cut)
    assert (out["steps"], out["reward"], out["discount"]) == (2, 1.5, 0.0)
    assert out["last"]["x"] == 2 and out["second"]["x"] == 0  # past the end: zero
    assert (WindowView(3).length, ItemView().length, PairView().length, view.length) == (
        3,
        1,
        2,
        3,
    )


def test_priorities_follow_the_documented_rules():
    p = Priorities(alpha=0.5)
    p.refresh({(0, 0), (0, 1)})
    p.set([(0, 0), (0, 7)], np.array([4.0, 100.0]))  # (0, 7) is not valid: dropped
    assert p.max_priority == 4.0 and p.leaf((0, 0)) == 2.0 and p.leaf((0, 7)) == 0.0
    assert p.total() == 3.0 and p.probability((0, 1)) == pytest.approx(1 / 3)
    p.refresh({(0, 1), (0, 2)})  # (0, 0) forgotten, (0, 2) enters at 4
    assert p.priority == {(0, 1): 1.0, (0, 2): 4.0}
    p.set([(0, 1)], np.zeros(1))
    assert p.leaf((0, 1)) == 0.0  # a priority of 0 is never drawn, at any alpha


def test_check_sample_catches_a_wrong_sample():
    buffer = eb.PrioritisedTrajectoryBuffer(
        {"x": jnp.int32(0)}, add_batch_size=2, capacity=12, sequence_length=2, alpha=1.0
    )
    reference = BufferReference.from_buffer(buffer)
    batch = {"x": jnp.arange(14, dtype=jnp.int32).reshape(2, 7)}
    buffer, _ = buffer.add(batch), reference.add(batch)
    sample = buffer.sample(jax.random.key(0), 8)
    reference.check_sample(sample)
    reference.set_priorities(sample, jnp.arange(1.0, 9.0))
    buffer = buffer.set_priorities(sample, jnp.arange(1.0, 9.0))
    reference.check_sample(buffer.sample(jax.random.key(1), 8), beta=1.0)
    bad = dataclasses.replace(sample, experience={"x": sample.experience["x"] + 1})
    with pytest.raises(AssertionError, match=r"experience\['x'\]"):
        reference.check_sample(bad)
    stale = dataclasses.replace(sample, steps=sample.steps.at[0].set(0))  # slot 0 holds step 6
    with pytest.raises(AssertionError, match="does not hold step 0"):
        reference.check_sample(stale)
    wrong_weights = buffer.sample(jax.random.key(2), 8, beta=0.0)
    with pytest.raises(AssertionError, match="weights"):
        reference.check_sample(wrong_weights, beta=1.0)


def test_reference_mirrors_set_priorities_by_indices():
    buffer = eb.PrioritisedItemBuffer({"x": jnp.int32(0)}, add_batch_size=1, capacity=4)
    reference = BufferReference.from_buffer(buffer)
    batch = {"x": jnp.arange(4, dtype=jnp.int32)[None]}
    buffer, _ = buffer.add(batch), reference.add(batch)
    indices, steps = jnp.arange(4), jnp.arange(4, dtype=jnp.uint32)
    priorities = jnp.array([0.0, 0.0, 1.0, 0.0])
    buffer = buffer.set_priorities(indices, priorities, steps=steps)
    reference.set_priorities(indices, priorities, steps=steps)
    assert reference.valid() == {(0, t) for t in range(4)}
    assert reference.priorities is not None and reference.priorities.probability((0, 2)) == 1.0
    reference.check_sample(buffer.sample(jax.random.key(0), 8))
    with pytest.raises(TypeError, match="has no `alpha`"):
        BufferReference(1, 4, UniformRule(1), view=ItemView()).set_priorities(indices, priorities)


def test_reference_refusals_match_the_buffer_errors():
    example = {"done": jnp.bool_(False)}
    buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
        example, add_batch_size=1, capacity=6, sequence_length=3
    )
    reference = BufferReference.from_buffer(buffer)
    assert repr(reference) == (
        "BufferReference(rows=1, length=6, rule=EpisodeRule(sequence_length=3, period=1, "
        "mode='never_cross', episode_end='done'), view=WindowView(sequence_length=3), "
        "min_steps_per_row=3, alpha=0.6; 0 steps added)"
    )
    assert reference.refusal() == "too early"
    batch = {"done": jnp.array([[True, True, True]])}
    buffer, _ = buffer.add(batch), reference.add(batch)
    assert reference.refusal() == "no window"
    with pytest.raises(eqx.EquinoxRuntimeError, match="no window of sequence_length=3"):
        _sample(buffer, jax.random.key(0))
    batch = {"done": jnp.zeros((1, 3), bool)}
    buffer, _ = buffer.add(batch), reference.add(batch)
    assert reference.refusal() is None
    sample = _sample(buffer, jax.random.key(0))
    buffer = buffer.set_priorities(sample, jnp.zeros(16))
    reference.set_priorities(sample, jnp.zeros(16))
    assert reference.refusal() == "all zero"
    with pytest.raises(eqx.EquinoxRuntimeError, match="every valid window has priority 0"):
        _sample(buffer, jax.random.key(1))


def test_reference_from_buffer_refuses_a_used_or_foreign_buffer():
    buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=2)
    with pytest.raises(ValueError, match="already holds steps"):
        BufferReference.from_buffer(buffer.add({"x": jnp.zeros(1)}))
    queue = eb.Queue({"x": jnp.zeros(())}, add_batch_size=1, capacity=2, sequence_length=1)
    with pytest.raises(TypeError, match="use QueueReference.from_buffer for a Queue"):
        BufferReference.from_buffer(queue)
    with pytest.raises(TypeError, match="expected a Queue, got ItemBuffer"):
        QueueReference.from_buffer(buffer)
    with pytest.raises(ValueError, match="already holds steps"):
        QueueReference.from_buffer(queue.add({"x": jnp.zeros(1)}))
    with pytest.raises(ValueError, match="the view spans 2 steps"):
        BufferReference(1, 4, UniformRule(3), view=PairView())


def test_queue_reference_follows_a_queue_across_the_ring_end():
    queue = eb.Queue({"x": jnp.int32(0)}, add_batch_size=2, capacity=6, sequence_length=2)
    reference = QueueReference.from_buffer(queue)
    assert repr(reference) == (
        "QueueReference(rows=2, length=3, sequence_length=2; 0 steps added, 0 unread)"
    )
    for t in (None, 2, None, 1, 2, 2):
        assert bool(queue.can_add(1 if t is None else t)) == reference.can_add(
            1 if t is None else t
        )
        n = 1 if t is None else t
        x = jnp.arange(2 * n, dtype=jnp.int32).reshape(2, n) + 10 * reference.history.total
        batch = {"x": x[:, 0] if t is None else x}
        queue, _ = queue.add(batch), reference.add(batch)
        assert int(queue.size()) == reference.size()
        if reference.can_sample():
            queue, sample = queue.sample()
            reference.check_sample(sample)
    batch = {"x": jnp.zeros((2, 2), jnp.int32)}
    while not reference.can_sample():
        queue, _ = queue.add(batch), reference.add(batch)
    queue, sample = queue.sample()
    reference.check_sample(sample)
    with pytest.raises(AssertionError):  # the same steps again: they were read
        reference.check_sample(sample)
