"""The pieces of the NumPy reference model (see `_reference.py`): `History` (every step ever
added to a ring, by absolute step), the rules (`UniformRule`, `EpisodeRule`), the views
(`WindowView`, `PairView`, `ItemView`, `NStepView`, with `n_step`) and `Priorities`; and
`flat_index` / `window_of`, the one place that knows how `Sample.indices` and `Sample.steps`
name a window."""

import dataclasses
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence, Set as AbstractSet
from typing import Any, Literal, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Bool, Float, Integer, PyTree, Shaped

from .. import rules, views
from ..rules._base import ByTheCounters


_Window = tuple[int, int]  # (row, absolute start step)
# A tree of the steps a model holds. Checked by pyright; at run time (where the tests' import
# hook checks every annotation) it is `Any`: the accessors returning it run for every window
# of every sample the models check, and a check of the whole tree cost them more than the
# work (half of a stateful session's time).
if TYPE_CHECKING:
    _Tree = PyTree[Shaped[np.ndarray, "..."]]
else:
    _Tree = Any


def flat_index(window: tuple[int, int], length: int) -> int:
    """The `Sample.indices` entry of a window: `row * length + slot`, the ring slot of its
    first step (`length` steps per row).

    !!! example

        ```python
        from equibuffer.testing import flat_index

        # row 1 of a ring of 4 steps per row: absolute step 6 sits in slot 6 % 4 = 2
        assert flat_index((1, 6), length=4) == 1 * 4 + 2
        ```
    """
    row, start = window
    return row * length + start % length


def window_of(
    index: Integer[ArrayLike, ""], step: Integer[ArrayLike, ""], length: int
) -> tuple[int, int]:
    """The window `(row, absolute start)` that a sample names by `sample.indices[i]` and
    `sample.steps[i]`, in a ring of `length` steps per row. Raises `AssertionError` when the two
    disagree (the index's slot does not hold that step).

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import equibuffer as eb
        from equibuffer.testing import window_of

        buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=2, capacity=8)
        buffer = buffer.add({"x": jnp.zeros((2, 6))})  # 6 steps per row: steps 2-5 held
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        for index, step in zip(sample.indices, sample.steps):
            row, start = window_of(index, step, length=4)
            assert row in (0, 1) and 2 <= start <= 5
        ```
    """
    row, slot = divmod(int(np.asarray(index)), length)
    start = int(np.asarray(step))
    assert slot == start % length, (
        f"index {row * length + slot} (slot {slot}) does not hold step {start}"
    )
    return row, start


def _named(tree: Any, name: str) -> Any:
    """The leaf `name` of a step: a key of a mapping, or an attribute."""
    return tree[name] if isinstance(tree, Mapping) else getattr(tree, name)


