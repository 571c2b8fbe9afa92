"""The archive loader: batches of windows for offline training from an archive (or a set of
archives) larger than memory, read in large blocks at the disk's pace, by the epoch law.

The law. The time axis of every member is cut into blocks of `block_steps` steps (all rows).
A window belongs to the block that holds its first step; a block is read with a halo of
`window - 1` steps past its end (only the chunks those steps touch), so a window that
straddles two blocks is read whole with the block it starts in: every valid window belongs to
exactly one block. Each epoch draws a uniformly random order of the blocks and takes them
`pool_blocks` at a time (a group); the valid windows of a group are put in a uniformly random
order and cut into batches, a batch continuing into the next group where one runs out. So
every valid window comes exactly once per epoch, in a random order, and the epoch's last
batch is masked where it runs short. Two groups are resident at a time: the one batches are
drawn from, and the next one, read meanwhile.
"""

import bisect
import dataclasses
import queue
import threading
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from .._checks import check_positive_int
from .._frames import as_frames, Frames, leaf_position
from .._ring import RingStorage
from ..rules._valid import segment_starts
from ..views._base import AbstractView
from ..views._nstep import check_discount, check_leaves, check_n_step, NStepView
from ..views._pair import PairView
from ..views._window import WindowView
from ._archive import Archive
from ._reader import Reader, stacks_held
from ._sampler import generator, Seed
from ._set import ArchiveSet


class LoaderPosition(NamedTuple):
    """Where an [`equibuffer.ArchiveLoader`][] stands: the next window to deliver is the
    `offset`-th (in the group's random order) of group `group` of epoch `epoch`. Plain ints:
    store it with a checkpoint (`tuple(position)`) and pass it back as `position=` to a
    loader made with the same key and arguments to go on where it stopped."""

    epoch: int
    group: int
    offset: int


class LoaderBatch(NamedTuple):
    """A batch from an [`equibuffer.ArchiveLoader`][], every field a device array with leading
    axis `batch`:

    - `experience`: the view's result: windows `(batch, sequence_length, *leaf)`, or a
        [`equibuffer.Transition`][], or an [`equibuffer.NStepTransition`][].
    - `rows`: each window's row (a row of the set, for an `ArchiveSet`); -1 where masked.
    - `starts`: the archive time index of each window's first step; -1 where masked.
    - `mask`: false for the padding of an epoch's last, short batch (its experience is
        zero there); true everywhere else.
    """

    experience: PyTree[Shaped[Array, "batch ..."]]
    rows: Int[Array, " batch"]
    starts: Int[Array, " batch"]
    mask: Bool[Array, " batch"]


@dataclasses.dataclass(frozen=True)
class _Block:
    """Block `[first, stop)` of window starts of member `member`; its steps are read from
    `first` to `read_stop` (past `stop` by at most the halo)."""

    member: int
    first: int
    stop: int
    read_stop: int
    starts: np.ndarray  # the starts valid by the counters (aligned, inside one segment)
    read_first: int  # where its steps are read from: `first`, or before it the frames' look-back


@dataclasses.dataclass
class _Group:
    """A group's data and its windows in their random order."""

    epoch: int
    index: int
    ids: np.ndarray  # the blocks, in the group's order
    data: list[list[np.ndarray]]  # per block, per leaf: (rows, read_stop - first, *leaf)
    block: np.ndarray
    row: np.ndarray
    start: np.ndarray


_DONE = object()
_POLL = 0.05  # seconds between the threads' looks at the stop flag


