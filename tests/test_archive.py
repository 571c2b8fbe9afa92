"""Tests of the zarr v3 `Archive`. The behaviour tests take a `location` fixture; here it is a
local directory or an in-memory zarr store, and `test_archive_s3.py` reruns them on S3."""

import atexit
import concurrent.futures
import dataclasses
import functools
import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

import equibuffer as eb
from equibuffer._archive import (
    Archive,
    ArchiveLockedError,
    ring_holding,
    StepsLostError,
    StepsLostWarning,
)
from equibuffer._archive._sampler import generator
from equibuffer._archive._store import LOCK_KEY, Objects, open_store, s3_options

from .archive_writer import example, MAX_LENGTH, ROWS, values
from .helpers import chi_square_pvalue


@dataclasses.dataclass
class Location:
    store: Any
    options: dict | None = None
    shard_steps: int | None = None
    rounds: int = 8  # writes in the loops of the longer tests (fewer on S3: slow requests)

    def open(self, like: Any = None, **kwargs: Any) -> Archive:
        kwargs.setdefault("progress", False)
        kwargs.setdefault("chunk_steps", 4)
        kwargs.setdefault("shard_steps", self.shard_steps)
        return Archive(self.store, like, storage_options=self.options, **kwargs)


@pytest.fixture(params=["dir", "memory", "unsharded", "zarr-path"])
def location(request, tmp_path, monkeypatch) -> Location:
    """A directory with the default shards (one shard), a memory store with shards of 8 steps
    (many shards, 2 chunks each), a directory with one object per chunk (no shards), or a
    directory with shards of 8 steps read and written through zarr's own path (the reference
    the archive's own chunk and shard I/O is tested against)."""
    if request.param == "dir":
        return Location(str(tmp_path / "run.zarr"))
    if request.param == "unsharded":
        return Location(str(tmp_path / "run.zarr"), shard_steps=0)
    if request.param == "zarr-path":
        monkeypatch.setattr(Archive, "_direct_io", False)
        return Location(str(tmp_path / "run.zarr"), shard_steps=8, rounds=4)
    return Location(zarr.storage.MemoryStore(), shard_steps=8)


def new_buffer(rows: int = ROWS, max_length_time_axis: int = MAX_LENGTH) -> eb.TrajectoryBuffer:
    return eb.TrajectoryBuffer(
        example(), add_batch_size=rows, max_length_time_axis=max_length_time_axis, sequence_length=2
    )


def add(buffer: eb.TrajectoryBuffer, count: int) -> eb.TrajectoryBuffer:
    """`buffer` after adding the next `count` steps of `values`: the ring state built
    directly, as `buffer.add` leaves it (checked in
    `test_ring_holding_matches_a_ring_that_saw_every_step`), with nothing compiled per count;
    `real_add` goes through `buffer.add`."""
    storage = buffer.storage
    total = storage.steps_added() + count
    held = min(total, storage.length)
    data = jax.tree.leaves(values(buffer.add_batch_size, total - held, held))
    return eqx.tree_at(lambda b: b.storage, buffer, ring_holding(storage, data, total))


def real_add(buffer: eb.TrajectoryBuffer, count: int) -> eb.TrajectoryBuffer:
    batch = values(buffer.add_batch_size, buffer.storage.steps_added(), count)
    return buffer.add({k: jnp.asarray(v) for k, v in batch.items()})


def expected(first: int, stop: int, rows: int = ROWS) -> dict:
    return values(rows, first, stop - first)


def assert_tree_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ------------------------------------------------------------------------------- behaviour


def test_write_appends_exactly_the_new_steps(location):
    buffer = new_buffer()
    rng = np.random.default_rng(0)
    with location.open(buffer) as archive:
        total = 0
        for _ in range(location.rounds):
            n = int(rng.integers(1, MAX_LENGTH + 1))
            buffer = add(buffer, n)
            total += n
            assert archive.write(buffer) == n
            assert archive.write(buffer) == 0  # nothing new: nothing written twice
            assert len(archive) == archive.source_steps == total
        assert_tree_equal(archive.read(), expected(0, total))
        assert total > 17
        assert_tree_equal(archive.read(5, 17), expected(5, 17))
        assert_tree_equal(archive.read(-3), expected(total - 3, total))
        one = archive.read(2, 9, rows=[1])
        np.testing.assert_array_equal(one["obs"], expected(2, 9)["obs"][1:])
        assert one["flag"].dtype == ml_dtypes.bfloat16  # stored as uint16, read back as it was


def test_full_ring_is_written_and_one_more_is_lost(location):
    buffer = new_buffer()
    with location.open(buffer) as archive:
        buffer = add(buffer, 3)
        archive.write(buffer)
        buffer = add(buffer, MAX_LENGTH)  # exactly a full ring of new steps
        assert archive.write(buffer) == MAX_LENGTH
        assert_tree_equal(archive.read(), expected(0, 3 + MAX_LENGTH))
        buffer = add(buffer, MAX_LENGTH + 5)  # 5 steps overwritten before being written
        with pytest.raises(StepsLostError, match="5 of the 29 steps"):
            archive.write(buffer)
        assert len(archive) == 3 + MAX_LENGTH  # nothing written
        with pytest.warns(StepsLostWarning, match="5 of the 29 steps"):
            assert archive.write(buffer, on_lost="warn") == MAX_LENGTH
        n = 3 + 2 * MAX_LENGTH
        assert len(archive) == n and archive.source_steps == n + 5 and archive.steps_lost == 5
        assert archive.segments == [(0, 3 + MAX_LENGTH), (3 + MAX_LENGTH, n)]
        assert archive.source_step(3 + MAX_LENGTH) == 3 + MAX_LENGTH + 5
        assert_tree_equal(archive.read(3 + MAX_LENGTH), expected(3 + MAX_LENGTH + 5, n + 5))
        # Windows never cross the gap; loading across it is refused.
        s = archive.sample(np.random.default_rng(1), 500, 4)
        gap = 3 + MAX_LENGTH
        assert not np.any((s.starts < gap) & (s.starts + 4 > gap))
        np.testing.assert_array_equal(
            s.experience["obs"][:, :, 0] % 100_000,
            np.vectorize(archive.source_step)(s.starts[:, None] + np.arange(4)),
        )
        with pytest.raises(ValueError, match="cross a gap"):
            archive.load(new_buffer(), gap - 2, gap + 2)


def test_first_write_after_the_ring_wrapped_is_not_silent(location):
    buffer = add(new_buffer(), MAX_LENGTH + 10)
    with location.open(buffer, on_lost="warn") as archive:
        with pytest.warns(StepsLostWarning, match="10 of the 34"):
            archive.write(buffer)
        assert archive.segments == [(0, MAX_LENGTH)] and archive.source_step(0) == 10
        assert_tree_equal(archive.read(), expected(10, MAX_LENGTH + 10))