class History:
    """Every step ever added to a ring of `rows` rows holding the newest `length` steps of
    each row, by absolute step: the model of what a buffer's storage holds.

    Steps are any pytree (the buffer's example structure); `add` takes leaves
    `(rows, T, *leaf)`. Nothing is ever dropped: `steps` keeps every step added, and `held()`
    gives the newest `length` of each row, what the ring holds.

    **Arguments:**

    - `rows`: the number of rows (`add_batch_size`).
    - `length`: the steps held per row (`capacity // add_batch_size`).

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History

        history = History(rows=2, length=3)
        history.add({"x": np.arange(10).reshape(2, 5)})  # 5 steps per row
        assert history.total == 5 and history.fill == 3 and history.oldest == 2
        assert history.held()["x"].tolist() == [[2, 3, 4], [7, 8, 9]]
        assert history.window(1, 3, 3)["x"].tolist() == [8, 9, 0]  # zero past the last step
        assert history.at(0, 1)["x"] == 1
        ```
    """

    def __init__(self, rows: int, length: int):
        if rows < 1 or length < 1:
            raise ValueError(f"History(): rows and length must be positive, got {rows}, {length}.")
        self.rows, self.length = rows, length
        self.total = 0
        self._leaves: list[np.ndarray] = []
        self._treedef: Any = None

    def __repr__(self) -> str:
        return f"History(rows={self.rows}, length={self.length}, total={self.total})"

    @property
    def fill(self) -> int:
        """Steps held per row: `min(total, length)`."""
        return min(self.total, self.length)

    @property
    def oldest(self) -> int:
        """The absolute step of the oldest step held."""
        return self.total - self.fill

    @property
    def steps(self) -> _Tree:
        """Every step added, a tree of leaves `(rows, total, *leaf)`."""
        if self._treedef is None:
            raise ValueError("History.steps: nothing was added yet.")
        return jax.tree_util.tree_unflatten(self._treedef, self._leaves)

    def add(self, steps: PyTree[Shaped[ArrayLike, "rows time ..."]]) -> None:
        """Append `T` steps to every row: a tree of leaves `(rows, T, *leaf)` (NumPy or JAX
        arrays), of the same structure at every call."""
        leaves, treedef = jax.tree_util.tree_flatten(steps)
        leaves = [np.asarray(x) for x in leaves]
        if not leaves:
            raise ValueError("History.add(): the steps have no leaves.")
        if self._treedef is not None and treedef != self._treedef:
            raise ValueError(
                f"History.add(): the steps have structure {treedef}, expected {self._treedef}."
            )
        sizes = {x.shape[:2] for x in leaves if x.ndim >= 2}
        if len(sizes) != 1 or any(x.ndim < 2 for x in leaves):
            raise ValueError(
                "History.add(): every leaf must be (rows, T, *leaf) with the same rows and T, "
                f"got shapes {[x.shape for x in leaves]}."
            )
        ((rows, t),) = sizes
        if rows != self.rows:
            raise ValueError(f"History.add(): {rows} rows, expected {self.rows}.")
        if self._treedef is None:
            self._treedef = treedef
            self._leaves = [x[:, :0] for x in leaves]
        self._leaves = [
            np.concatenate([old, x], axis=1) for old, x in zip(self._leaves, leaves, strict=True)
        ]
        self.total += t

    def held(self) -> _Tree:
        """What the ring holds: the newest `length` steps of each row in time order, leaves
        `(rows, fill, *leaf)`."""
        return jax.tree.map(lambda x: x[:, self.oldest :], self.steps)

    def window(self, row: int, start: int, n: int) -> _Tree:
        """Steps `start .. start + n - 1` of `row`, leaves `(n, *leaf)`; zero past the last step
        added."""

        def take(x: np.ndarray) -> np.ndarray:
            values = x[row, start : start + n]
            pad = [(0, n - values.shape[0])] + [(0, 0)] * (values.ndim - 1)
            return np.pad(values, pad)

        return jax.tree.map(take, self.steps)

    def at(self, row: int, step: int) -> _Tree:
        """Step `step` of `row`, leaves `(*leaf)`."""
        return jax.tree.map(lambda x: x[row, step, ...], self.steps)


def _aligned_starts(history: History, sequence_length: int, period: int) -> list:
    """Starts of the windows the counters allow, the same in every row: held, complete, at a
    multiple of `period`."""
    last = history.total - sequence_length
    return [t for t in range(history.oldest, last + 1) if t % period == 0]


@dataclasses.dataclass(frozen=True)
class UniformRule:
    """Which windows the uniform and prioritised buffers may sample: every window of
    `sequence_length` steps that the ring holds whole, in one row, starting at an absolute step
    that is a multiple of `period`.

    **Arguments:**

    - `sequence_length`: the steps of one window (the buffer's `sequence_length`: 2 for
        transitions, `n_step + 1` for n-step transitions, 1 for items).
    - `period`: windows start at multiples of it.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, UniformRule

        history = History(rows=1, length=6)
        history.add({"x": np.zeros((1, 8))})  # steps 2-7 held
        rule = UniformRule(sequence_length=3, period=2)
        assert rule.valid(history) == {(0, 2), (0, 4)}  # (row, start); 6-8 is not complete
        assert rule.mask(history, (0, 2)).all()
        ```
    """

    sequence_length: int
    period: int = 1

    def valid(self, history: History) -> set[tuple[int, int]]:
        """The windows `(row, absolute start)` that may be sampled now."""
        starts = _aligned_starts(history, self.sequence_length, self.period)
        return {(r, t) for r in range(history.rows) for t in starts}

    def mask(self, history: History, window: tuple[int, int]) -> Bool[np.ndarray, " window"]:
        """The steps of `window` that a sample keeps: all of them."""
        return np.ones(self.sequence_length, bool)


