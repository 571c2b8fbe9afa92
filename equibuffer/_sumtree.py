"""A sum tree over non-negative priorities: batched set, get, total and proportional sampling."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._checks import check_positive_int


# Picked by measurement (`python -m benchmarks.bench_prioritised`, CPU, batch 256, per batch
# inside a `lax.scan`; a shared, noisy machine, so only the trends are trusted): a dense single
# level (prefix sums of every leaf + `searchsorted`) was fastest at 1e3 and 1e4 leaves (sample
# 8-12 us against 18-33 us for the best tree); at 1e5 and 1e6, 4- and 8-ary trees were fastest
# to sample (33-46 us and 146-167 us) while 16-ary and wider were 2-10x slower (the per-node
# prefix sums over `fanout` children) and binary 2-3x slower (twice or more the levels).
_DENSE_UP_TO = 2**14
_DEFAULT_FANOUT = 8


def _level_sizes(capacity: int, fanout: int) -> list[int]:
    """Node counts per level, leaves first, root (1 node) last; at least two levels."""
    sizes = [capacity]
    while True:
        sizes.append(math.ceil(sizes[-1] / fanout))
        if sizes[-1] == 1:
            return sizes


class SumTree(eqx.Module):
    """A fixed-capacity tree whose leaves are non-negative `float32` priorities and whose
    internal nodes hold the sums of their children, so that the total is read in O(1) and a
    leaf is drawn with probability proportional to its priority in O(log N).

    Every operation is batched and vectorised: a batch of `B` updates, reads or draws costs
    `O(B * fanout * log_fanout(N))` array work, level by level, with no loop over the batch.
    An update recomputes each touched node as the sum of its children (never by adding a
    difference), so float32 rounding does not build up however many updates are made.

    Layout: level 0 holds the leaves (padded with zeros to a multiple of `fanout`), each level
    above has one node per `fanout` nodes below, and the last level is the root. A tree with
    `fanout >= capacity` is a single dense level: sampling then takes the prefix sums of all
    leaves and binary-searches them (`O(N + B log N)`), which is fastest for small capacities.

    **Arguments:**

    - `capacity`: the number of leaves, any positive int.
    - `fanout`: children per internal node, at least 2. By default: one dense level up to
        16384 leaves, else 8 (picked by measurement, see `benchmarks/bench_prioritised.py`).

    All leaves start at zero.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        from equibuffer._sumtree import SumTree

        tree = SumTree(5).set(jnp.array([0, 3]), jnp.array([1.0, 3.0]))
        assert float(tree.total()) == 4.0
        draws = tree.sample(jax.random.key(0), 8)  # only leaves 0 and 3, about 1:3
        assert set(draws.tolist()) <= {0, 3}
        ```
    """

    levels: tuple[Float[Array, " _"], ...]
    capacity: int = eqx.field(static=True)
    fanout: int = eqx.field(static=True)

    def __init__(self, capacity: int, fanout: int | None = None):
        where = "SumTree()"
        self.capacity = check_positive_int(where, "capacity", capacity)
        if fanout is None:
            fanout = self.capacity if self.capacity <= _DENSE_UP_TO else _DEFAULT_FANOUT
            fanout = max(fanout, 2)
        fanout = check_positive_int(where, "fanout", fanout)
        if fanout < 2:
            raise ValueError(f"{where}: `fanout` must be at least 2, got {fanout}.")
        if self.capacity >= 2**31:
            raise ValueError(f"{where}: `capacity` must be below 2**31, got {self.capacity}.")
        self.fanout = fanout
        sizes = _level_sizes(self.capacity, fanout)
        # Each level is padded to whole groups of `fanout` children (zeros, never sampled).
        shapes = [sizes[i + 1] * fanout for i in range(len(sizes) - 1)] + [1]
        self.levels = tuple(jnp.zeros(n, jnp.float32) for n in shapes)

    # ------------------------------------------------------------------ reads

    def total(self) -> Float[Array, ""]:
        """The sum of all leaves (the root), a 0-d float32."""
        return self.levels[-1][0]

    def get(self, indices: Int[ArrayLike, " batch"]) -> Float[Array, " batch"]:
        """The leaves at `indices` (any int dtype, each in `[0, capacity)`; checked inside jit
        with `eqx.error_if`)."""
        indices = self._check_indices("SumTree.get()", indices)
        return self.levels[0].at[indices].get(mode="promise_in_bounds")

    def values(self) -> Float[Array, " capacity"]:
        """All `capacity` leaves."""
        return self.levels[0][: self.capacity]

    # ----------------------------------------------------------------- writes

    def set(
        self, indices: Int[ArrayLike, " batch"], values: Float[ArrayLike, " batch"]
    ) -> "SumTree":
        """Return the tree with leaf `indices[i]` set to `values[i]`, and every node above the
        touched leaves recomputed from its children.

        When an index appears more than once in the batch, the **last** occurrence wins (as
        with NumPy's `a[indices] = values`), deterministically on every backend.

        Inside jit, `eqx.error_if` raises on an index outside `[0, capacity)` and on a value
        that is negative, NaN or infinite. Values are cast to float32.
        """
        where = "SumTree.set()"
        indices = self._check_indices(where, indices)
        new = jnp.asarray(values)
        if new.shape != indices.shape:
            raise ValueError(
                f"{where}: `values` has shape {new.shape} but `indices` has shape "
                f"{indices.shape}; give one value per index."
            )
        new = new.astype(jnp.float32)
        new = eqx.error_if(
            new,
            jnp.any((new < 0) | ~jnp.isfinite(new)),
            f"{where}: every value must be non-negative and finite (a negative, NaN or infinite "
            "priority was given).",
        )
        return self.write(indices, new, mask=None, unique=False)

    def write(
        self,
        indices: Int[Array, " batch"],
        values: Float[Array, " batch"],
        *,
        mask: Bool[Array, " batch"] | None,
        unique: bool,
    ) -> "SumTree":
        """Unchecked batched write (indices in range, values valid), for the buffers.

        Entries where `mask` is false are skipped. `unique=True` promises that the written
        indices are distinct and skips the resolution of duplicates (last one wins).
        """
        k = self.fanout
        n0 = self.levels[0].shape[0]
        indices = indices.astype(jnp.int32)
        if unique and mask is None:
            target = indices
            leaves = (
                self.levels[0].at[target].set(values, unique_indices=True, mode="promise_in_bounds")
            )
        else:
            target = _last_wins(indices, mask, n0)
            leaves = self.levels[0].at[target].set(values, mode="drop")
        levels = [leaves]
        if indices.shape[0] * k >= n0:
            # A batch touching about every group: one dense pass is cheaper than per-node work.
            for _ in self.levels[1:]:
                levels.append(levels[-1].reshape(-1, k).sum(axis=1))
                levels[-1] = _pad_to(levels[-1], k)
        else:
            node = indices
            arange = jnp.arange(k, dtype=jnp.int32)
            for level in self.levels[1:]:
                node = node // k
                children = (
                    levels[-1].at[node[:, None] * k + arange[None, :]].get(mode="promise_in_bounds")
                )
                # Several touched nodes may share a parent: each writes the same sum.
                levels.append(level.at[node].set(children.sum(axis=1), mode="promise_in_bounds"))
        # Top level is the root alone; intermediate levels keep their padded shapes.
        levels[-1] = levels[-1][:1]
        return eqx.tree_at(lambda t: t.levels, self, tuple(levels))

    # --------------------------------------------------------------- sampling

    def sample(
        self, key: PRNGKeyArray, batch_size: int, *, stratified: bool = True
    ) -> Int[Array, " batch_size"]:
        """Draw `batch_size` leaf indices, each with probability `leaf / total()`.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of draws.
        - `stratified`: if true (the default), `[0, total)` is cut into `batch_size` equal
            segments and one point is drawn uniformly in each (lower variance; each draw of the
            batch still has the right probability on average over the batch). If false, the
            draws are independent.

        **Returns:**

        `(batch_size,)` int32 indices. Leaves of zero priority are never drawn. When the total
        is zero every draw is meaningless (the buffers raise before it matters).
        """
        batch_size = check_positive_int("SumTree.sample()", "batch_size", batch_size)
        u = jax.random.uniform(key, (batch_size,), jnp.float32)
        if stratified:
            u = (jnp.arange(batch_size, dtype=jnp.float32) + u) / batch_size
        return self.find(u * self.total())

    def find(self, prefix: Float[Array, " batch"]) -> Int[Array, " batch"]:
        """The leaf whose cumulative range `[sum of leaves before it, + itself)` holds each
        `prefix` in `[0, total)`; a prefix at or past the total (float rounding) maps to the
        last leaf of positive value, so a zero leaf is never returned while `total() > 0`."""
        k = self.fanout
        u = prefix.astype(jnp.float32)
        # The root's children are shared by every query: prefix sums once, then binary search.
        top = self.levels[-2]
        csum = jnp.cumsum(top)
        child = jnp.searchsorted(csum, u, side="right").astype(jnp.int32)
        child = jnp.where(child >= top.shape[0], _last_positive(top), child)
        u = u - jnp.where(child > 0, csum[jnp.maximum(child - 1, 0)], 0.0)
        node = child
        arange = jnp.arange(k, dtype=jnp.int32)
        for level in reversed(self.levels[:-2]):
            children = level.at[node[:, None] * k + arange[None, :]].get(mode="promise_in_bounds")
            csum = jnp.cumsum(children, axis=1)
            child = jnp.sum(csum <= u[:, None], axis=1, dtype=jnp.int32)
            child = jnp.where(child >= k, _last_positive(children), child)
            before = jnp.take_along_axis(csum, jnp.maximum(child - 1, 0)[:, None], axis=1)[:, 0]
            u = u - jnp.where(child > 0, before, 0.0)
            node = node * k + child
        return jnp.minimum(node, self.capacity - 1)

    # ---------------------------------------------------------------- helpers

    def _check_indices(self, where: str, indices: Int[ArrayLike, " batch"]) -> Int[Array, " b"]:
        indices = jnp.asarray(indices)
        if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                f"{where}: `indices` must be a 1-d integer array, got shape {indices.shape} "
                f"and dtype {indices.dtype}."
            )
        indices = indices.astype(jnp.int32)
        return eqx.error_if(
            indices,
            jnp.any((indices < 0) | (indices >= self.capacity)),
            f"{where}: every index must be in [0, capacity={self.capacity}).",
        )


def _pad_to(x: Array, k: int) -> Array:
    extra = -x.shape[0] % k
    if x.shape[0] > 1 and extra:
        x = jnp.concatenate([x, jnp.zeros(extra, x.dtype)])
    return x


def _last_positive(values: Float[Array, "*b k"]) -> Int[Array, "*b"]:
    """Index of the last positive entry along the last axis (0 if none)."""
    k = values.shape[-1]
    return (k - 1 - jnp.argmax(values[..., ::-1] > 0, axis=-1)).astype(jnp.int32)


def _last_wins(
    indices: Int[Array, " batch"], mask: Bool[Array, " batch"] | None, sentinel: int
) -> Int[Array, " batch"]:
    """`indices` with every entry that is masked out, or followed later in the batch by the
    same index, replaced by `sentinel` (out of range: a scatter with `mode="drop"` skips it).
    A stable sort makes it O(B log B) with no loop over the batch."""
    key = indices if mask is None else jnp.where(mask, indices, sentinel)
    order = jnp.argsort(key, stable=True)
    ordered = key[order]
    last = jnp.concatenate([ordered[1:] != ordered[:-1], jnp.ones(1, bool)])
    winner = jnp.zeros(indices.shape, bool).at[order].set(last, unique_indices=True)
    return jnp.where(winner, key, sentinel)