def _valid_starts(
    segments: list[tuple[int, int]], lo: int, hi: int, window: int, period: int
) -> np.ndarray:
    """The starts in `[lo, hi)` that are multiples of `period` and whose window lies inside
    one segment (`segments`: sorted and disjoint, as `Commit.segments` gives them): each
    segment's valid starts by the window rule (`segment_starts`), cut to `[lo, hi)`."""
    parts = []
    for i in range(bisect.bisect_right(segments, lo, key=lambda ab: ab[1]), len(segments)):
        a, b = segments[i]  # (the segments from the first that ends after `lo`)
        if a >= hi:
            break
        first, count = segment_starts(a, b, window, period)
        k_lo = max(0, -(-(lo - first) // period))  # the first of them at or after `lo`
        k_hi = min(count, -(-(hi - first) // period))  # and past the last before `hi`
        if k_hi > k_lo:
            starts = first + k_lo * period, first + k_hi * period
            parts.append(np.arange(*starts, period, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class ArchiveLoader:
    """Batches of windows for offline training, streamed from an [`equibuffer.Archive`][]
    or an [`equibuffer.ArchiveSet`][] larger than memory, at the disk's pace: large blocks
    are read whole in a random order on a background thread while the learner trains, and
    the batches (copied to the device, the view applied) wait in a bounded queue.

    **The law (epochs).** The time axis is cut into blocks of `block_steps` steps of every
    row; a window belongs to the block holding its first step, and a block is read with a
    halo of `window - 1` steps (only the chunks they touch), so windows straddling two
    blocks are read whole and none is lost. Each epoch takes the blocks in a uniformly random
    order, `pool_blocks` at a time (a group), and delivers the valid windows of each group in
    a uniformly random order, batches running on from one group into the next. Every valid
    window comes **exactly once per epoch**; the epoch's last batch is padded and masked
    (`mask` false) where it runs short. A window is valid as for the buffers: `window`
    consecutive steps of one row starting at a multiple of `period`, inside one contiguous
    segment of the committed steps (never across a gap of lost steps), and, with
    `episode_end`, with no episode end before its last step (`mode="never_cross"`). The
    randomness is the key's alone: the same key and arguments give the same batches. For
    exactly uniform draws with replacement from the whole archive, use `Archive.sample`.

    **Memory.** At most two groups of blocks are resident (`2 * pool_blocks` blocks of
    `block_steps + window - 1` steps of every row), plus `prefetch + 2` batches:
    `resident_bytes` says how much. It does not grow with the archive.

    **Arguments:**

    - `source`: an `Archive` or an `ArchiveSet` (its snapshot when the loader is made).
    - `key`: a JAX PRNG key (or a NumPy generator or an int seed): the same key, the same
        batches.
    - `batch_size`: windows per batch.
    - `sequence_length`: the steps of each window (`view="window"`).
    - `period`: windows start at archive time indices that are multiples of it.
    - `view`: what a batch's `experience` is: `"window"` (leaves
        `(batch, sequence_length, *leaf)`, as `TrajectoryBuffer`), or `"transition"`: a
        `Transition` of two consecutive steps, or with `n_step` an `NStepTransition` of
        `n_step + 1` steps (`discount`, `reward`, `terminated`, `truncated` as for
        `TransitionBuffer`), computed by the buffers' own views.
    - `episode_end`: the name of a boolean top-level leaf marking an episode's last step:
        windows never contain an end before their last step.
    - `frames`: an [`equibuffer.Frames`][], for an archive that holds one frame per step of a
        stacked observation (an `Archive` of a buffer with `frames=`): every step of a batch
        comes back as the stack the frame-stacking wrapper returned (see
        [Pixels](../pixels.md)), read with the `k - 1` steps before each window. Its episode
        ends are `episode_end`'s unless it names its own leaf. A window starts no earlier
        than `k - 1` steps into a segment, whose earlier frames the archive does not hold,
        unless the segment starts at the source's first step (its first episode's start).
    - `block_steps`: the steps of a block (default: the archive's `block_steps`, about 32
        MiB of whole shards). Make it a multiple of `shard_steps`, or shards are read twice.
    - `pool_blocks`: blocks per group: the windows of a batch come from this many random
        places of the archive; the memory grows with it.
    - `prefetch`: batches made ahead of the learner.
    - `epochs`: the number of epochs to deliver, or None (the default) for no end.
    - `position`: a [`equibuffer.LoaderPosition`][] (or its tuple) to resume from.
    - `device`: where the batches go (a device or a sharding; default the default device).

    A bad argument, a missing leaf or an archive without one valid window raises here,
    before any thread starts. Iterating starts the threads (once per loader); `close()`, the
    end of a `with` block or of the iteration (`break` included) stops them and frees the
    blocks. `position` is where the next batch starts.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp, numpy as np, tempfile

        buffer = eb.ItemBuffer({"t": jnp.int32(0)}, add_batch_size=2, capacity=128)
        buffer = buffer.add({"t": jnp.tile(jnp.arange(64, dtype=jnp.int32), (2, 1))})
        with eb.Archive(tempfile.mkdtemp() + "/run.zarr", buffer) as archive:
            archive.write(buffer)
            seen = []
            with eb.ArchiveLoader(archive, jax.random.key(0), batch_size=16,
                                  sequence_length=4, block_steps=16, pool_blocks=2,
                                  epochs=1) as loader:
                for batch in loader:
                    t = batch.experience["t"]          # (16, 4) on the device
                    assert (t == batch.starts[:, None] + jnp.arange(4)[None])[batch.mask].all()
                    seen += [(int(r), int(s)) for r, s, m in
                             zip(batch.rows, batch.starts, batch.mask) if m]
        assert sorted(seen) == [(r, s) for r in range(2) for s in range(61)]  # once each
        ```
    """

    def __init__(
        self,
        source: Archive | ArchiveSet,
        key: Seed,
        batch_size: int,
        *,
        sequence_length: int | None = None,
        period: int = 1,
        view: Literal["window", "transition"] = "window",
        n_step: int | None = None,
        discount: float | None = None,
        reward: str = "reward",
        terminated: str = "terminated",
        truncated: str | None = "truncated",
        episode_end: str | None = None,
        frames: Frames | None = None,
        block_steps: int | None = None,
        pool_blocks: int = 4,
        prefetch: int = 2,
        epochs: int | None = None,
        position: LoaderPosition | tuple[int, int, int] | None = None,
        device: Any = None,
    ):
        where = "ArchiveLoader()"
        if isinstance(source, Archive):
            archives, offsets = [source], [0]
        elif isinstance(source, ArchiveSet):
            archives, offsets = list(source.archives), [int(o) for o in source.offsets[:-1]]
        else:
            raise TypeError(
                f"{where}: `source` must be an eb.Archive or an eb.ArchiveSet, got "
                f"{type(source).__name__}."
            )
        self._readers: list[Reader] = [a._reader for a in archives]
        self._offsets = offsets
        reader = self._readers[0]
        layout = reader.layout
        self.batch_size = check_positive_int(where, "batch_size", batch_size)
        self.period = check_positive_int(where, "period", period)
        self.pool_blocks = check_positive_int(where, "pool_blocks", pool_blocks)
        self.prefetch = check_positive_int(where, "prefetch", prefetch)
        self.block_steps = (
            layout.block_steps
            if block_steps is None
            else check_positive_int(where, "block_steps", block_steps)
        )
        self.epochs = None if epochs is None else check_positive_int(where, "epochs", epochs)
        # What the device holds: 64-bit leaves (an imported data set's float64 rewards, int64
        # actions) arrive in JAX's dtypes, 32-bit unless x64 is on.
        zeros = [np.zeros(leaf.shape, jax_dtype(leaf.dtype)) for leaf in layout.leaves]
        example = reader.unflatten(zeros)
        self._view = self._make_view(
            where, example, view, sequence_length, n_step, discount, reward, terminated,
            truncated,
        )  # fmt: skip
        self.window = (
            check_positive_int(where, "sequence_length", sequence_length)
            if self._view is None
            else self._view.window_length
        )
        self._end = None
        if episode_end is not None:
            names = [leaf.name for leaf in layout.leaves]
            paths = [leaf.path for leaf in layout.leaves]
            quoted = f"[{episode_end!r}]"
            if not isinstance(episode_end, str) or (
                episode_end not in names and quoted not in paths
            ):
                raise ValueError(
                    f"{where}: `episode_end={episode_end!r}` names no leaf of the archive "
                    f"(its leaves: {', '.join(paths)}); name its boolean episode-end leaf."
                )
            i = paths.index(quoted) if quoted in paths else names.index(episode_end)
            leaf = layout.leaves[i]
            if leaf.dtype != "bool" or leaf.shape != ():
                raise TypeError(
                    f"{where}: the episode-end leaf {leaf.path} must be a 0-d bool per step, "
                    f"got {leaf.dtype} of shape {leaf.shape}."
                )
            self._end = i
        self._frames: Frames | None = None
        self._frame_end = -1
        frames = as_frames(where, frames)
        if frames is not None:
            self._frames = frames.for_stored(where, example, episode_end)
            if not isinstance(self._frames.episode_end, str):
                raise TypeError(
                    f"{where}: the loader's frames read their episode ends from a leaf: give "
                    "`episode_end=` the name of the archive's 0-d bool episode-end leaf."
                )
            self._frame_end = leaf_position(example, self._frames.episode_end)
            if self._view is None:  # (the stacks of each window's steps)
                self._view = WindowView(self.window)
        self.lookback = 0 if self._frames is None else self._frames.lookback
        self._words = [int(w) for w in generator(where, key).integers(0, 2**32, 4)]
        self._blocks = self._plan()
        self.num_windows = int(
            sum(len(b.starts) * self._readers[b.member].layout.rows for b in self._blocks)
        )
        if self.num_windows == 0:
            raise ValueError(
                f"{where}: no window of {self.window} steps (period={self.period}) fits in "
                f"the archive (committed lengths {[r.commit.length for r in self._readers]}); "
                "write more or shorten the window."
            )
        self.groups_per_epoch = -(-len(self._blocks) // self.pool_blocks)
        start = LoaderPosition(0, 0, 0) if position is None else self._check_position(position)
        self._position = start
        self._device = device
        self._template: RingStorage | None = None
        if self._view is not None:
            # With frames, each row holds a window and the `k - 1` steps before it.
            length = self.window + self.lookback
            stacked = example if self._frames is None else self._frames.stacked(example)
            self._template = RingStorage(
                stacked, rows=self.batch_size, length=length, frames=self._frames
            )
            self._template = self._template.with_counters(head=0, fill=length, steps_added=length)
        self._stop = threading.Event()
        self._slots = threading.Semaphore(2)  # groups resident: drawn from, and read ahead
        self._groups: queue.Queue = queue.Queue()
        self._batches: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._threads: list[threading.Thread] = []
        self._started = False

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _make_view(
        where: str,
        example: Any,
        view: Any,
        sequence_length: Any,
        n_step: Any,
        discount: Any,
        reward: str,
        terminated: str,
        truncated: str | None,
    ) -> AbstractView | None:
        """The buffers' view for `view` (None: the windows themselves)."""
        if view == "window":
            if n_step is not None or discount is not None:
                raise ValueError(
                    f"{where}: `n_step` and `discount` are for view='transition'; windows "
                    "take `sequence_length`."
                )
            if sequence_length is None:
                raise TypeError(f"{where}: view='window' needs `sequence_length`.")
            return None
        if view != "transition":
            raise ValueError(f"{where}: `view` must be 'window' or 'transition', got {view!r}.")
        if sequence_length is not None:
            raise ValueError(
                f"{where}: view='transition' spans 2 steps (n_step + 1 with `n_step`): drop "
                "`sequence_length`."
            )
        if n_step is None:
            if discount is not None:
                raise ValueError(f"{where}: `discount` needs `n_step` (n-step transitions).")
            return PairView()
        n = check_n_step(where, n_step)
        d = check_discount(where, 1.0 if discount is None else discount)
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
        check_leaves(where, structs, reward, terminated, truncated)
        return NStepView(n, d, reward, terminated, truncated)

    def _plan(self) -> list[_Block]:
        """Every block with at least one window valid by the counters, in archive order."""
        blocks = []
        size, window = self.block_steps, self.window
        b = self.lookback
        for m, reader in enumerate(self._readers):
            n = reader.commit.length
            segments = reader.commit.segments()
            fresh = reader.commit.source_step(0) == 0 if n else False
            for lo in range(0, n, size):
                hi = min(lo + size, n)
                starts = _valid_starts(segments, lo, hi, window, self.period)
                if b and len(starts):
                    starts = starts[stacks_held(segments, starts, b, fresh)]
                if len(starts):
                    read_first = max(0, lo - b)
                    blocks.append(_Block(m, lo, hi, int(starts[-1]) + window, starts, read_first))
        return blocks

    def _check_position(self, position: Any) -> LoaderPosition:
        where = "ArchiveLoader()"
        try:
            epoch, group, offset = (int(x) for x in position)
        except (TypeError, ValueError):
            raise TypeError(
                f"{where}: `position` must be a LoaderPosition (or its 3 ints), got {position!r}."
            ) from None
        if epoch < 0 or not 0 <= group < self.groups_per_epoch or offset < 0:
            raise ValueError(
                f"{where}: `position` {tuple(position)} is not a position of this loader "
                f"({self.groups_per_epoch} groups per epoch); pass the `position` a loader "
                "with the same arguments gave."
            )
        if self.epochs is not None and epoch >= self.epochs:
            raise ValueError(
                f"{where}: `position` is in epoch {epoch}, past the {self.epochs} epochs asked."
            )
        return LoaderPosition(epoch, group, offset)

    # ------------------------------------------------------------------- properties

    @property
    def position(self) -> LoaderPosition:
        """Where the next batch starts (after the last batch delivered)."""
        return self._position

    @property
    def resident_bytes(self) -> int:
        """The most bytes of data the loader holds on the host: two groups of blocks (with
        their halos, and with frames the `k - 1` steps before them) and `prefetch + 2`
        batches."""
        layout = self._readers[0].layout
        step = sum(leaf.step_bytes for leaf in layout.leaves)
        rows = max(r.layout.rows for r in self._readers)
        block = rows * (self.block_steps + self.window - 1 + self.lookback) * step
        batch = self.batch_size * (self.window + self.lookback) * step
        return 2 * self.pool_blocks * block + (self.prefetch + 2) * batch

    def __repr__(self) -> str:
        return (
            f"ArchiveLoader({len(self._readers)} archive(s), {self.num_windows} windows of "
            f"{self.window} steps, {len(self._blocks)} blocks of {self.block_steps} steps, "
            f"batch_size={self.batch_size}, position={tuple(self._position)})"
        )

    # ----------------------------------------------------------------- the law, host side

    def _rng(self, *tags: int) -> np.random.Generator:
        return np.random.default_rng([*self._words, *tags])

    def _order(self, epoch: int) -> np.ndarray:
        """The blocks of `epoch` in their random order."""
        return self._rng(0, epoch).permutation(len(self._blocks))

    def _read_group(self, epoch: int, index: int, order: np.ndarray) -> _Group:
        """Read the blocks of group `index` and put its valid windows in a random order."""
        ids = order[index * self.pool_blocks : (index + 1) * self.pool_blocks]
        data, blk, row, start = [], [], [], []
        for j, b in enumerate(ids.tolist()):
            block = self._blocks[b]
            reader = self._readers[block.member]
            first = block.read_first
            steps = block.read_stop - first
            outs = [
                np.empty((reader.layout.rows, steps, *leaf.shape), np.dtype(leaf.stored))
                for leaf in reader.layout.leaves
            ]
            if first < block.first:  # the frames' look-back: only the chunks its steps touch
                back = [o[:, : block.first - first] for o in outs]
                reader.read_raw(first, block.first, slice(None), back, whole=False)
            main = min(block.stop, block.read_stop)
            reader.read_raw(
                block.first,
                main,
                slice(None),
                [o[:, block.first - first : main - first] for o in outs],
            )
            if block.read_stop > main:  # the halo: only the chunks its steps touch
                halo = [o[:, main - first :] for o in outs]
                reader.read_raw(main, block.read_stop, slice(None), halo, whole=False)
            rows = reader.layout.rows
            local = block.starts - first
            valid = np.ones((rows, len(local)), bool)
            if self._end is not None:
                ends = outs[self._end].view(np.bool_)
                before = np.zeros((rows, steps + 1), np.int32)
                np.cumsum(ends, axis=1, out=before[:, 1:])
                valid = before[:, local + self.window - 1] == before[:, local]
            r, k = np.nonzero(valid)
            data.append(outs)
            blk.append(np.full(len(r), j, np.int32))
            row.append(r.astype(np.int32))
            start.append(block.starts[k])
        blk_a, row_a, start_a = (np.concatenate(x) for x in (blk, row, start))
        perm = self._rng(1, epoch, index).permutation(len(blk_a))
        return _Group(epoch, index, ids, data, blk_a[perm], row_a[perm], start_a[perm])

    # ---------------------------------------------------------------------- threads

    def _wait(self, acquire: Any) -> bool:
        """Call `acquire(timeout)` until it succeeds (True) or the loader stops (False)."""
        while not self._stop.is_set():
            if acquire(_POLL):
                return True
        return False

    def _put(self, q: queue.Queue, item: Any) -> bool:
        def put(timeout: float) -> bool:
            try:
                q.put(item, timeout=timeout)
                return True
            except queue.Full:
                return False

        return self._wait(put)

    def _read_loop(self) -> None:
        """Reader thread: the groups in the law's order, at most two resident."""
        epoch, index = self._position.epoch, self._position.group
        try:
            while self.epochs is None or epoch < self.epochs:
                order = self._order(epoch)
                while index < self.groups_per_epoch:
                    if not self._wait(lambda t: self._slots.acquire(timeout=t)):
                        return
                    if not self._put(self._groups, self._read_group(epoch, index, order)):
                        return
                    index += 1
                epoch, index = epoch + 1, 0
            self._put(self._groups, _DONE)
        except BaseException as e:  # handed to the learner's thread, raised there
            self._put(self._groups, e)

    def _get(self, q: queue.Queue) -> Any:
        """The next item of `q`, or `_DONE` once the loader stops."""
        got: list = []

        def get(timeout: float) -> bool:
            try:
                got.append(q.get(timeout=timeout))
                return True
            except queue.Empty:
                return False

        return got[0] if self._wait(get) else _DONE

    def _batch_loop(self) -> None:
        """Batcher thread: batches cut from the groups, copied to the device, viewed."""
        try:
            self._make_batches()
            self._put(self._batches, _DONE)
        except BaseException as e:
            self._put(self._batches, e)

    def _make_batches(self) -> None:
        layout = self._readers[0].layout
        bs, window = self.batch_size, self.window
        skip = self._position.offset
        fill, outs, rows, starts, epoch_windows = 0, None, None, None, 0
        while True:
            group = self._get(self._groups)
            if group is _DONE:
                return
            if isinstance(group, BaseException):
                raise group
            count, o = len(group.block), min(skip, len(group.block))
            skip = 0
            epoch_windows += count
            while o < count:
                if outs is None:
                    outs = [
                        np.zeros((bs, window + self.lookback, *leaf.shape), np.dtype(leaf.stored))
                        for leaf in layout.leaves
                    ]
                    rows, starts = np.full(bs, -1, np.int64), np.full(bs, -1, np.int64)
                k = min(bs - fill, count - o)
                self._gather(group, o, o + k, outs, fill)
                assert rows is not None and starts is not None
                rows[fill : fill + k] = self._global_rows(group, o, o + k)
                starts[fill : fill + k] = group.start[o : o + k]
                fill, o = fill + k, o + k
                if fill == bs:
                    after = self._after(group, o, count)
                    if not self._emit(outs, rows, starts, fill, after):
                        return
                    fill, outs = 0, None
            last, epoch = group.index == self.groups_per_epoch - 1, group.epoch
            del group
            self._slots.release()
            if last:
                if epoch_windows == 0:
                    raise ValueError(
                        f"ArchiveLoader: no window of {window} steps lies inside one episode "
                        "(no episode end before its last step) anywhere in the archive; "
                        "shorten the window."
                    )
                if fill:
                    assert outs is not None
                    after = LoaderPosition(epoch + 1, 0, 0)
                    if not self._emit(outs, rows, starts, fill, after):
                        return
                    fill, outs = 0, None
                epoch_windows = 0

    def _global_rows(self, group: _Group, a: int, b: int) -> np.ndarray:
        members = np.array([self._blocks[i].member for i in group.ids.tolist()], np.int64)
        offsets = np.asarray(self._offsets, np.int64)
        return offsets[members[group.block[a:b]]] + group.row[a:b]

    def _after(self, group: _Group, o: int, count: int) -> LoaderPosition:
        """The position after window `o` of `group` (of `count`)."""
        if o < count:
            return LoaderPosition(group.epoch, group.index, o)
        if group.index + 1 < self.groups_per_epoch:
            return LoaderPosition(group.epoch, group.index + 1, 0)
        return LoaderPosition(group.epoch + 1, 0, 0)

    def _gather(self, group: _Group, a: int, b: int, outs: list, fill: int) -> None:
        """Windows `a` to `b` of `group` into `outs[leaf][fill:]`."""
        blk, row, start = group.block[a:b], group.row[a:b], group.start[a:b]
        steps = np.arange(-self.lookback, self.window)  # (with frames, the look-back first)
        for j in np.unique(blk).tolist():
            sel = np.flatnonzero(blk == j)
            first = self._blocks[int(group.ids[j])]
            r = row[sel][:, None]
            t = (start[sel] - first.read_first)[:, None] + steps
            before = t < 0  # (steps before the first ever: the archive's first episode starts)
            t = np.maximum(t, 0)
            for i, (out, data) in enumerate(zip(outs, group.data[j], strict=True)):
                out[fill + sel] = data[r, t]
                if i == self._frame_end and before.any():
                    out[fill + sel] |= before.reshape(*before.shape, *(1,) * (out.ndim - 2))

    def _emit(self, outs: list, rows: Any, starts: Any, fill: int, after: LoaderPosition) -> bool:
        """One batch to the device, the view applied; False when the loader stopped."""
        tree = self._readers[0].unflatten(outs)
        mask = np.arange(self.batch_size) < fill
        host = (tree, rows.astype(np.int32), starts.astype(np.int32), mask)
        experience, rows_d, starts_d, mask_d = jax.device_put(host, self._device)
        if self._view is not None and self._template is not None:
            experience = _apply(self._view, self._template, experience)
        batch = LoaderBatch(experience, rows_d, starts_d, mask_d)
        jax.block_until_ready(batch)
        return self._put(self._batches, (batch, after))

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[LoaderBatch]:
        if self._started:
            raise RuntimeError(
                "ArchiveLoader: a loader iterates once; make a new one with "
                "`position=loader.position` to go on."
            )
        self._started = True
        self._threads = [
            threading.Thread(target=self._read_loop, name="equibuffer-loader-read", daemon=True),
            threading.Thread(target=self._batch_loop, name="equibuffer-loader-batch", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self._generate()

    def _generate(self) -> Iterator[LoaderBatch]:
        try:
            while True:
                item = self._get(self._batches)
                if isinstance(item, BaseException):
                    raise item
                if item is _DONE:
                    return
                batch, self._position = item
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads and free what they hold (idempotent)."""
        self._stop.set()
        for t in self._threads:
            t.join()
        self._threads = []
        for q in (self._groups, self._batches):
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break

    def __enter__(self) -> "ArchiveLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_threads", None):
            self.close()


@eqx.filter_jit
def jax_dtype(dtype: Any) -> np.dtype:
    """The dtype JAX gives an array of `dtype` (float64 is float32 unless x64 is on)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def _apply(view: AbstractView, template: RingStorage, windows: Any) -> Any:
    """The view of `windows` (leaves `(batch, window, *leaf)`), by the buffers' own code: a
    ring of `batch` rows of `window` steps holding them, each row one window."""
    ring = eqx.tree_at(lambda s: s.data, template, windows)
    indices = jnp.arange(template.rows, dtype=jnp.int32) * template.length + template.lookback
    return view.gather(ring, indices, None)