@dataclasses.dataclass(frozen=True)
class EpisodeRule:
    """Which windows the episode-aware buffers may sample, and the pad mask.

    - `mode="never_cross"`: a window is aligned (starts at a multiple of `period`), held,
        complete, and has no episode end before its last step.
    - `mode="pad"`: a window is aligned, held, and complete or cut by an episode end among its
        steps added (before its last step); its mask is true up to and including that end, and
        a sample is zero past it.

    **Arguments:**

    - `sequence_length`, `period`: as for [`equibuffer.testing.UniformRule`][].
    - `mode`: `"never_cross"` or `"pad"`.
    - `episode_end`: what marks the last step of an episode, as the buffer takes it: the name
        of a 0-d bool leaf of a dict step, or a function of one step returning a 0-d bool.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import EpisodeRule, History

        history = History(rows=1, length=8)
        history.add({"done": np.array([[False, True, False, False, False]])})
        never = EpisodeRule(sequence_length=3, mode="never_cross", episode_end="done")
        assert never.valid(history) == {(0, 2)}  # steps 2-4: the only window inside an episode
        pad = EpisodeRule(sequence_length=3, mode="pad", episode_end="done")
        # also the windows cut by the end at step 1; 3-5 and 4-6 are neither complete nor cut
        assert pad.valid(history) == {(0, 0), (0, 1), (0, 2)}
        assert pad.mask(history, (0, 1)).tolist() == [True, False, False]  # cut at step 1
        ```
    """

    sequence_length: int
    period: int = 1
    mode: Literal["never_cross", "pad"] = "never_cross"
    episode_end: str | Callable[..., Any] = "done"
    _cache: Any = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        if self.mode not in ("never_cross", "pad"):
            raise ValueError(
                f"EpisodeRule(): `mode` must be 'never_cross' or 'pad', got {self.mode!r}."
            )

    def ends(self, history: History) -> Bool[np.ndarray, "rows total"]:
        """The episode-end flag of every step added (computed once per step)."""
        done = self._cache.get(history, np.zeros((history.rows, 0), bool))
        if done.shape[1] < history.total:
            new = jax.tree.map(lambda x: x[:, done.shape[1] :], history.steps)
            if isinstance(self.episode_end, str):
                flags = np.asarray(_named(new, self.episode_end), bool)
            else:
                steps = jax.tree.map(jnp.asarray, new)
                flags = np.asarray(jax.vmap(jax.vmap(self.episode_end))(steps), bool)
            done = np.concatenate([done, flags], axis=1)
            self._cache[history] = done
        return done

    def valid(self, history: History) -> set[tuple[int, int]]:
        """The windows `(row, absolute start)` that may be sampled now."""
        if history.total == 0:
            return set()
        ends, s, total = self.ends(history), self.sequence_length, history.total
        out = set()
        for r in range(history.rows):
            for t in range(history.oldest, total):
                if t % self.period:
                    continue
                complete = t + s <= total
                cut = bool(ends[r, t : min(t + s - 1, total)].any())
                ok = (complete and not cut) if self.mode == "never_cross" else (complete or cut)
                if ok:
                    out.add((r, t))
        return out

    def mask(self, history: History, window: tuple[int, int]) -> Bool[np.ndarray, " window"]:
        """The steps of `window` inside its episode: all of them in `never_cross` mode, up to
        and including the first episode end in `pad` mode."""
        if self.mode == "never_cross":
            return np.ones(self.sequence_length, bool)
        row, start = window
        flags = self.ends(history)[row, start : start + self.sequence_length]
        flags = np.pad(flags, (0, self.sequence_length - flags.shape[0])).astype(int)
        return np.cumsum(flags) - flags == 0


def n_step(
    history: History,
    window: tuple[int, int],
    n: int,
    discount: float,
    reward: str = "reward",
    terminated: str = "terminated",
    truncated: str | None = "truncated",
    within: Bool[np.ndarray, " window"] | None = None,
) -> tuple[int, float, float]:
    """`(steps, reward, bootstrap discount)` of the n-step transition from `window`'s start,
    by [`equibuffer.NStepTransition`][]'s convention: rewards summed, discounted, up to and
    including the first step that ends an episode (`terminated` or `truncated`); the bootstrap
    discount is 0 after a termination, else `discount ** steps`. Computed in float64. With
    `within` (a pad-mode window's mask), the sum also stops at the episode's last step inside
    the window, as after a truncation.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, n_step

        history = History(rows=1, length=8)
        history.add({"reward": np.array([[1.0, 2.0, 4.0, 8.0]]),
                     "terminated": np.array([[False, False, True, False]])})
        assert n_step(history, (0, 0), n=2, discount=0.5, truncated=None) == (2, 2.0, 0.25)
        assert n_step(history, (0, 1), n=3, discount=0.5, truncated=None) == (2, 4.0, 0.0)
        ```
    """
    row, start = window
    total, taken, bootstrap = 0.0, 0, None
    for k in range(n):
        step = history.at(row, start + k)
        total += discount**k * float(_named(step, reward))
        taken += 1
        if _named(step, terminated):
            bootstrap = 0.0
            break
        if truncated is not None and _named(step, truncated):
            break
        if within is not None and not within[k + 1]:
            break
    return taken, total, discount**taken if bootstrap is None else bootstrap


