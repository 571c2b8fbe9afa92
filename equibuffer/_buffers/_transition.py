import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._checks import check_positive_int
from .._custom_types import ExampleTree, ExperienceBatch
from .._nstep import check_discount, check_leaves, check_n_step, n_step_from_storage
from .._ring import RingStorage
from .._windows import gather_steps, uniform_windows
from ._base import (
    AbstractBuffer,
    add_to_storage,
    check_window_config,
    resolve_length,
    Sample,
    Transition,
)


class TransitionBuffer(AbstractBuffer):
    """A buffer of transitions: samples consecutive pairs `(first, second)` of steps of one row
    (Flashbax's flat buffer). Each step is stored once; the pair is gathered at sample time.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "action": jnp.int32(0)}
        buffer = eb.TransitionBuffer(example, add_batch_size=8, capacity=1_000)
        for _ in range(3):
            buffer = buffer.add({"obs": jnp.ones((8, 4)), "action": jnp.zeros(8, jnp.int32)})
        sample = buffer.sample(jax.random.key(0), batch_size=32)
        assert sample.experience.first["obs"].shape == (32, 4)
        ```

    With `n_step=n`, `sample` returns n-step transitions computed from the `n + 1` stored
    steps that follow each sampled step (nothing is stored twice), cut at episode ends; see
    [`equibuffer.n_step_transition`][] for the convention.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(4), "reward": jnp.float32(0),
                   "terminated": jnp.bool_(False), "truncated": jnp.bool_(False)}
        buffer = eb.TransitionBuffer(example, add_batch_size=2, capacity=100, n_step=3,
                                     discount=0.99)
        buffer = buffer.add({"obs": jnp.ones((2, 5, 4)), "reward": jnp.ones((2, 5)),
                             "terminated": jnp.zeros((2, 5), bool),
                             "truncated": jnp.zeros((2, 5), bool)})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert sample.experience.second["obs"].shape == (8, 4)
        assert jnp.allclose(sample.experience.reward, 1 + 0.99 + 0.99**2)
        ```
    """

    storage: RingStorage
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    n_step: int | None = eqx.field(static=True)
    discount: float | None = eqx.field(static=True)
    leaf_names: tuple[str, str, str | None] = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        n_step: int | None = None,
        discount: float | None = None,
        reward: str = "reward",
        terminated: str = "terminated",
        truncated: str | None = "truncated",
    ):
        """**Arguments:**

        - `example`: one step of experience, a pytree of arrays.
        - `add_batch_size`: the number of rows each `add` writes.
        - `max_length`: steps held per row (at least 2). Or instead:
        - `capacity` (alias `max_size`): steps held in total, rounded up to a multiple of
            `add_batch_size`.
        - `min_length`: steps per row before `can_sample()` is true (default 2, or
            `n_step + 1`).
        - `n_step`: sample n-step transitions ([`equibuffer.NStepTransition`][]) instead
            of pairs; at least 1. Needs `discount` and the leaves named by:
        - `reward`, `terminated`, `truncated`: the names (keys or attributes of the example)
            of the float reward leaf and the bool episode-end leaves; `truncated=None` when
            there is none.
        """
        where = "TransitionBuffer()"
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        length = resolve_length(where, rows, max_length, capacity, max_size)
        self.n_step, self.discount = None, None
        self.leaf_names = (reward, terminated, truncated)
        if n_step is not None or discount is not None:
            if n_step is None or discount is None:
                raise TypeError(f"{where}: give both `n_step` and `discount`, or neither.")
            self.n_step = check_n_step(where, n_step)
            self.discount = check_discount(where, discount)
        self.sequence_length, self.period, self.min_length = check_window_config(
            where, length, 2 if self.n_step is None else self.n_step + 1, 1, min_length
        )
        self.storage = RingStorage(example, rows, length)
        if self.n_step is not None:
            check_leaves(where, self.storage.example(), reward, terminated, truncated)

    def add(self, batch: ExperienceBatch) -> "TransitionBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row; see [`equibuffer.AbstractBuffer.add`][].

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TransitionBuffer({"obs": jnp.zeros(4)}, add_batch_size=2, max_length=10)
            buffer = buffer.add({"obs": jnp.ones((2, 4))})  # one step per row
            assert not buffer.can_sample()  # a transition needs two steps in a row
            buffer = buffer.add({"obs": jnp.ones((2, 3, 4))})  # three more per row
            assert buffer.can_sample() and int(buffer.size()) == 8
            ```
        """
        return add_to_storage(self, batch)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Sample:
        """Draw `batch_size` transitions uniformly over all consecutive pairs held.

        **Returns:**

        A [`equibuffer.Sample`][] whose `experience` is a [`equibuffer.Transition`][] with
        leaves `(batch_size, *leaf)`, or with `n_step` an [`equibuffer.NStepTransition`][]
        (drawn uniformly over the windows of `n_step + 1` steps held).

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.TransitionBuffer({"t": jnp.float32(0)}, add_batch_size=1, max_length=10)
            buffer = buffer.add({"t": jnp.arange(6.0)[None]})
            sample = buffer.sample(jax.random.key(0), batch_size=8)
            first, second = sample.experience.first["t"], sample.experience.second["t"]
            assert first.shape == (8,) and (second == first + 1).all()
            ```
        """
        if self.n_step is not None and self.discount is not None:
            where = "TransitionBuffer.sample()"
            batch_size = check_positive_int(where, "batch_size", batch_size)
            indices, steps = uniform_windows(self.storage, key, batch_size, self.n_step + 1, 1)
            indices = eqx.error_if(
                indices,
                ~self.can_sample(),
                f"{where}: the buffer cannot be sampled yet: it needs at least "
                f"min_length={self.min_length} steps per row (n_step + 1 = "
                f"{self.n_step + 1} for one n-step window). Check `buffer.can_sample()` first.",
            )
            experience = n_step_from_storage(
                self.storage, indices, self.n_step, self.discount, *self.leaf_names
            )
            return Sample(experience=experience, indices=indices, steps=steps)
        indices, steps = self._draw_indices(key, batch_size)
        # Each step gathered on its own: slicing a gathered (batch, 2, ...) pair costs a copy.
        first, second = gather_steps(self.storage, indices, 2)
        return Sample(experience=Transition(first, second), indices=indices, steps=steps)
