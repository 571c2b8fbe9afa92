"""A sum tree over non-negative priorities: batched set, get, total and proportional sampling."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._checks import check_indices, check_key, check_positive_int
from .._errors import branched_error_if, error_if
from ._layout import DEFAULT_FANOUT, DEFAULT_TOP, node_layout
from ._search import block_runs, descend, descend_from, enter_runs
from ._writes import write_nodes


class SumTree(eqx.Module):
    """A fixed-capacity tree whose leaves are non-negative `float32` priorities and whose
    internal nodes hold the sums of their children, so that the total is read in O(1) and a
    leaf is drawn with probability proportional to its priority in O(log N).

    Every operation is batched and vectorised: a batch of `B` updates, reads or draws costs
    `O(B * (fanout * log_fanout(N / top) + top))` array work, level by level, with no loop over
    the batch and nothing of size `N`. An update recomputes each touched node as the sum of its
    children (never by adding a difference), so float32 rounding does not build up however
    many updates are made.

    Layout: one flat `float32` array `nodes` (one array, not one per level: every array of a
    module costs a little in each jitted call that takes and returns it, which is most of
    the cost of a small batch). Level 0 holds the leaves (padded with zeros to a multiple of
    `fanout`), each level above has one node per `fanout` nodes below, up to the first level
    of at most `top` nodes; the last node is the root, the sum of that top level. Sampling
    takes the prefix sums of the top level once per batch, compares every query with all of
    them, and then descends one level per step; with `capacity <= top` the leaves are the top
    level (a single dense level).

    **Arguments:**

    - `capacity`: the number of leaves, any positive int.
    - `fanout`: children per internal node, at least 2 (default 8).
    - `top`: the largest level searched densely, at least 1 (default 8).

    The defaults were picked by measurement (see `benchmarks/bench_prioritised.py`). All
    leaves start at zero. A value below the smallest normal float32 (`jnp.finfo(jnp.float32)
    .tiny`, about 1.2e-38) is stored as 0: XLA's CPU arithmetic reads such subnormal numbers
    as 0, so a leaf holding one would count for nothing in the sums above it.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        import equibuffer as eb

        tree = eb.SumTree(5).set(jnp.array([0, 3]), jnp.array([1.0, 3.0]))
        assert float(tree.total()) == 4.0
        draws = tree.sample(jax.random.key(0), 8)  # only leaves 0 and 3, about 1:3
        assert set(draws.tolist()) <= {0, 3}
        ```
    """

    nodes: Float[Array, " nodes"]
    capacity: int = eqx.field(static=True)
    fanout: int = eqx.field(static=True)
    top: int = eqx.field(static=True)

    def __init__(self, capacity: int, fanout: int = DEFAULT_FANOUT, top: int = DEFAULT_TOP):
        where = "SumTree()"
        self.capacity = check_positive_int(where, "capacity", capacity)
        self.fanout = check_positive_int(where, "fanout", fanout)
        if self.fanout < 2:
            raise ValueError(f"{where}: `fanout` must be at least 2, got {fanout}.")
        self.top = check_positive_int(where, "top", top)
        _, offsets = node_layout(self.capacity, self.fanout, self.top)
        if offsets[-1] >= 2**31:
            raise ValueError(
                f"{where}: `capacity` must be below about 2**31 (the nodes are indexed with "
                f"int32), got {self.capacity}."
            )
        self.nodes = jnp.zeros(offsets[-1], jnp.float32)

    # ------------------------------------------------------------------ reads

    @property
    def levels(self) -> tuple[Float[Array, " _"], ...]:
        """Every level as its own array (padded), leaves first, the root (1 node) last."""
        sizes, offsets = node_layout(self.capacity, self.fanout, self.top)
        return tuple(self.nodes[o : o + n] for o, n in zip(offsets, sizes, strict=False))

    def total(self) -> Float[Array, ""]:
        """The sum of all leaves (the root), a 0-d float32.

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([0, 3]), jnp.array([1.5, 2.5]))
            assert tree.total().shape == () and float(tree.total()) == 4.0
            ```
        """
        return self.nodes[-1]

    def get(self, indices: Int[ArrayLike, " batch"]) -> Float[Array, " batch"]:
        """The leaves at `indices` (any int dtype, each in `[0, capacity)`; checked inside jit
        with `eqx.error_if`).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([1, 3]), jnp.array([2.0, 5.0]))
            assert tree.get(jnp.array([3, 0, 1])).tolist() == [5.0, 0.0, 2.0]
            ```
        """
        indices = self._check_indices("SumTree.get()", indices)
        indices = error_if(
            indices, _out_of_range(indices, self.capacity), _index_message("SumTree.get()", self)
        )
        return self.read(jnp.asarray(indices))

    def read(self, indices: Int[Array, " batch"]) -> Float[Array, " batch"]:
        """Unchecked `get`: every index must be in `[0, capacity)` (not checked; for code
        that knows it, such as the buffers).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([2]), jnp.array([5.0]))
            assert tree.read(jnp.array([2, 0])).tolist() == [5.0, 0.0]
            ```
        """
        return self.nodes.at[indices].get(mode="promise_in_bounds")

    def values(self) -> Float[Array, " capacity"]:
        """All `capacity` leaves.

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(5).set(jnp.array([4]), jnp.array([2.0]))
            assert tree.values().tolist() == [0.0, 0.0, 0.0, 0.0, 2.0]
            ```
        """
        return self.nodes[: self.capacity]

    # ----------------------------------------------------------------- writes

    def set(
        self, indices: Int[ArrayLike, " batch"], values: Float[ArrayLike, " batch"]
    ) -> "SumTree":
        """Return the tree with leaf `indices[i]` set to `values[i]`, and every node above the
        touched leaves recomputed from its children.

        When an index appears more than once in the batch, the **last** of its values is
        written, as in NumPy's `a[indices] = values`, on every platform (XLA's scatter leaves
        the order of repeated indices to the platform: the batch is deduplicated first, see
        `write`).

        Inside jit, `eqx.error_if` raises on an index outside `[0, capacity)` or on a value
        that is negative, NaN or infinite (one check). Values are cast to float32; a
        subnormal one is stored as 0 (see the class docstring).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([0, 2]), jnp.array([1.0, 3.0]))
            tree = tree.set(jnp.array([2]), jnp.array([0.5]))  # overwrites leaf 2
            assert tree.values().tolist() == [1.0, 0.0, 0.5, 0.0] and float(tree.total()) == 1.5
            tree = tree.set(jnp.array([1, 3, 1]), jnp.array([4.0, 2.0, 6.0]))  # leaf 1 twice
            assert tree.values().tolist() == [1.0, 6.0, 0.5, 2.0]  # the last value given wins
            ```
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
        bad = jnp.any(_out_of_range(indices, self.capacity) | _not_priorities(new))
        new = branched_error_if(
            new,
            bad,
            jnp.where(_out_of_range(indices, self.capacity), 0, 1),
            [
                _index_message(where, self),
                f"{where}: every value must be non-negative and finite (a negative, NaN or "
                "infinite priority was given).",
            ],
        )
        # Refused (recorded inside a buffer's method): no leaf changes (`write` sends every
        # skipped entry, whatever its index, to a path it recomputes unchanged).
        return self.write(indices, new, mask=jnp.broadcast_to(~bad, new.shape))

    def write(
        self,
        indices: Int[Array, " batch"],
        values: Float[Array, " batch"],
        *,
        mask: Bool[Array, " batch"] | None = None,
        unique_indices: bool = False,
    ) -> "SumTree":
        """Unchecked batched write (indices in `[0, capacity)`, values non-negative and finite),
        for the buffers.

        **Arguments:**

        - `indices`, `values`: `(batch,)` leaves and their new values.
        - `mask`: entries where it is false are skipped (default: none).
        - `unique_indices`: a promise that no index appears twice among the entries not
            skipped (as for JAX's scatter): the write then skips the deduplication below.
            Repeated indices break the promise: which value they leave is then the
            platform's choice.

        Where an index appears several times among the entries not skipped, the last of them
        wins, as in NumPy, on every platform: the entries a later one overrides are found
        first (by comparing every pair up to 64 entries; above, each entry writes a mark of
        its position by a scatter-min, whose result does not depend on the order, and the
        entry whose mark stays is the last), and only the others write their values, by a
        scatter whose indices are unique. A skipped entry never overrides one before it.

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            indices, values = jnp.array([0, 1, 3]), jnp.array([1.0, 2.0, 4.0])
            tree = eb.SumTree(4).write(indices, values, mask=jnp.array([True, False, True]))
            assert tree.values().tolist() == [1.0, 0.0, 0.0, 4.0] and float(tree.total()) == 5.0
            # leaf 2 three times: the last entry not skipped wins
            mask = jnp.array([True, True, False])
            tree = tree.write(jnp.array([2, 2, 2]), jnp.array([5.0, 6.0, 7.0]), mask=mask)
            assert tree.values().tolist() == [1.0, 0.0, 6.0, 4.0]
            ```
        """
        layout = node_layout(self.capacity, self.fanout, self.top)
        nodes = write_nodes(self.nodes, layout, self.fanout, indices, values, mask, unique_indices)
        return eqx.tree_at(lambda t: t.nodes, self, nodes)

    def write_block(self, start: Int[ArrayLike, ""], values: Float[Array, " m"]) -> "SumTree":
        """Unchecked write of the `m` contiguous leaves `start, start + 1, ...` (`start` in
        `[0, capacity)`, `m <= capacity`), wrapping around from the last leaf to leaf 0 as a
        ring does: `write((start + arange(m)) % capacity, values, unique_indices=True)`.

        (It was once made of contiguous slices only; XLA then copied the whole tree twice
        per call, fusing the root's sum into the last slice written, which made a one-row
        prioritised `add` at 10**6 leaves cost 167 us instead of 11.)

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(100).write_block(jnp.int32(40), jnp.array([1.0, 2.0, 3.0]))
            assert float(tree.total()) == 6.0 and tree.get(jnp.array([41])).tolist() == [2.0]
            wrapped = tree.write_block(jnp.int32(99), jnp.array([4.0, 5.0]))  # leaves 99, 0
            assert wrapped.get(jnp.array([99, 0])).tolist() == [4.0, 5.0]
            ```
        """
        m = values.shape[0]
        if m > self.capacity:
            raise ValueError(
                f"SumTree.write_block(): {m} values for a tree of capacity {self.capacity}."
            )
        start = jnp.asarray(start, jnp.int32)
        leaves = (start + jnp.arange(m, dtype=jnp.int32)) % self.capacity
        return self.write(leaves, values, unique_indices=True)

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

        !!! example

            ```python
            import jax, jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([1, 2]), jnp.array([1.0, 3.0]))
            draws = tree.sample(jax.random.key(0), 400)
            assert draws.shape == (400,) and set(draws.tolist()) <= {1, 2}  # never a zero leaf
            assert abs(int((draws == 2).sum()) - 300) <= 1  # stratified: 3:1 to within one draw
            ```
        """
        return self.sample_values(key, batch_size, stratified=stratified)[0]

    def sample_values(
        self, key: PRNGKeyArray, batch_size: int, *, stratified: bool = True
    ) -> tuple[Int[Array, " batch_size"], Float[Array, " batch_size"]]:
        """`sample`, and the value of each leaf drawn (from the search itself: no second read
        of the leaves), e.g. for its probability `value / total()`.

        !!! example

            ```python
            import jax, jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(4).set(jnp.array([1, 2]), jnp.array([1.0, 3.0]))
            leaves, values = tree.sample_values(jax.random.key(0), 8)
            assert (values == tree.get(leaves)).all()
            ```
        """
        check_key("SumTree.sample()", key)
        batch_size = check_positive_int("SumTree.sample()", "batch_size", batch_size)
        u = jax.random.uniform(key, (batch_size,), jnp.float32)
        if stratified:
            u = (jnp.arange(batch_size, dtype=jnp.float32) + u) / batch_size
        return self.search(u * self.total())

    def find(self, prefix: Float[Array, " batch"]) -> Int[Array, " batch"]:
        """The leaf whose cumulative range `[sum of leaves before it, + itself)` holds each
        `prefix` in `[0, total)`; a prefix at or past the total (float rounding) maps to the
        last leaf of positive value, so a zero leaf is never returned while `total() > 0`.

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(3).set(jnp.array([0, 2]), jnp.array([1.0, 3.0]))  # [0, 1) and [1, 4)
            assert tree.find(jnp.array([0.0, 0.99, 1.0, 3.5])).tolist() == [0, 0, 2, 2]
            assert tree.find(jnp.array([4.0])).tolist() == [2]  # at the total: last positive leaf
            ```
        """
        return self.search(prefix)[0]

    def search(
        self, prefix: Float[Array, " batch"]
    ) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
        """`find`, and the value of each leaf found (read from the last level of the search,
        not by a second gather from the leaves).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(3).set(jnp.array([0, 2]), jnp.array([1.0, 3.0]))
            leaves, values = tree.search(jnp.array([0.5, 2.0]))  # [0, 1) and [1, 4)
            assert leaves.tolist() == [0, 2] and values.tolist() == [1.0, 3.0]
            ```
        """
        u = prefix.astype(jnp.float32)
        # The top level (the root's children), then one level down per step. Each step is a
        # gather of the children, then elementwise work on them. The optimisation barriers
        # keep each step's kernels apart: fused across levels, XLA would recompute every
        # level above for each element of the one below. A chain of dependent kernels is run
        # by XLA:CPU in the calling thread (independent ones are handed to other threads,
        # which costs more than this work at batch sizes of a few hundred).
        sizes, offsets = node_layout(self.capacity, self.fanout, self.top)
        node, before, value = descend(self.nodes[None, offsets[-3] : offsets[-2]], u)
        return descend_from(self, len(sizes) - 2, node, u - before, value)

    def block_totals(self, blocks: int) -> Float[Array, " blocks"]:
        """The sum of the leaves of each of `blocks` equal runs of consecutive leaves (block
        `b` holds leaves `[b * capacity / blocks, (b + 1) * capacity / blocks)`; `blocks`
        must divide `capacity`).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(6).set(jnp.array([0, 2, 5]), jnp.array([1.0, 2.0, 4.0]))
            assert tree.block_totals(2).tolist() == [3.0, 4.0]  # leaves 0-2 and 3-5
            ```
        """
        return block_runs(self, blocks)[2][:, -1]

    def search_blocks(
        self, prefix: Float[Array, "blocks per_block"]
    ) -> tuple[Int[Array, "blocks per_block"], Float[Array, "blocks per_block"]]:
        """`search` inside blocks: for each `prefix[b, i]` in `[0, block_totals(blocks)[b])`
        (`blocks = prefix.shape[0]`), the leaf of block `b` whose cumulative range within
        the block holds it, and its value. A leaf outside the block, or of zero value while
        the block's total is positive, is never returned (a prefix at or past the block's
        total maps to its last positive leaf).

        The search starts at the lowest level whose nodes each lie inside one block (the
        nodes `fanout**j` leaves wide, for the largest `j` with `fanout**j` dividing
        `capacity / blocks`): that level's run of nodes of the block is read whole (so the
        cost is `capacity / blocks / fanout**j` per block, plus `O(log)` per query below).

        !!! example

            ```python
            import jax.numpy as jnp
            import equibuffer as eb

            tree = eb.SumTree(6).set(jnp.array([0, 2, 5]), jnp.array([1.0, 2.0, 4.0]))
            leaves, values = tree.search_blocks(jnp.array([[0.5, 1.5], [0.0, 3.9]]))
            assert leaves.tolist() == [[0, 2], [5, 5]]  # block 0: leaves 0-2, block 1: 3-5
            assert values.tolist() == [[1.0, 2.0], [4.0, 4.0]]
            ```
        """
        blocks, per = prefix.shape
        level, runs, running = block_runs(self, blocks)
        u = prefix.astype(jnp.float32)
        child, before, value = enter_runs(runs, running, u)
        node = child + (jnp.arange(blocks, dtype=jnp.int32) * runs.shape[1])[:, None]
        remainder = jnp.maximum(u - before, 0.0)
        leaves, values = descend_from(
            self, level, node.reshape(-1), remainder.reshape(-1), value.reshape(-1)
        )
        return leaves.reshape(blocks, per), values.reshape(blocks, per)

    # ---------------------------------------------------------------- helpers

    def _check_indices(self, where: str, indices: Int[ArrayLike, " batch"]) -> Int[Array, " b"]:
        """Static checks (shape, dtype); the range is checked by the caller, with the rest."""
        return check_indices(where, indices).astype(jnp.int32)

    def node_array(self) -> tuple[Float[Array, " nodes"], int]:
        """The node array, and the number of trees in it (one)."""
        return self.nodes, 1

    def node_grid(self) -> Float[Array, " nodes"]:
        """The nodes, one row per tree (here a single row, without its axis)."""
        return self.nodes


def _out_of_range(indices: Int[Array, " batch"], n: int) -> Bool[Array, ""]:
    return jnp.any((indices < 0) | (indices >= n))


def _not_priorities(values: Float[Array, " batch"]) -> Bool[Array, ""]:
    return jnp.any((values < 0) | ~jnp.isfinite(values))


def _index_message(where: str, tree: SumTree) -> str:
    return f"{where}: every index must be in [0, capacity={tree.capacity})."