def test_reopen_continues_and_restore_resumes(location):
    buffer = add(new_buffer(), 30)
    with location.open(buffer) as archive:
        archive.write(add(new_buffer(), 7))
        assert_tree_equal(archive.read(), expected(0, 7))
    # The count lives on disk: a reopened archive continues where it stopped.
    with location.open(buffer) as archive:
        assert archive.source_steps == 7
        with pytest.raises(StepsLostError):  # 32 - 7 = 25 new steps, the ring holds 24
            archive.write(add(buffer, 2))
        assert archive.write(buffer) == 23
        assert_tree_equal(archive.read(), expected(0, 30))
    # Resuming a run: a fresh buffer restored from the archive writes nothing twice.
    with location.open(buffer) as archive:
        fresh = new_buffer()
        with pytest.raises(
            ValueError,
            match=r"count of steps added is 3, but the archive already holds the source up to "
            r"step 30; resume a run with `buffer = archive.restore\(buffer\)`",
        ):
            archive.write(add(fresh, 3))
        restored = archive.restore(fresh)
        st = restored.storage
        assert st.steps_added() == 30 and int(st.fill) == MAX_LENGTH
        assert int(st.head) == int(buffer.storage.head) and archive.write(restored) == 0
        for a, b in zip(
            jax.tree.leaves(st.data), jax.tree.leaves(buffer.storage.data), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert archive.write(add(restored, 5)) == 5
        assert_tree_equal(archive.read(), expected(0, 35))


def test_schema_mismatch_names_the_leaves(location):
    location.open(new_buffer()).close()
    other = eb.TrajectoryBuffer(
        {"obs": jnp.zeros(5, jnp.float32), "flag": jnp.zeros((), jnp.float32), "x": jnp.int32(0)},
        add_batch_size=3,
        max_length_time_axis=8,
        sequence_length=1,
    )
    with pytest.raises(ValueError) as info:
        location.open(other)
    msg = str(info.value)
    assert "rows: the archive has 2, the buffer has add_batch_size=3" in msg
    assert "leaf ['obs']: shape (4,) in the archive, (5,) in the buffer" in msg
    assert "leaf ['flag']: dtype bfloat16 in the archive, float32 in the buffer" in msg
    assert "leaves in the buffer but not in the archive: ['x']" in msg
    # A failed open releases the lock it took.
    location.open(new_buffer()).close()


def test_out_of_range_reads_are_clear_errors(location):
    with location.open(new_buffer()) as archive:
        archive.write(add(new_buffer(), 10))
        with pytest.raises(IndexError, match=r"steps \[5, 11\) are out of range: the archive "):
            archive.read(5, 11)
        with pytest.raises(IndexError, match="holds 10 committed steps"):
            archive.read(-11)
        with pytest.raises(IndexError, match="rows"):
            archive.read(rows=[2])
        with pytest.raises(ValueError, match="no window of sequence_length=11"):
            archive.sample(0, 4, 11)
        with pytest.raises(ValueError, match="do not fit in the buffer's max_length_time_axis=4"):
            archive.load(new_buffer(max_length_time_axis=4), 0, 10)


def test_one_writer_at_a_time_any_number_of_readers(location):
    buffer = add(new_buffer(), 6)
    writer = location.open(buffer)
    with pytest.raises(ArchiveLockedError, match="already open for writing by process"):
        location.open(buffer)
    readers = [location.open(mode="r") for _ in range(3)]
    writer.write(buffer)
    for reader in readers:
        assert len(reader) == 0  # a snapshot: the committed state when it was opened
        assert reader.refresh() == 6
        assert_tree_equal(reader.read(), expected(0, 6))
    # A stale lock (its writer gone elsewhere) can be broken explicitly.
    second = location.open(buffer, break_lock=True)
    with pytest.raises(ArchiveLockedError, match="lock on .* was broken"):
        writer.write(add(buffer, 1))
    second.close()
    with pytest.raises(PermissionError, match="closed"):
        second.write(buffer)
    writer.close()
    location.open(buffer).close()


def test_read_only_opening(location):
    with location.open(new_buffer()) as archive:
        archive.write(add(new_buffer(), 4))
    reader = location.open(mode="r")
    with pytest.raises(PermissionError, match="mode='r'"):
        reader.write(add(new_buffer(), 5))
    assert_tree_equal(reader.read(), expected(0, 4))  # a dict by leaf name without `like`
    with pytest.raises(FileNotFoundError, match="no archive"):
        Archive(zarr.storage.MemoryStore(), mode="r")


def test_committed_steps_never_change_while_a_reader_reads(location):
    buffer = new_buffer()
    writer = location.open(buffer)
    reader = location.open(mode="r")
    seen: list[np.ndarray] = []
    counts = (5, 13, 24, 3, 17)[: max(3, location.rounds)]
    for n in counts:
        buffer = add(buffer, n)
        writer.write(buffer)
        reader.refresh()
        obs = reader.read()["obs"]
        for old in seen:  # every committed prefix stays exactly as it was
            np.testing.assert_array_equal(obs[:, : old.shape[1]], old)
        seen.append(obs)
    assert seen[-1].shape[1] == sum(counts)
    writer.close()


def test_sampling_is_uniform_over_valid_windows(location):
    seq, period = 3, 2
    with location.open(new_buffer()) as archive:
        buffer = new_buffer()
        for n in (9, 8):
            buffer = add(buffer, n)
            archive.write(buffer)
        rng = np.random.default_rng(0)
        starts_ok = [s for s in range(0, 17 - seq + 1) if s % period == 0]
        counts = np.zeros((ROWS, 17), np.int64)
        for _ in range(location.rounds // 2):  # (fewer through zarr's own path: slow)
            s = archive.sample(rng, 2000, seq, period=period)
            np.add.at(counts, (s.rows, s.starts), 1)
            # Each window holds the right steps of the right row, across chunk boundaries.
            steps = s.starts[:, None] + np.arange(seq)
            np.testing.assert_array_equal(
                s.experience["obs"][:, :, 0], s.rows[:, None] * 100_000 + steps
            )
        probs = np.zeros((ROWS, 17))
        probs[:, starts_ok] = 1.0
        assert chi_square_pvalue(counts.ravel(), probs.ravel()) > 1e-3
        only = archive.sample(rng, 50, seq, rows=[1])
        assert np.all(only.rows == 1)


def test_iterate_in_chunks(location):
    with location.open(new_buffer()) as archive:
        archive.write(add(new_buffer(), 21))
        blocks = list(archive.iter(5, start=2))
        assert [a for a, _ in blocks] == [2, 7, 12, 17]
        obs = np.concatenate([b["obs"] for _, b in blocks], axis=1)
        np.testing.assert_array_equal(obs, expected(2, 21)["obs"])


def test_load_into_a_trajectory_buffer_for_offline_training(location, getkey):
    with location.open(new_buffer()) as archive:
        buffer = new_buffer()
        for _ in range(2):
            buffer = real_add(buffer, 20)  # a real buffer's add, end to end
            archive.write(buffer)
        offline = eb.TrajectoryBuffer(
            example(), add_batch_size=1, max_length_time_axis=16, sequence_length=4
        )
        offline = archive.load(offline, 22, 38, rows=[1])
        assert offline.storage.steps_added() == 38 and int(offline.storage.fill) == 16
        sample = offline.sample(getkey(), 64)
        obs = np.asarray(sample.experience["obs"][:, :, 0])
        first = obs[:, :1] - 100_000
        assert np.all((first >= 22) & (first <= 34))
        np.testing.assert_array_equal(obs - obs[:, :1], np.broadcast_to(np.arange(4), (64, 4)))
        np.testing.assert_array_equal(np.asarray(sample.steps), first[:, 0].astype(np.uint32))


def put_lock(store: Any, pid: int, host: str) -> bytes:
    """Write the one-writer lock document as process `pid` on `host` would hold it (another
    writer's, as far as this process is concerned); returns its bytes."""
    lock = {"token": "t", "pid": pid, "host": host, "since": "then"}
    raw = json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {"equibuffer_lock": lock}}
    ).encode()
    sync(store.set(LOCK_KEY, default_buffer_prototype().buffer.from_bytes(raw)))
    return raw


def test_the_lock_is_a_conditional_put(location):
    """Another host's writer holds the archive: a writer's lock request (a put that creates
    the lock object only if there is none) fails, and the other lock stays as it was. A
    plain put would have replaced it, and the second writer would have taken the lock."""
    location.open(new_buffer()).close()
    store = open_store(location.store, location.options, read_only=False)
    raw = put_lock(store, pid=1, host="elsewhere")
    with pytest.raises(ArchiveLockedError, match="process 1 on host 'elsewhere'"):
        location.open(new_buffer())
    held = sync(store.get(LOCK_KEY, prototype=default_buffer_prototype()))
    assert held is not None and held.to_bytes() == raw
    location.open(new_buffer(), break_lock=True).close()  # once sure that writer is gone