@dataclasses.dataclass(frozen=True)
class WindowView:
    """What a trajectory buffer's sample holds for a window: its `sequence_length` steps,
    zero where the mask is false.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, WindowView

        history = History(rows=1, length=4)
        history.add({"x": np.array([[1, 2, 3]])})
        out = WindowView(2).experience(history, (0, 1), mask=np.array([True, False]))
        assert out["x"].tolist() == [2, 0]
        ```
    """

    sequence_length: int

    @property
    def length(self) -> int:
        """The steps of one window."""
        return self.sequence_length

    def experience(
        self, history: History, window: tuple[int, int], mask: Bool[np.ndarray, " window"]
    ) -> _Tree:
        """The window's steps, leaves `(sequence_length, *leaf)`."""

        def zero(x: np.ndarray) -> np.ndarray:
            return np.where(mask.reshape(-1, *(1,) * (x.ndim - 1)), x, np.zeros((), x.dtype))

        return jax.tree.map(zero, history.window(*window, self.sequence_length))


@dataclasses.dataclass(frozen=True)
class ItemView:
    """What an item buffer's sample holds for a window: its one step.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, ItemView

        history = History(rows=2, length=4)
        history.add({"x": np.array([[1, 2], [3, 4]])})
        assert ItemView().experience(history, (1, 0), mask=np.array([True]))["x"] == 3
        ```
    """

    @property
    def length(self) -> int:
        """The steps of one window: 1."""
        return 1

    def experience(
        self, history: History, window: tuple[int, int], mask: Bool[np.ndarray, " window"]
    ) -> _Tree:
        """The window's step, leaves `(*leaf)`."""
        return history.at(*window)


def _zero_unless(inside: bool, tree: _Tree) -> _Tree:
    return tree if inside else jax.tree.map(np.zeros_like, tree)


@dataclasses.dataclass(frozen=True)
class PairView:
    """What a transition buffer's sample holds for a window: `(first, second)`, two
    consecutive steps, `second` zero when the mask says it lies past an episode end.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, PairView

        history = History(rows=1, length=4)
        history.add({"x": np.array([[1, 2, 3]])})
        first, second = PairView().experience(history, (0, 1), mask=np.array([True, True]))
        assert (first["x"], second["x"]) == (2, 3)
        ```
    """

    @property
    def length(self) -> int:
        """The steps of one window: 2."""
        return 2

    def experience(
        self, history: History, window: tuple[int, int], mask: Bool[np.ndarray, " window"]
    ) -> tuple[_Tree, _Tree]:
        """`(first, second)`, each a tree of leaves `(*leaf)`."""
        both = history.window(*window, 2)
        first, second = (jax.tree.map(lambda x, k=k: x[k, ...], both) for k in (0, 1))
        return first, _zero_unless(bool(mask[1]), second)


@dataclasses.dataclass(frozen=True)
class NStepView:
    """What an n-step transition buffer's sample holds for a window of `n + 1` steps: an
    [`equibuffer.NStepTransition`][] computed by [`equibuffer.testing.n_step`][], `second`
    zero when the mask says it lies past an episode end.

    **Arguments:** `n`, `discount`, `reward`, `terminated`, `truncated` as for
    `TransitionBuffer(n_step=n, ...)`.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import History, NStepView

        history = History(rows=1, length=4)
        history.add({"reward": np.array([[1.0, 1.0, 1.0]]), "terminated": np.zeros((1, 3), bool)})
        view = NStepView(n=2, discount=0.5, truncated=None)
        out = view.experience(history, (0, 0), mask=np.ones(3, bool))
        assert out["reward"] == 1.5 and out["discount"] == 0.25 and out["steps"] == 2
        ```
    """

    n: int
    discount: float
    reward: str = "reward"
    terminated: str = "terminated"
    truncated: str | None = "truncated"

    @property
    def length(self) -> int:
        """The steps of one window: `n + 1`."""
        return self.n + 1

    def experience(
        self, history: History, window: tuple[int, int], mask: Bool[np.ndarray, " window"]
    ) -> dict[str, Any]:
        """A dict of the [`equibuffer.NStepTransition`][] fields: `first`, `second`, `last`
        (trees of leaves `(*leaf)`), `reward`, `discount` (float64) and `steps`."""
        m, reward, bootstrap = n_step(
            history,
            window,
            self.n,
            self.discount,
            self.reward,
            self.terminated,
            self.truncated,
            within=mask,
        )
        steps = history.window(*window, self.n + 1)
        first, last, second = (jax.tree.map(lambda x, k=k: x[k, ...], steps) for k in (0, m - 1, m))
        return {
            "first": first,
            "second": _zero_unless(bool(mask[m]), second),
            "last": last,
            "reward": np.float64(reward),
            "discount": np.float64(bootstrap),
            "steps": np.int32(m),
        }