def test_a_killed_writer_not_yet_reaped_leaves_a_stale_lock(tmp_path):
    """A writer killed by its launcher stays a zombie until the launcher reaps it: it answers
    `os.kill(pid, 0)`, but its lock is stale and a new writer on the same host takes it."""
    path = str(tmp_path / "run.zarr")
    Archive(path, new_buffer(), progress=False).close()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_bytes().split(b") ")[-1][:1] != b"Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still answers: not reaped
        store = open_store(path, None, read_only=False)
        put_lock(store, pid=child.pid, host=socket.gethostname())
        with Archive(path, new_buffer(), progress=False) as archive:  # the stale lock broken
            archive.write(add(new_buffer(), 3))
        assert len(Archive(path, mode="r", progress=False)) == 3
    finally:
        child.wait()
    # A live process of this host keeps its lock.
    put_lock(store, pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(ArchiveLockedError, match=f"process {os.getpid()} on host"):
        Archive(path, new_buffer(), progress=False)


# ---------------------------------------------------------------------------- local only


def test_ring_holding_matches_a_ring_that_saw_every_step():
    for total in (0, 3, 7, 8, 9, 30):
        ring = eb.RingStorage({"x": jnp.zeros(2, jnp.int32)}, rows=2, length=8)
        seen = ring
        if total:
            steps = np.arange(total, dtype=np.int32)
            seen = ring.write({"x": jnp.asarray(np.stack([steps, -steps], -1)[None].repeat(2, 0))})
        for k in sorted({0, min(total, 8) // 2, min(total, 8)}):
            held = np.arange(total - k, total, dtype=np.int32)
            made = ring_holding(ring, [np.stack([held, -held], -1)[None].repeat(2, 0)], total)
            assert made.steps_added() == total and int(made.head) == int(seen.head)
            assert int(made.fill) == k
            slots = (int(seen.head) - k + np.arange(k)) % 8
            np.testing.assert_array_equal(
                np.asarray(made.data["x"])[:, slots], np.asarray(seen.data["x"])[:, slots]
            )
    big = ring_holding(
        eb.RingStorage({"x": jnp.zeros(())}, rows=1, length=4), [np.zeros((1, 0))], 2**33 + 5
    )
    assert big.steps_added() == 2**33 + 5 and int(big.head) == (2**33 + 5) % 4


def test_plain_zarr_layout_readable_by_zarr_and_xarray(tmp_path):
    import xarray as xr

    path = str(tmp_path / "run.zarr")
    with Archive(path, new_buffer(), progress=False) as archive:
        archive.write(add(new_buffer(), 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(path, mode="r")
        assert sorted(name for name, _ in group.members()) == ["flag", "obs"]
        obs: Any = group["obs"]
        np.testing.assert_array_equal(obs[:], expected(0, 10)["obs"])
        ds = xr.open_zarr(path, zarr_format=3, consolidated=False)
    assert ds["obs"].dims == ("row", "time", "obs_0") and ds.sizes["time"] == 10
    np.testing.assert_array_equal(ds["obs"].values, expected(0, 10)["obs"])
    meta: Any = group.attrs["equibuffer"]
    assert meta["committed"]["length"] == 10


def test_shards_are_zarr_shards_both_ways(tmp_path):
    """Shards written here (a shard rewritten by a second write, chunks partly filled) read
    right with zarr; and shards zarr writes itself read right here."""
    path = str(tmp_path / "run.zarr")
    buffer = new_buffer()
    with Archive(path, buffer, progress=False, chunk_steps=4, shard_steps=8) as archive:
        for n in (10, 7, 9):
            buffer = add(buffer, n)
            archive.write(buffer)
        want = expected(0, 26)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            obs: Any = zarr.open_array(path, path="obs", mode="r+")
            np.testing.assert_array_equal(obs[:], want["obs"])
            obs[:, 3:21] = want["obs"][:, 3:21] + 1  # zarr rewrites shards 0 to 2 itself
        want["obs"][:, 3:21] += 1
        assert_tree_equal(Archive(path, mode="r").read(), want)
        assert_tree_equal(archive.read(), want)
        s = Archive(path, mode="r").sample(0, 64, sequence_length=5)
        for i in range(64):
            r, a = s.rows[i], s.starts[i]
            np.testing.assert_array_equal(s.experience["obs"][i], want["obs"][r, a : a + 5])


def test_zip_is_read_only(tmp_path):
    path = tmp_path / "run.zarr"
    with Archive(str(path), new_buffer(), progress=False, chunk_steps=4) as archive:
        archive.write(add(new_buffer(), 9))
    zipped = shutil.make_archive(str(tmp_path / "run"), "zip", path)
    assert_tree_equal(Archive(zipped, mode="r").read(), expected(0, 9))
    with pytest.raises(ValueError, match="zip file, which can only be opened with mode='r'"):
        Archive(zipped, new_buffer())


def test_compression_and_chunk_options(tmp_path):
    big = eb.TrajectoryBuffer(
        {"img": jnp.zeros((16, 16, 3), jnp.uint8)},
        add_batch_size=2,
        max_length_time_axis=64,
        sequence_length=1,
    )
    img = np.zeros((2, 64, 16, 16, 3), np.uint8)
    img[:, :, 4:8, 4:8] = 200  # compressible, like rendered frames
    big = big.add({"img": jnp.asarray(img)})
    ratios = {}
    for compression in ("zstd", "lz4", "none"):
        with Archive(str(tmp_path / compression), big, compression=compression) as archive:
            archive.write(big)
            ratios[compression] = archive.compression_ratio()
            np.testing.assert_array_equal(archive.read()["img"], img)
        # The chunks this module encodes are the ones zarr decodes, for every codec.
        np.testing.assert_array_equal(zarr.open_array(str(tmp_path / compression), path="img"), img)
    assert ratios["zstd"] > 10 and ratios["lz4"] > 2 and ratios["none"] < 1.1
    default = Archive(str(tmp_path / "default"), big)
    default.close()
    assert default.shard_steps is not None and default.chunk_steps >= 16
    assert default.shard_steps % default.chunk_steps == 0
    assert default.block_steps % default.chunk_steps == 0
    with pytest.raises(ValueError, match="shard_steps=6 must be a multiple of chunk_steps=4"):
        Archive(str(tmp_path / "bad"), big, chunk_steps=4, shard_steps=6)
    with pytest.raises((ValueError, TypeError), match="compression"):
        Archive(str(tmp_path / "bad2"), big, compression="gzip")  # type: ignore[arg-type]


@pytest.mark.parametrize("shard_steps", [None, 8, 0], ids=["one-shard", "shards", "unsharded"])
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_writer_continues_its_partial_chunks_as_a_reopened_one_reads_them(
    tmp_path, shard_steps, compression
):
    """Writes of a few steps: a writer keeps the partly filled chunks (and shard) its last write
    ended with and continues from them; a writer reopened before every write reads them back.
    Both leave the same objects, byte for byte, and the data added. What a writer keeps is
    its own copy: a view of the ring would keep the ring's arrays alive, and every donated
    add would then copy the whole ring instead of writing in place."""
    add_in_place = eqx.filter_jit(lambda b, batch: b.add(batch), donate="all")
    opts = dict(chunk_steps=4, shard_steps=shard_steps, compression=compression, progress=False)
    kept_path, reopened_path = tmp_path / "kept", tmp_path / "reopened"
    buffer = new_buffer()
    kept = Archive(str(kept_path), buffer, **opts)
    rng = np.random.default_rng(1)
    total = 0
    for _ in range(14):
        n = int(rng.integers(1, 7))
        batch = values(ROWS, total, n)
        ring = jax.tree.leaves(buffer.storage.data)
        buffer = add_in_place(buffer, {k: jnp.asarray(v) for k, v in batch.items()})
        assert all(x.is_deleted() for x in ring)  # donated: no archive holds a view of it
        total += n
        assert kept.write(buffer) == n
        with Archive(str(reopened_path), buffer, **opts) as reopened:
            assert reopened.write(buffer) == n
    kept.close()
    assert_tree_equal(Archive(str(kept_path), mode="r").read(), expected(0, total))
    files = sorted(p.relative_to(reopened_path) for p in reopened_path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(kept_path) for p in kept_path.rglob("*") if p.is_file())
    assert len(files) > 4
    for f in files:
        assert (kept_path / f).read_bytes() == (reopened_path / f).read_bytes(), f


def test_write_async_leaves_what_write_leaves_and_close_waits(tmp_path):
    """Background writes of a donated ring, in order, at most two behind: the same objects,
    byte for byte, as `write` in the same sequence; `close()` waits for them; nothing kept
    pins the ring."""
    add_in_place = eqx.filter_jit(lambda b, batch: b.add(batch), donate="all")
    opts = dict(chunk_steps=4, shard_steps=8, progress=False)
    paths = tmp_path / "background", tmp_path / "direct"
    buffer = new_buffer()
    background, direct = (Archive(str(p), buffer, **opts) for p in paths)
    rng = np.random.default_rng(2)
    total, sizes, futures = 0, [], []
    for _ in range(12):
        n = int(rng.integers(1, 9))
        ring = jax.tree.leaves(buffer.storage.data)
        batch = values(ROWS, total, n)
        buffer = add_in_place(buffer, {k: jnp.asarray(v) for k, v in batch.items()})
        assert all(x.is_deleted() for x in ring)  # donated: no write holds a view of it
        total += n
        sizes.append(n)
        futures.append(background.write_async(buffer))
        assert len(background) >= sum(sizes[:-2])  # never more than two writes behind
        assert direct.write(buffer) == n
    background.close()  # waits for the writes
    direct.close()
    assert [f.result() for f in futures] == sizes
    reopened = Archive(str(paths[0]), mode="r")
    assert len(reopened) == reopened.source_steps == total
    assert_tree_equal(reopened.read(), expected(0, total))
    files = sorted(p.relative_to(paths[1]) for p in paths[1].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(paths[0]) for p in paths[0].rglob("*") if p.is_file())
    for f in files:
        assert (paths[0] / f).read_bytes() == (paths[1] / f).read_bytes(), f


def test_write_async_checks_lost_steps_when_called(location):
    buffer = new_buffer()
    with location.open(buffer) as archive:
        buffer = add(buffer, 10)
        archive.write_async(buffer)  # planned up to step 10, maybe not yet committed
        buffer = add(buffer, MAX_LENGTH + 6)  # 6 of these were never planned: lost
        with pytest.raises(StepsLostError, match="6 of the 30 steps"):
            archive.write_async(buffer)
        with pytest.warns(StepsLostWarning, match="6 of the 30 steps"):
            archive.write_async(buffer, on_lost="warn")
        archive.flush()
        assert len(archive) == 10 + MAX_LENGTH and archive.steps_lost == 6
        assert_tree_equal(archive.read(10), expected(16, 16 + MAX_LENGTH))


def test_a_failed_background_write_commits_nothing_after_it(tmp_path, monkeypatch):
    buffer = add(new_buffer(), 5)
    archive = Archive(str(tmp_path / "run.zarr"), buffer, chunk_steps=4, shard_steps=8)
    archive.progress = False
    assert archive.write(buffer) == 5
    real_put = Objects.put
    go = threading.Event()

    def failing_put(self, key, parts):
        if not key.endswith("zarr.json"):  # the data: a full disk (once both are submitted)
            go.wait(30)
            raise OSError("no space left on device")
        return real_put(self, key, parts)

    monkeypatch.setattr(Objects, "put", failing_put)
    buffer = add(buffer, 3)
    first = archive.write_async(buffer)
    buffer = add(buffer, 4)
    second = archive.write_async(buffer)
    go.set()
    with pytest.raises(OSError, match="no space"):
        first.result()
    with pytest.raises(RuntimeError, match="earlier background write failed"):
        second.result()
    with pytest.raises(RuntimeError, match="background write .* failed") as info:
        archive.write_async(buffer)  # the next call reports it (flush() or close() would)
    assert isinstance(info.value.__cause__, OSError)
    archive.flush()  # reported once
    assert len(archive) == archive.source_steps == 5  # the last commit
    assert len(Archive(str(tmp_path / "run.zarr"), mode="r")) == 5
    monkeypatch.setattr(Objects, "put", real_put)
    assert archive.write(buffer) == 7  # what the ring still holds, written now
    archive.close()
    assert_tree_equal(Archive(str(tmp_path / "run.zarr"), mode="r").read(), expected(0, 12))


def test_progress_bar_can_be_shown_or_turned_off(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Archive, "_progress_delay", 0.0)
    buffer = add(new_buffer(), 20)
    for progress in (True, False):
        with Archive(str(tmp_path / str(progress)), buffer, progress=progress) as archive:
            archive.write(buffer)
            list(archive.iter(5))
        err = capsys.readouterr().err
        assert ("archive write" in err and "archive read" in err) == progress
        assert progress or err == ""


# What a Jupyter kernel without ipywidgets looks like to tqdm (`tqdm.autonotebook` checks for
# `ipykernel.zmqshell` in `sys.modules`), then `CODE`; every warning printed to stderr.
JUPYTER_WITHOUT_IPYWIDGETS = """
import sys, types, warnings
warnings.simplefilter("always")
sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")
ipython = types.ModuleType("IPython")
ipython.get_ipython = lambda: types.SimpleNamespace(config={"IPKernelApp": {}})
sys.modules["IPython"] = ipython
sys.modules["ipywidgets"] = None  # not installed
"""


def run_as_in_jupyter(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    script = JUPYTER_WITHOUT_IPYWIDGETS + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path
    )


def test_no_ipywidgets_warning_in_jupyter(tmp_path):
    """In a Jupyter kernel without ipywidgets, neither importing equibuffer nor showing an
    archive's progress bar warns "IProgress not found" (what `tqdm.auto` does there): the bar
    is tqdm's text bar."""
    control = run_as_in_jupyter("import tqdm.auto", tmp_path)
    assert control.returncode == 0, control.stderr
    assert "IProgress not found" in control.stderr  # the simulation reaches tqdm's warning
    result = run_as_in_jupyter(
        """
        import jax.numpy as jnp
        import equibuffer as eb
        assert "tqdm" not in sys.modules  # imported only when a bar is shown
        eb.Archive._progress_delay = 0.0
        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=16,
                                     sequence_length=2)
        buffer = buffer.add({"x": jnp.ones((2, 5, 2))})
        with eb.Archive("run.zarr", buffer, progress=True) as archive:
            archive.write(buffer)
            list(archive.iter(5))
        from tqdm.std import tqdm
        from equibuffer._archive._reader import progress_bar
        assert progress_bar() is tqdm
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "IProgress" not in result.stderr and "Warning" not in result.stderr, result.stderr
    assert "archive write" in result.stderr and "archive read" in result.stderr


@pytest.mark.parametrize("shard_steps", [8, 0], ids=["shards", "unsharded"])
def test_fsync_round_trip_and_commit_order(tmp_path, monkeypatch, shard_steps):
    """`fsync=True`: the data round-trips over several writes and a reopen; and in every write
    each data object it puts is flushed (as its temporary file, before the rename), then the
    leaves' metadata and the folders, then the commit (the root `zarr.json`), then the root
    folder, in that order."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = os.path.realpath(tmp_path / "run.zarr")

    def plain(path: str) -> str:  # a temporary file's path -> the key it is renamed to
        return re.sub(r"\.[0-9a-f]{12}\d+\.partial$", "", path)

    buffer = new_buffer()
    total = 0
    for _ in range(2):  # the second time reopened
        archive = Archive(
            root, buffer, chunk_steps=4, shard_steps=shard_steps, progress=False, fsync=True
        )
        for n in (3, 10, 7):
            buffer = add(buffer, n)
            calls.clear()
            archive.write(buffer)
            old, total = total, total + n
            cs, ss = 4, shard_steps or 4  # unsharded: one object per chunk of 4 steps
            keys = [
                chunks.key(r, s) if not shard_steps else chunks.shard_key(s)
                for chunks in archive._reader.io or []
                for s in range(old // ss, -(-total // ss))
                for r in (range(ROWS) if not shard_steps else [0])
            ]
            assert cs == archive.chunk_steps
            seen = [plain(c) for c in calls]
            marker = seen.index(os.path.join(root, "zarr.json"))
            assert seen[-1] == root and marker == len(seen) - 2  # the commit, then its folder
            for key in keys:  # every data object of this write, flushed before the commit
                assert os.path.join(root, key) in seen[:marker], key
            for leaf in ("obs", "flag"):  # the new shapes, and the renames into the folders
                assert seen.index(os.path.join(root, leaf, "zarr.json")) < marker
                assert seen.index(os.path.join(root, leaf)) < marker
        archive.close()
        assert_tree_equal(Archive(root, mode="r").read(), expected(0, total))
    assert not list(Path(root).rglob("*.partial"))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("shard_steps", [None, 8, 0], ids=["one-shard", "shards", "unsharded"])
@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_the_archives_own_io_writes_what_zarrs_own_path_writes(
    tmp_path, monkeypatch, shard_steps, compression
):
    """The same writes (partial chunks and shards continued by the writer, then by a reopened
    one) through the archive's own chunk and shard I/O and through zarr's own array API
    (`resize`, assignment, `update_attributes`): the same objects, byte for byte (the
    metadata documents: the same JSON)."""
    opts = dict(chunk_steps=4, shard_steps=shard_steps, compression=compression, progress=False)
    paths = {True: tmp_path / "own", False: tmp_path / "zarr"}
    buffer = new_buffer()
    archives = {}
    for direct, path in paths.items():
        monkeypatch.setattr(Archive, "_direct_io", direct)
        archives[direct] = Archive(str(path), buffer, **opts)
        assert (archives[direct]._reader.io is None) == (not direct)
    for i, n in enumerate((3, 10, 1, 7, 24, 5)):
        buffer = add(buffer, n)
        for direct, path in paths.items():
            if i == 3:  # reopened: the partial chunks and shard are read back
                archives[direct].close()
                monkeypatch.setattr(Archive, "_direct_io", direct)
                archives[direct] = Archive(str(path), buffer, **opts)
            assert archives[direct].write(buffer) == n
    for archive in archives.values():
        archive.close()
    own, reference = _files(paths[True]), _files(paths[False])
    assert sorted(own) == sorted(reference) and len(own) > 4
    for key in own:
        if key.endswith("zarr.json"):  # the same document, zarr's indented, ours compact
            assert json.loads(own[key]) == json.loads(reference[key]), key
        else:
            assert own[key] == reference[key], key
    assert_tree_equal(Archive(str(paths[True]), mode="r").read(), expected(0, 50))


def test_the_zstd_encoding_writes_numcodecs_frames_from_any_thread():
    """The archive's zstd coding (contexts kept by each thread) writes the frames numcodecs'
    `Zstd` (zarr's codec) writes, for chunks small and large, compressible and not, of every
    kind of leaf, from several threads at once; they decode to the data, into place too."""
    import numcodecs

    from equibuffer._archive._format import numcodec

    rng = np.random.default_rng(0)
    arrays = (
        [
            rng.random(n) < 0.01
            for n in (1, 16, 1024, 1 << 16)  # flags
        ]
        + [
            rng.standard_normal(n).astype(np.float32)
            for n in (3, 256, 1 << 15)  # noise
        ]
        + [
            np.tile(np.arange(16, dtype=np.uint8), 4096).reshape(64, 32, 32),  # frames
            np.zeros(1 << 20, np.uint8),
            np.arange(1 << 14, dtype=np.int64),
        ]
    )
    for level, checksum in ((1, False), (3, True)):
        zarr_codec = zarr.codecs.ZstdCodec(level=level, checksum=checksum)
        ours = numcodec(zarr_codec)
        reference = numcodecs.Zstd(level=level, checksum=checksum)
        want = [bytes(reference.encode(x)) for x in arrays]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(3):
                got = [bytes(data) for data in pool.map(ours.encode, arrays)]
                assert got == want
        for x, data in zip(arrays, want, strict=True):
            back = np.frombuffer(ours.decode(data), x.dtype).reshape(x.shape)
            np.testing.assert_array_equal(back, x)
            into = np.empty_like(x)
            ours.decode(data, out=into)
            np.testing.assert_array_equal(into, x)
            strided = np.empty((2, *x.shape), x.dtype)[1]  # a view, as a block's rows are
            ours.decode(data, out=strided)
            np.testing.assert_array_equal(strided, x)
        # A frame that does not record its decoded size (another writer's) is decoded too;
        # a chunk of another size is refused.
        import zstandard

        bare = zstandard.ZstdCompressor(level=level, write_content_size=False)
        for x in arrays:
            into = np.empty_like(x)
            ours.decode(bare.compress(x.tobytes()), out=into)
            np.testing.assert_array_equal(into, x)
        with pytest.raises(ValueError, match="decodes to 1024 bytes where 1023"):
            ours.decode(want[2], out=np.empty(1023, np.uint8))


def test_a_reader_pickles_and_reads_the_same_after(tmp_path):
    """An archive opened read-only pickles (to hand to a worker process) and, unpickled,
    reads and samples what the original does, its codecs' per-thread contexts included."""
    import pickle

    buffer = eb.TrajectoryBuffer(
        {"x": jnp.zeros(64), "t": jnp.int32(0)},
        add_batch_size=2,
        max_length_time_axis=256,
        sequence_length=2,
    )
    steps = jnp.tile(jnp.arange(256)[None], (2, 1))
    x = jnp.tile((steps % 5)[..., None], (1, 1, 64)).astype(jnp.float32)
    buffer = buffer.add({"x": x, "t": steps})
    path = str(tmp_path / "run.zarr")
    with Archive(path, buffer, progress=False) as archive:
        archive.write(buffer)
    assert _codec_of(path, "x") == "ZstdCodec"  # the codec kept: a context to leave behind
    reader = Archive(path, mode="r", progress=False)
    reader.sample(0, 4, sequence_length=2)  # the contexts made on the I/O threads
    again = pickle.loads(pickle.dumps(reader))
    assert_tree_equal(again.read(), reader.read())
    a, b = (r.sample(7, 16, sequence_length=3) for r in (reader, again))
    assert_tree_equal(a.experience, b.experience)


def test_arrays_another_tool_reencoded_are_read_and_written_through_zarr(tmp_path):
    """A leaf rewritten by another tool with a codec the archive does not encode itself
    (gzip) is read, sampled and written through zarr's own path."""
    path = str(tmp_path / "run.zarr")
    buffer = add(new_buffer(), 10)
    with Archive(path, buffer, progress=False, chunk_steps=4) as archive:
        archive.write(buffer)
    group = zarr.open_group(path, mode="r+")
    old: Any = group["obs"]
    data, attrs = old[:], dict(old.attrs)
    new = group.create_array(
        "obs",
        shape=old.shape,
        dtype=old.dtype,
        chunks=(1, 4, 4),
        compressors=zarr.codecs.GzipCodec(),
        fill_value=0,
        dimension_names=old.metadata.dimension_names,
        attributes=attrs,
        overwrite=True,
    )
    new[:] = data
    with Archive(path, new_buffer(), progress=False) as archive:
        assert archive._reader.io is None  # zarr's own path for every leaf
        assert_tree_equal(archive.read(), expected(0, 10))
        assert archive.write(add(buffer, 5)) == 5
        s = archive.sample(0, 16, 3)
        np.testing.assert_array_equal(
            s.experience["obs"][:, :, 0], s.rows[:, None] * 100_000 + s.starts[:, None] + [0, 1, 2]
        )
    assert_tree_equal(Archive(path, mode="r").read(), expected(0, 15))


def test_fsync_needs_the_archives_own_io(tmp_path, monkeypatch):
    monkeypatch.setattr(Archive, "_direct_io", False)
    with pytest.raises(ValueError, match="fsync=True is not available for .*zarr's own path"):
        Archive(str(tmp_path / "run.zarr"), new_buffer(), fsync=True)
    Archive(str(tmp_path / "run.zarr"), new_buffer()).close()  # the lock was released


class CheckThenWrite(zarr.storage.MemoryStore):
    """A store whose `set_if_not_exists` is zarr's default: it checks, then writes (as zarr's
    fsspec store does)."""

    set_if_not_exists = zarr.abc.store.Store.set_if_not_exists


def test_a_store_that_checks_then_writes_cannot_hold_the_lock():
    objects: dict = {}
    with Archive(zarr.storage.MemoryStore(objects), new_buffer(), progress=False) as archive:
        archive.write(add(new_buffer(), 3))
    with pytest.raises(ValueError, match=r"cannot hold the one-writer lock: its store \(Check"):
        Archive(CheckThenWrite(objects), new_buffer())
    assert len(Archive(CheckThenWrite(objects), mode="r")) == 3  # any store can be read
    with pytest.raises(ValueError, match="cannot hold the one-writer lock"):  # wrapped too
        Archive(zarr.storage.LoggingStore(CheckThenWrite()), new_buffer())


OBSTORE_SPELLING = {
    "endpoint": "http://127.0.0.1:9000",
    "access_key_id": "id",
    "secret_access_key": "secret",
    "session_token": "token",
    "region": "eu-west-1",
    "skip_signature": False,
    "client_options": {"allow_http": True},
}
FSSPEC_SPELLING = {
    "endpoint_url": "http://127.0.0.1:9000",
    "key": "id",
    "secret": "secret",
    "token": "token",
    "anon": False,
    "client_kwargs": {"region_name": "eu-west-1"},
}


def test_s3_storage_options_in_either_spelling_reach_either_backend():
    assert s3_options(FSSPEC_SPELLING, "obstore") == OBSTORE_SPELLING  # http://: allow_http
    assert s3_options(OBSTORE_SPELLING, "obstore") == OBSTORE_SPELLING
    assert s3_options(OBSTORE_SPELLING, "fsspec") == FSSPEC_SPELLING  # allow_http: implied
    assert s3_options(FSSPEC_SPELLING, "fsspec") == FSSPEC_SPELLING
    # obstore's aliases (upper case, `aws_` prefix) too.
    aliased = {"AWS_ACCESS_KEY_ID": "id", "aws_endpoint": "http://h", "aws_region": "r"}
    assert s3_options(aliased, "fsspec") == {
        "key": "id",
        "endpoint_url": "http://h",
        "client_kwargs": {"region_name": "r"},
    }
    with pytest.raises(ValueError, match="'key' sets 'access_key_id' a second time"):
        s3_options({"access_key_id": "a", "key": "b"}, "fsspec")
    with pytest.raises(ValueError, match="'virtual_hosted_style_request' is obstore's and has"):
        s3_options({"virtual_hosted_style_request": True}, "fsspec")
    with pytest.raises(ValueError, match=r"client_options \['timeout'\] are obstore's"):
        s3_options({"client_options": {"timeout": "5s"}}, "fsspec")
    with pytest.raises(ValueError, match=r"client_kwargs\['verify'\] is s3fs's; obstore"):
        s3_options({"client_kwargs": {"verify": False}}, "obstore")


def test_without_obstore_a_url_is_read_through_fsspec_and_never_written(monkeypatch):
    """Without obstore, `s3://` goes to zarr's fsspec store: the same options in s3fs's
    spelling, readers only (fsspec's store checks, then writes: no safe writer lock)."""
    monkeypatch.setitem(sys.modules, "obstore.store", None)  # `import obstore.store` fails
    monkeypatch.setitem(sys.modules, "obstore.exceptions", None)
    url = "s3://bucket/run.zarr"
    with pytest.raises(ValueError, match=r"writing to 's3://bucket/run.zarr' needs obstore"):
        Archive(url, new_buffer(), storage_options=OBSTORE_SPELLING)
    seen = []

    def from_url(url: str, storage_options: dict, read_only: bool) -> Any:
        seen.append((url, storage_options, read_only))
        return zarr.storage.MemoryStore(read_only=True)  # empty: "no archive" below

    monkeypatch.setattr(zarr.storage.FsspecStore, "from_url", from_url)
    for options in (OBSTORE_SPELLING, FSSPEC_SPELLING):
        with pytest.raises(FileNotFoundError, match="no archive at 's3://bucket/run.zarr'"):
            Archive(url, mode="r", storage_options=options)
    assert seen == [(url, FSSPEC_SPELLING, True)] * 2

    def no_fsspec(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("No module named 's3fs'")

    monkeypatch.setattr(zarr.storage.FsspecStore, "from_url", no_fsspec)
    with pytest.raises(ImportError, match="needs obstore .* or fsspec with the filesystem"):
        Archive(url, mode="r")


def test_storage_options_only_apply_to_urls(tmp_path):
    with pytest.raises(ValueError, match="`storage_options` apply to a URL .* not to the local"):
        Archive(str(tmp_path / "run.zarr"), new_buffer(), storage_options={"key": "x"})
    with pytest.raises(ValueError, match="this `store` is already a zarr store"):
        Archive(zarr.storage.MemoryStore(), new_buffer(), storage_options={"key": "x"})


def test_sample_takes_a_jax_key_a_generator_or_a_seed():
    buffer = add(new_buffer(), 20)
    with Archive(zarr.storage.MemoryStore(), buffer, progress=False, chunk_steps=4) as archive:
        archive.write(buffer)
        draw = functools.partial(archive.sample, batch_size=64, sequence_length=3)
        a, b, c = draw(jax.random.key(0)), draw(jax.random.key(0)), draw(jax.random.key(1))
        np.testing.assert_array_equal(a.starts, b.starts)  # the same key, the same windows
        np.testing.assert_array_equal(a.rows, b.rows)
        assert not np.array_equal(a.starts, c.starts)
        raw = draw(jax.random.PRNGKey(0))  # a raw uint32 key: the same as its typed key
        np.testing.assert_array_equal(raw.starts, a.starts)
        np.testing.assert_array_equal(draw(7).starts, draw(np.random.default_rng(7)).starts)
        rng = np.random.default_rng(3)
        assert not np.array_equal(draw(rng).starts, draw(rng).starts)  # a Generator advances
        for rows in ([1], (np.int64(-1),), np.array([1]), slice(1, None)):  # rows, any way
            assert (draw(0, rows=rows).rows == 1).all()
        for s in (a, c, raw):
            np.testing.assert_array_equal(
                s.experience["obs"][:, :, 0],
                s.rows[:, None] * 100_000 + s.starts[:, None] + [0, 1, 2],
            )
        keys = jax.random.split(jax.random.key(0))
        with pytest.raises(TypeError):  # the annotation (checked in tests), then our message:
            draw(keys)
    with pytest.raises(ValueError, match=r"expected one PRNG key .* shape \(2,\) .*; split"):
        generator("Archive.sample()", keys)
    with pytest.raises(TypeError, match="`key` must be a JAX PRNG key .*, got float"):
        generator("Archive.sample()", 0.5)


def test_as_jax_gives_jax_arrays_of_the_same_values():
    buffer = add(new_buffer(), 20)
    with Archive(zarr.storage.MemoryStore(), buffer, progress=False, chunk_steps=4) as archive:
        archive.write(buffer)
        sample = archive.sample(jax.random.key(0), 32, 4)
        got = eb.as_jax(sample)
        block = eb.as_jax(archive.read(2, 9))
    assert isinstance(got, eb.ArchiveSample)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(sample), strict=True):
        assert isinstance(a, jax.Array)
        np.testing.assert_array_equal(np.asarray(a), b)
    assert got.experience["flag"].dtype == jnp.bfloat16 and got.rows.dtype == jnp.int32
    assert block["obs"].shape == (ROWS, 7, 4) and isinstance(block["obs"], jax.Array)
    device = jax.devices()[-1]
    assert eb.as_jax(sample, device).experience["obs"].devices() == {device}


def test_repr_names_location_length_rows_and_leaves(tmp_path):
    path = str(tmp_path / "run.zarr")
    buffer = add(new_buffer(), 6)
    with Archive(path, buffer, progress=False) as archive:
        archive.write(buffer)
        assert repr(archive) == (
            f"Archive({path!r}, mode='a', length=6, rows=2, "
            "leaves={['flag']: bfloat16[], ['obs']: float32[4]})"
        )
    assert repr(Archive(path, mode="r")).startswith(f"Archive({path!r}, mode='r', length=6,")
    memory = repr(Archive(zarr.storage.MemoryStore(), new_buffer()))
    assert memory.startswith("Archive(MemoryStore(") and "length=0, rows=2" in memory


def _public_members() -> list[tuple[str, Any]]:
    out = [("as_jax", eb.as_jax)]
    # (`Archive`'s own members and those of the classes it is built from, `ArchiveReads`,
    # `ArchiveWrites`: what a user sees on it)
    members = {k: v for c in reversed(Archive.__mro__[:-1]) for k, v in vars(c).items()}
    for name, member in members.items():
        if (not name.startswith("_") or name in ("__init__", "__len__")) and callable(
            getattr(member, "fget", member)
        ):
            out.append((name, member))
    return out


def test_every_public_member_is_annotated_documented_and_exemplified():
    """Every public method and property of `Archive` (and `as_jax`) has a type annotation on
    each argument and on its result, and a docstring with a runnable example (methods'
    examples run in tests/test_docs.py; the properties' run here). `Archive(...)`'s
    arguments are documented in the class docstring, once."""
    doc = inspect.getdoc(Archive) or ""
    init = inspect.signature(Archive.__init__)
    for name in list(init.parameters)[1:]:
        assert f"- `{name}`:" in doc, name
    assert (Archive.__init__.__doc__ or "") == ""
    for name, member in _public_members():
        fn = member.fget if isinstance(member, property) else member
        sig = inspect.signature(fn)
        for p in list(sig.parameters.values())[1 if name != "as_jax" else 0 :]:
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                assert p.annotation is not p.empty, (name, p.name)
        if name != "__init__":
            assert sig.return_annotation is not sig.empty, name
            assert name == "__len__" or "!!! example" in (fn.__doc__ or ""), name
        if isinstance(member, property):
            block = re.findall(r"!!! example\n\n(.*?)```\n", fn.__doc__ + "\n", flags=re.S)[0]
            code = re.sub(r"^```python\n", "", textwrap.dedent(block).strip())
            exec(compile(code, f"<Archive.{name}>", "exec"), {})


# ------------------------------------------------------------------------------ crashes


@functools.cache
def writer_server() -> subprocess.Popen:
    """One fork server (`archive_writer.py --serve`) for every crash test of the session: the
    imports are paid once, and each writer it forks starts in about a second."""
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    cmd = [sys.executable, str(root / "tests" / "archive_writer.py"), "--serve"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )

    def stop() -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    atexit.register(stop)
    return proc


@pytest.fixture(scope="session", autouse=True)
def start_writer_server() -> None:
    """Start the fork server with the session: its imports (seconds) then run beside the
    tests before the first crash test instead of inside it."""
    writer_server()


def committed_lines(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("committed")]


def crash_writer_many_times(
    store: str, options: str | None, kills: int, seed: int, shard_steps: int | None = None
) -> None:
    """SIGKILL a writer process at random moments (0 to 0.4 s after it has opened the archive,
    restored its ring and started writing); after each kill the archive must open, keep every
    step it had committed, hold exactly the right data, and accept new writes."""
    rng = np.random.default_rng(seed)
    server = writer_server()
    assert server.stdin is not None and server.stdout is not None
    folder = Path(tempfile.mkdtemp(prefix="archive-writer-logs-"))
    try:
        _crash(store, options, kills, rng, server, folder, shard_steps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _crash(
    store: str,
    options: str | None,
    kills: int,
    rng: np.random.Generator,
    server: subprocess.Popen,
    folder: Path,
    shard_steps: int | None,
) -> None:
    assert server.stdin is not None and server.stdout is not None
    committed = 0
    for kill in range(kills):
        log = folder / f"writer-{kill}.log"
        shards = "" if shard_steps is None else shard_steps
        server.stdin.write(f"{store}\t{options or ''}\t{shards}\t{log}\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        assert reply.startswith("pid"), reply
        pid = int(reply.split()[1])
        try:
            deadline = time.monotonic() + 120
            while not committed_lines(log):  # opened, restored, about to write
                assert time.monotonic() < deadline, "the writer never started"
                time.sleep(0.01)
            assert committed_lines(log)[0] >= committed
            time.sleep(float(rng.uniform(0.0, 0.4)))
        finally:
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline().split()[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL  # killed, alive
        committed = committed_lines(log)[-1]
        reader = Archive(store, mode="r", storage_options=json.loads(options) if options else None)
        n = len(reader)
        assert n >= committed  # no committed step lost (it may have committed one more)
        if n:
            assert_tree_equal(reader.read(), expected(0, n))
        committed = n
    # After the last kill a new writer takes over (the dead writer's lock is broken) and writes.
    with Archive(
        store,
        new_buffer(),
        progress=False,
        storage_options=json.loads(options) if options else None,
    ) as archive:
        buffer = archive.restore(new_buffer())
        assert archive.write(add(buffer, 5)) == 5
        assert_tree_equal(archive.read(), expected(0, committed + 5))


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_writer_killed_at_random_moments(tmp_path):
    """The default layout: here one shard, rewritten by every write."""
    crash_writer_many_times(str(tmp_path / f"crash-{uuid.uuid4().hex}.zarr"), None, 2, 0)


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_small_shards_writer_killed_at_random_moments(tmp_path):
    """Shards of 8 steps (2 chunks): writes span several shards, the first one partly
    committed (its committed chunks kept, a partial chunk completed)."""
    crash_writer_many_times(str(tmp_path / f"crash-{uuid.uuid4().hex}.zarr"), None, 3, 1, 8)


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_unsharded_writer_killed_at_random_moments(tmp_path):
    """One object per chunk (the layout without shards)."""
    crash_writer_many_times(str(tmp_path / f"crash-{uuid.uuid4().hex}.zarr"), None, 1, 2, 0)


def test_long_read_fetches_ahead_and_holds_a_few_shards(tmp_path, monkeypatch):
    """A long read of a sharded archive fetches whole shards ahead of the decoding (so a cold
    read keeps the disk busy) and drops each once its rows are decoded: it never holds more
    than the shards fetched ahead plus those being decoded, whatever its length."""
    import weakref

    from equibuffer._archive import _chunks, _store

    storage = eb.RingStorage({"x": jnp.zeros(4, jnp.float32)}, rows=2, length=64)
    archive = Archive(str(tmp_path / "a.zarr"), storage, progress=False, chunk_steps=4,
                      shard_steps=8)  # fmt: skip
    total = 0
    for i in range(8):  # 512 steps per row: 64 shards
        total += 64
        block = np.full((2, 64, 4), i, np.float32) + np.arange(64, dtype=np.float32)[:, None]
        storage = ring_holding(storage, [block], total)
        archive.write(storage)
    archive.close()

    class Blob(bytearray):  # bytes that can be watched (weakref) while the read holds them
        pass

    live: set[int] = set()
    most = [0]
    original = _chunks.Shards.get_shard

    def watched(self, shard):
        got = original(self, shard)
        if got is None:
            return None
        blob = Blob(got[1])
        live.add(shard)
        weakref.finalize(blob, live.discard, shard)
        most[0] = max(most[0], len(live))
        return got[0], memoryview(blob)

    monkeypatch.setattr(_chunks.Shards, "get_shard", watched)
    reader = Archive(str(tmp_path / "a.zarr"), mode="r", progress=False)
    back = reader.read(0, total)
    assert back["x"].shape == (2, 512, 4)
    expect = np.arange(512) % 64 + np.repeat(np.arange(8), 64)
    np.testing.assert_array_equal(back["x"][1, :, 0], expect)
    bound = _store.READ_AHEAD + _store._THREADS + 1
    assert 1 < most[0] <= bound, (most[0], bound)  # fetched ahead, and bounded


def _codec_of(path: str, leaf: str) -> str | None:
    """The compressor of a leaf's array as its zarr metadata says (None: raw bytes)."""
    codecs = list(zarr.open_array(path, path=leaf, mode="r").metadata.codecs)
    if len(codecs) == 1 and hasattr(codecs[0], "codecs"):  # sharded: the inner chunks' codecs
        codecs = list(codecs[0].codecs)
    return type(codecs[1]).__name__ if len(codecs) > 1 else None


@pytest.mark.parametrize("direct", [True, False], ids=["own-io", "zarr-path"])
def test_a_leaf_the_codec_cannot_shrink_is_stored_raw(tmp_path, monkeypatch, direct):
    """At the first write, each leaf whose steps the codec shrinks by less than
    WORTH_COMPRESSING (noise) is stored without it; compressible leaves keep it. zarr, a
    reader opened before the write (once refreshed) and a new reader read what was written."""
    from equibuffer._archive._format import WORTH_COMPRESSING

    monkeypatch.setattr(Archive, "_direct_io", direct)
    rng = np.random.default_rng(0)
    example = {"noise": jnp.zeros(8, jnp.float32), "frame": jnp.zeros((4, 4), jnp.uint8)}
    storage = eb.RingStorage(example, rows=2, length=64)
    path = str(tmp_path / "run.zarr")
    archive = Archive(path, storage, progress=False, chunk_steps=8, shard_steps=16)
    early = Archive(path, mode="r", progress=False)
    assert _codec_of(path, "noise") == "ZstdCodec" == _codec_of(path, "frame")
    noise = rng.standard_normal((2, 64, 8)).astype(np.float32)
    frame = np.tile(np.arange(16, dtype=np.uint8).reshape(4, 4), (2, 64, 1, 1))
    import numcodecs

    raw = np.ascontiguousarray(noise)
    assert raw.nbytes < WORTH_COMPRESSING * len(numcodecs.Zstd(level=1).encode(raw))
    archive.write(ring_holding(storage, [frame, noise], 64))  # leaves in sorted order
    assert _codec_of(path, "noise") is None and _codec_of(path, "frame") == "ZstdCodec"
    more = rng.standard_normal((2, 64, 8)).astype(np.float32)
    archive.write(ring_holding(storage, [frame, more], 128))  # later writes keep the choice
    archive.close()
    assert _codec_of(path, "noise") is None
    both = np.concatenate([noise, more], axis=1)
    np.testing.assert_array_equal(zarr.open_array(path, path="noise", mode="r")[:], both)
    assert early.refresh() == 128
    for reader in (early, Archive(path, mode="r", progress=False)):
        back = reader.read()
        np.testing.assert_array_equal(back["noise"], both)
        np.testing.assert_array_equal(back["frame"][:, :64], frame)


def test_compression_none_and_compressible_leaves_are_left_as_asked(tmp_path):
    example = {"x": jnp.zeros(8, jnp.float32)}
    storage = eb.RingStorage(example, rows=1, length=32)
    for compression, codec in (("none", None), ("lz4", "BloscCodec"), ("zstd", "ZstdCodec")):
        path = str(tmp_path / f"{compression}.zarr")
        archive = Archive(path, storage, progress=False, compression=compression)
        steps = np.zeros((1, 32, 8), np.float32)  # all zeros: compressible
        archive.write(ring_holding(storage, [steps], 32))
        archive.close()
        assert _codec_of(path, "x") == codec


def _stored_bytes(path: str, leaf: str) -> int:
    """The bytes of a leaf's chunk (or shard) objects, its metadata document left out."""
    return sum(f.stat().st_size for f in (Path(path) / leaf).iterdir() if f.name != "zarr.json")


def test_a_small_first_write_is_too_little_to_judge_and_keeps_the_codec(tmp_path):
    """The codec is judged on chunks as they are stored. A first write of 3 steps of a bool
    leaf (3 bytes per row, less than the codec's frame) is too little to judge: the leaf
    keeps its codec, and the episode flags written after it compress several-fold (stored
    raw, they did not). A leaf whose chunks are smaller than the codec's frame (4 steps of a
    bool) is stored raw, judged on those chunks, even when the first write is long."""
    from equibuffer._archive._format import JUDGED_BYTES

    def done(first: int, count: int) -> np.ndarray:  # episodes of 50 steps
        return (np.arange(first, first + count) % 50 == 49)[None].repeat(2, 0)

    example = {"done": jnp.bool_(False), "x": jnp.zeros(8, jnp.float32)}
    storage = eb.RingStorage(example, rows=2, length=256)
    path = str(tmp_path / "flags.zarr")
    with Archive(path, storage, progress=False, chunk_steps=1024, shard_steps=0) as archive:
        total = 3
        assert 3 * 8 * 4 < JUDGED_BYTES  # neither leaf's first part of a chunk is judged
        archive.write(ring_holding(storage, [done(0, 3), np.ones((2, 3, 8), np.float32)], 3))
        assert _codec_of(path, "done") == "ZstdCodec" == _codec_of(path, "x")
        while total < 3 * 1024:
            held = ring_holding(
                storage, [done(total, 256), np.ones((2, 256, 8), np.float32)], total + 256
            )
            total += archive.write(held)
        flags = archive.read()["done"]
    np.testing.assert_array_equal(flags, done(0, total))
    assert 2 * total / _stored_bytes(path, "done") > 5  # several-fold (raw: 1x)

    frames = {"done": jnp.bool_(False), "frame": jnp.zeros((16, 16), jnp.uint8)}
    storage = eb.RingStorage(frames, rows=2, length=256)
    path = str(tmp_path / "frames.zarr")
    with Archive(path, storage, progress=False, chunk_steps=4, shard_steps=0) as archive:
        frame = np.zeros((2, 256, 16, 16), np.uint8)
        archive.write(ring_holding(storage, [done(0, 256), frame], 256))
    assert _codec_of(path, "done") is None and _codec_of(path, "frame") == "ZstdCodec"
    assert _stored_bytes(path, "done") == 2 * 256  # 4 bytes per chunk (zstd: 13 or more)


def test_append_steps_without_a_buffer():
    """`Archive.append` takes arrays in the archive's tree (a dict by leaf name without
    `like`, a root leaf too), commits them as source steps, and refuses, naming the leaf, a
    missing or extra leaf, another shape or another dtype before writing."""
    buffer = eb.ItemBuffer(
        {"x": jnp.float32(0), "y": jnp.zeros(2, jnp.int32)}, add_batch_size=2, capacity=4
    )
    store = zarr.storage.MemoryStore()
    with eb.Archive(store, buffer) as archive:
        x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3, 2), np.int32)
        assert archive.append({"x": x, "y": y}) == 3
        with pytest.raises(ValueError, match=r"leaf \['y'\] has dtype int64; the archive holds"):
            archive.append({"x": x, "y": y.astype(np.int64)})
        with pytest.raises(ValueError, match=r"leaf \['y'\] has shape \(2, 3, 3\)"):
            archive.append({"x": x, "y": np.ones((2, 3, 3), np.int32)})
        with pytest.raises(ValueError, match=r"leaves of the archive not given: \['y'\]"):
            archive.append({"x": x})
        assert len(archive) == archive.source_steps == 3
    reader = eb.Archive(store, mode="r")
    np.testing.assert_array_equal(reader.read()["x"], x)
    with eb.Archive(store) as again:  # without `like`: a dict by leaf name
        assert again.append(again.read(0, 1)) == 1
        assert len(again) == 4 and again.read(3)["x"].tolist() == [[0.0], [3.0]]
    root = eb.ItemBuffer(jnp.float32(0), add_batch_size=1, capacity=4)
    with eb.Archive(zarr.storage.MemoryStore(), root) as archive:
        assert archive.append(np.ones((1, 3), np.float32)) == 3


def test_metadata_kept_and_checked():
    buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
    store = zarr.storage.MemoryStore()
    meta = {"env": "Pendulum-v1", "spec": {"max_steps": 200, "tags": ["a", None]}}
    with eb.Archive(store, buffer, metadata=meta) as archive:
        archive.write(buffer.add({"x": jnp.ones((1, 2))}))
    assert eb.Archive(store, mode="r").metadata == meta  # kept through commits
    with pytest.raises(TypeError, match="`metadata` must hold JSON values only"):
        eb.Archive(zarr.storage.MemoryStore(), buffer, metadata={"x": np.float32(1)})