View = WindowView | PairView | ItemView | NStepView


class Priorities:
    """The priority of every valid window of a prioritised buffer.

    - `refresh(valid)` after every change of the valid set (an `add`): a window that became
        valid enters at the largest priority set so far (1 at first); a window that stays
        valid keeps its priority; a window that is no longer valid is forgotten.
    - `set(windows, priorities)`: applied to the windows valid now, dropped for the others;
        the largest applied priority raises the entry priority.
    - A window is drawn with probability `leaf / sum of leaves`, `leaf = p**alpha` (0 for
        `p = 0` at any alpha), in float32 as the buffer computes it.

    **Arguments:**

    - `alpha`: the priority exponent.

    !!! example

        ```python
        import numpy as np
        from equibuffer.testing import Priorities

        priorities = Priorities(alpha=1.0)
        priorities.refresh({(0, 0), (0, 1)})  # two windows, both at 1
        priorities.set([(0, 0), (0, 5)], np.array([3.0, 9.0]))  # (0, 5) is not valid: dropped
        assert priorities.probability((0, 0)) == 0.75 and priorities.max_priority == 3.0
        priorities.refresh({(0, 0), (0, 1), (0, 2)})  # a new window enters at 3
        assert priorities.priority[(0, 2)] == 3.0
        ```
    """

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.max_priority = np.float32(1.0)
        self.priority: dict[Hashable, np.float32] = {}

    def refresh(self, valid: AbstractSet[Hashable]) -> None:
        """Follow the valid windows after an add."""
        self.priority = {w: self.priority.get(w, self.max_priority) for w in valid}

    def set(self, windows: Sequence[Hashable], priorities: Float[ArrayLike, " batch"]) -> None:
        """Set the priorities of `windows` that are valid now; drop the others."""
        for window, p in zip(windows, np.asarray(priorities), strict=True):
            if window in self.priority:
                self.priority[window] = np.float32(p)
                self.max_priority = max(self.max_priority, np.float32(p))

    def leaf(self, window: Hashable) -> float:
        """`p ** alpha` of a window (0 when its priority is 0 or it is not valid)."""
        p = self.priority.get(window, np.float32(0))
        return float(p ** np.float32(self.alpha)) if p > 0 else 0.0

    def total(self) -> float:
        """The sum of the leaves."""
        return sum(self.leaf(w) for w in self.priority)

    def probability(self, window: Hashable) -> float:
        """The probability with which a sample draws `window`."""
        return self.leaf(window) / self.total()


def rule_model(rule: Any, window: Any) -> "UniformRule | EpisodeRule | Any":
    """The reference model of a buffer's rule for its `window` (an
    [`equibuffer.rules.Window`][]): for the library's own rules, found here by their type
    (the library imports nothing of `equibuffer.testing`); for a rule of your own, what its
    `reference(window)` returns (`NotImplementedError` when it declares none).

    !!! example

        ```python
        import equibuffer as eb
        from equibuffer.testing import EpisodeRule, rule_model

        window = eb.rules.Window(2, 1, "2 steps")
        assert isinstance(rule_model(eb.rules.Episodic(mode="pad"), window), EpisodeRule)
        ```
    """
    if isinstance(rule, ByTheCounters):  # valid by the counters alone: Uniform, Prioritised, ...
        return UniformRule(window.length, window.period)
    if isinstance(rule, rules.Episodic | rules.PrioritisedEpisodic):
        e = rule.episodes
        return EpisodeRule(window.length, window.period, e.mode, e.episode_end)
    return rule.reference(window)


def view_model(view: Any) -> "WindowView | PairView | ItemView | NStepView | Any":
    """The reference model of a buffer's view: for the library's own views, found here by
    their type; for a view of your own, what its `reference()` returns.

    !!! example

        ```python
        import equibuffer as eb
        from equibuffer.testing import view_model, WindowView

        assert view_model(eb.views.WindowView(3)) == WindowView(3)
        ```
    """
    if isinstance(view, views.WindowView):
        return WindowView(view.sequence_length)
    if isinstance(view, views.PairView):
        return PairView()
    if isinstance(view, views.ItemView):
        return ItemView()
    if isinstance(view, views.NStepView):
        return NStepView(view.n, view.discount, view.reward, view.terminated, view.truncated)
    return view.reference()
