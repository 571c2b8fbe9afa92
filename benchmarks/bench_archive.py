"""Archive benchmark, side by side with Flashbax's Vault (tensorstore) in the same run, plus the
disk's own sequential bandwidth (write + fsync, then read, of one big file with NumPy).

Observations `(32, 32, 3)` uint8 and float32, 8 rows, written block by block from a ring of
`--block` steps per row, then read back whole; random windows of 8 steps sampled straight
from a freshly opened archive against reading each window with its own zarr slice; and the
compression ratio (and speed) of each codec on realistic, compressible frames.

    python -m benchmarks.bench_archive            # 2**17 steps (16384 per row)
    python -m benchmarks.bench_archive --quick    # 2**14 steps
    python -m benchmarks.bench_archive --steps 1000000   # the issue's full size (12 GB float32)
    python -m benchmarks.bench_archive --zarr-path --steps 65536   # own I/O against zarr's path
    python -m benchmarks.bench_archive --against /tmp/old --repeats 8   # against another version

Page caches are kept unless `--cold` (each file dropped with `posix_fadvise` before a timed
read, no root needed): reads may be served from memory, for the disk figure and for both
libraries alike. `--data random` writes incompressible steps instead of frames. Timings are
noisy on a shared machine; compare ratios.

    python -m benchmarks.bench_archive --data random --cold --codecs zstd,none   # issue 17

Issue 18. The default run ends with sampling throughput with 1, 2 and 4 reader processes at
once (`--readers 1,2,4`; `--readers-only` for that table alone), from a local directory and
from moto's S3 server started here on loopback. `--larger-than-memory` alone writes
`--data-gb` (4; incompressible random frames unless `--data frames`) and reads and samples all
of it in a process limited to `--limit-gb` (1) by a memory cgroup, or `RLIMIT_DATA` where no
cgroup can be made (`--limit-with`; `benchmarks/_memory.py`).

    python -m benchmarks.bench_archive --readers-only --dtypes uint8
    python -m benchmarks.bench_archive --larger-than-memory --cold   # 4 GB under 1 GB
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import zarr
import zarr.codecs

import equibuffer as eb
from equibuffer._archive import _format, _store, Archive, ring_holding
from equibuffer._archive._format import Compression

from ._timing import fmt_time, table


ROWS, SHAPE, SEQ = 8, (32, 32, 3), 8


def frames(rows: int, steps: int, seed: int) -> np.ndarray:
    """Synthetic rendered frames, `(rows, steps, 32, 32, 3)` uint8: a scrolling gradient
    background, a moving square and 5% of pixels with sensor noise (compressible, not trivial)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:32, 0:32]
    t = np.arange(steps)[:, None, None]
    out = np.empty((rows, steps, 32, 32, 3), np.uint8)
    for r in range(rows):
        out[r, ..., 0] = (x * 4 + t + 9 * r) % 256
        out[r, ..., 1] = (y * 4)[None] % 256
        out[r, ..., 2] = 60 + r
        for i in range(steps):
            cx, cy = (i * 3 + r) % 28, (i * 5) % 28
            out[r, i, cy : cy + 4, cx : cx + 4] = (255, 0, 0)
        noise = rng.random((steps, 32, 32)) < 0.05
        out[r][noise] = rng.integers(0, 256, (int(noise.sum()), 3), dtype=np.uint8)
    return out


DATA = "frames"  # or "random": incompressible steps (--data)
COLD = False  # evict the files from the page cache before each timed read (--cold)


def observations(dtype: str, block: int) -> np.ndarray:
    """`frames` of `ROWS` rows and `block` steps, as uint8 or as float32 in [0, 1]; with
    `--data random`, incompressible steps instead: uniform random uint8 frames, or float32
    standard normal noise (what no codec shrinks: the archive's cost on such data is its own
    I/O and the codec's pass over the bytes)."""
    if DATA == "random":
        rng = np.random.default_rng(1)
        if dtype == "uint8":
            return rng.integers(0, 256, (ROWS, block, *SHAPE), dtype=np.uint8)
        return rng.standard_normal((ROWS, block, *SHAPE), dtype=np.float32)
    source = frames(ROWS, block, seed=1)
    return source if dtype == "uint8" else (source / 255).astype(np.float32)


def evict(path: str) -> None:
    """With `--cold`: flush, then drop the files under `path` from the page cache
    (`posix_fadvise(DONTNEED)`: no root needed), so that the next read comes from the disk."""
    if not COLD:
        return
    os.sync()
    paths = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, files in os.walk(path) for f in files
    ]  # fmt: skip
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(folder: str, nbytes: int) -> tuple[float, float]:
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path = os.path.join(folder, "disk.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    w = nbytes / (time.perf_counter() - t0)
    evict(path)
    t0 = time.perf_counter()
    np.fromfile(path, np.uint8)
    r = nbytes / (time.perf_counter() - t0)
    os.remove(path)
    return w, r


def mbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:.0f} MB/s"


def warm_memory(payload: int) -> None:
    """Touch (then free) as much memory as the largest part of `read_parts` before a timed
    read. The first large allocation after the writes has the kernel assemble huge pages from
    memory the page cache fragmented (measured: 2 to 3 s for 1.3 GB; after it, the first read
    runs as fast as the next ones); otherwise whichever read comes first pays for it, which is
    the OS's cost, not the store's. Done before each library's reads, untimed."""
    k = len(read_parts(100, payload))
    np.ones(-(-payload // k), np.uint8)


def read_parts(length: int, payload: int) -> list[tuple[int, int]]:
    """Long reads are timed in parts of at most ~1.3 GB (a tenth, a twentieth, ... of the
    time axis, as Vault's `percentiles` can select), each dropped once read, so that the
    issue's full size (12 GB of float32) fits in memory; both libraries read the same parts."""
    k = next(k for k in (1, 2, 4, 5, 10, 20, 25, 50, 100) if payload / k <= 1.3e9 or k == 100)
    return [(length * i // k, length * (i + 1) // k) for i in range(k)]


def bench_dtype(
    folder: str,
    dtype: str,
    steps: int,
    block: int,
    compression: Compression,
    fsync: bool = False,
) -> dict:
    per_row = steps // ROWS
    blocks = per_row // block
    obs = observations(dtype, block)
    payload = blocks * block * ROWS * obs[0, 0].nbytes
    example = {"obs": jnp.zeros(SHAPE, dtype)}
    buffer = eb.TrajectoryBuffer(
        example, add_batch_size=ROWS, max_length_time_axis=block, sequence_length=1
    )
    path = os.path.join(folder, f"eb-{dtype}-{compression}.zarr")
    archive = Archive(path, buffer, compression=compression, progress=False, fsync=fsync)
    t_write = t_first = 0.0
    for i in range(blocks):
        rolled = np.roll(obs, i, axis=1)  # different data in every block
        buffer = jax.block_until_ready(buffer.add({"obs": jnp.asarray(rolled)}))
        t0 = time.perf_counter()  # the write alone: the add above has finished
        archive.write(buffer)
        t_write += time.perf_counter() - t0
        if i == 0:
            t_first = t_write
    ratio = archive.compression_ratio()
    archive.close()
    reader = Archive(path, mode="r", progress=False)
    t_read = 0.0
    warm_memory(payload)
    evict(path)
    for a, b in read_parts(len(reader), payload):
        t0 = time.perf_counter()
        back = reader.read(a, b)["obs"]
        t_read += time.perf_counter() - t0
        assert back.shape == (ROWS, b - a, *SHAPE)
        del back
    return {
        "path": path,
        "payload": payload,
        "write_s": t_write,
        # The first write of a process also pays once for what later ones reuse (imports,
        # the I/O threads, the codecs' first buffers): the steady rate is that of the rest.
        "steady_write_s": (t_write - t_first) * blocks / (blocks - 1) if blocks > 1 else t_write,
        "read_s": t_read,
        "ratio": ratio,
        "obs": obs,
        "blocks": blocks,
    }


# The columns of a row against the codec's own rate (empty where there is no codec).
CODEC_COLUMNS = ("write/codec", "write/codec, writes 2+", "read/codec", "codec encode, decode")


def codec_rate(obs: np.ndarray, compression: Compression) -> tuple[float, float] | None:
    """What the codec alone does on this machine, in bytes per second: the archive's chunks of
    `obs` (`(rows, block, *SHAPE)`, one row and `chunk_steps` steps each) encoded and then
    decoded into existing arrays, by as many threads as there are cores (the archive's
    pipeline uses them all), best of 3. None for no codec. The archive's own write and read
    rates are reported against these (issue 17: at least 0.9x)."""
    codec = _format.numcodec(_format.compressor(compression))
    if not codec:
        return None
    chunk = max(1, min(obs.shape[1], _format.pow2_floor(_format.CHUNK_BYTES / obs[0, 0].nbytes)))
    chunks = [
        np.ascontiguousarray(obs[r : r + 1, t : t + chunk])
        for r in range(obs.shape[0])
        for t in range(0, obs.shape[1] - chunk + 1, chunk)
    ]
    nbytes = sum(c.nbytes for c in chunks)
    outs = [np.empty_like(c) for c in chunks]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        encoded = list(pool.map(codec.encode, chunks))
        enc = dec = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(codec.encode, chunks))
            enc = min(enc, time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda a: codec.decode(a[0], out=a[1]), zip(encoded, outs, strict=True)))
            dec = min(dec, time.perf_counter() - t0)
    return nbytes / enc, nbytes / dec


def bench_vault(folder: str, dtype: str, obs: np.ndarray, blocks: int) -> tuple[float, float]:
    from flashbax.buffers.trajectory_buffer import TrajectoryBufferState
    from flashbax.vault import Vault

    block = obs.shape[1]
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        first = {"obs": jnp.asarray(obs)}
        state = TrajectoryBufferState(
            experience=first, current_index=jnp.int32(0), is_full=jnp.bool_(True)
        )
        vault = Vault(f"vault-{dtype}", experience_structure=state.experience, vault_uid="x")
        t_write = 0.0
        for i in range(blocks):
            exp = {"obs": jnp.asarray(np.roll(obs, i, axis=1))}
            state = jax.block_until_ready(
                TrajectoryBufferState(
                    experience=exp, current_index=jnp.int32(0), is_full=jnp.bool_(True)
                )
            )
            t0 = time.perf_counter()
            vault.write(state, source_interval=(0, block))
            t_write += time.perf_counter() - t0
        reader = Vault(f"vault-{dtype}", vault_uid="x")
        parts = read_parts(blocks * block, obs[:, :1].nbytes * blocks * block)
        warm_memory(obs[:, :1].nbytes * blocks * block)
        evict(os.path.join(folder, "vaults"))
        t_read, seen = 0.0, 0
        for i in range(len(parts)):
            t0 = time.perf_counter()
            pct = (100 * i // len(parts), 100 * (i + 1) // len(parts))
            back = reader.read(percentiles=pct).experience["obs"]
            back.block_until_ready()
            t_read += time.perf_counter() - t0
            seen += back.shape[1]
            del back
        assert seen == blocks * block
    finally:
        os.chdir(cwd)
    return t_write, t_read


def bench_windows(path: str, batches: int) -> tuple[float, float, int]:
    """`sample()` (batches of 256 windows, uniform with replacement over every (row, start)
    with the window inside the archive) against reading the same windows one zarr slice each
    (`array[row, start : start + 8]`), both from freshly opened arrays (no chunk cached by the
    process; the OS page cache is not dropped)."""
    reader = Archive(path, mode="r", progress=False)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    drawn = []
    for _ in range(batches):
        s = reader.sample(rng, 256, SEQ)
        drawn.append(s)
    batched = 256 * batches / (time.perf_counter() - t0)
    arr = zarr.open_array(path, path="obs", mode="r")
    rows = np.concatenate([s.rows for s in drawn])
    starts = np.concatenate([s.starts for s in drawn])
    m = min(len(rows), 512)
    t0 = time.perf_counter()
    for r, s, want in zip(
        rows[:m], starts[:m], np.concatenate([d.experience["obs"] for d in drawn]), strict=False
    ):
        got = arr[int(r), int(s) : int(s) + SEQ]
        assert np.array_equal(got, want)
    one = m / (time.perf_counter() - t0)
    return batched, one, len(reader)


def _write_archive(
    path: str, obs: np.ndarray, blocks: int, at_a_time: int | None = None, **kwargs: Any
) -> tuple[float, float, float]:
    """Write `blocks` rolled copies of `obs` (`(rows, block, *SHAPE)`) to a new archive at
    `path`, `at_a_time` steps per `write` (default: the whole block); returns `(wall seconds,
    CPU seconds, compression ratio)` of the writes."""
    rows, block = obs.shape[:2]
    step = at_a_time or block
    example = {"obs": jnp.zeros(SHAPE, obs.dtype)}
    ring = eb.RingStorage(example, rows=rows, length=block)
    archive = Archive(path, ring, progress=False, **kwargs)
    wall = cpu = 0.0
    total = 0
    for i in range(blocks):
        rolled = np.roll(obs, i, axis=1)
        for a in range(0, block, step):
            total += step
            ring = ring_holding(ring, [rolled[:, a : a + step]], total)
            t0, c0 = time.perf_counter(), time.process_time()
            archive.write(ring)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
    ratio = archive.compression_ratio()
    archive.close()
    return wall, cpu, ratio


def _read_all(path: str, payload: int) -> tuple[float, float]:
    """Read a whole archive (in the parts of `read_parts`); `(wall, CPU)` seconds."""
    reader = Archive(path, mode="r", progress=False)
    wall = cpu = 0.0
    warm_memory(payload)
    for a, b in read_parts(len(reader), payload):
        t0, c0 = time.perf_counter(), time.process_time()
        back = reader.read(a, b)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        del back
    return wall, cpu


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """The archive's I/O pool with `count` threads (None: the default) for the duration."""
    if count is None:
        yield
        return
    with (
        concurrent.futures.ThreadPoolExecutor(count) as pool,
        mock.patch.object(_store, "_POOL", pool),
    ):
        yield


@contextlib.contextmanager
def _zstd_level(level: int | None) -> Iterator[None]:
    """Archives created meanwhile with `compression="zstd"` use zstd at `level`."""
    if level is None:
        yield
        return
    default = _format.compressor

    def codecs(c: str) -> Any:
        return zarr.codecs.ZstdCodec(level=level) if c == "zstd" else default(c)

    with mock.patch.object(_format, "compressor", codecs):
        yield


def read_variants(folder: str, dtype: str, steps: int, block: int, repeats: int) -> list[dict]:
    """The read rate of the same data under each variant (thread count, codec, shard size),
    the variants interleaved in each of `repeats` rounds so that the machine's load falls on
    all alike; also each variant's write rate (one write) and compression ratio."""
    per_row = steps // ROWS
    blocks = per_row // block
    obs = observations(dtype, block)
    payload = blocks * block * ROWS * obs[0, 0].nbytes
    default_ss = _format.pow2_floor(_format.SHARD_BYTES / (ROWS * obs[0, 0].nbytes))
    # (name, zstd level, archive options, threads): None means the default.
    variants: list[tuple[str, int | None, dict, int | None]] = [
        ("zstd 1, 16 MiB shards (default)", None, {}, None),
        ("same, 2 threads", None, {}, 2),
        ("same, 1 thread", None, {}, 1),
        ("zstd -1", -1, {}, None),
        ("zstd -3", -3, {}, None),
        ("blosc-lz4, byte shuffle", None, {"compression": "lz4"}, None),
        ("zstd 1, 4 MiB shards", None, {"shard_steps": default_ss // 4}, None),
        ("zstd 1, 64 MiB shards", None, {"shard_steps": default_ss * 4}, None),
    ]
    paths, written = {}, {}
    for _name, level, options, _ in variants:
        key = (level, tuple(sorted(options.items())))
        if key not in paths:
            paths[key] = os.path.join(folder, f"variant-{len(paths)}.zarr")
            with _zstd_level(level):
                written[key] = _write_archive(paths[key], obs, blocks, **options)
    reads: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in variants}
    for _ in range(repeats):
        for name, level, options, threads in variants:
            with _threads(threads):
                reads[name].append(
                    _read_all(paths[(level, tuple(sorted(options.items())))], payload)
                )
    out = []
    for name, level, options, _ in variants:
        key = (level, tuple(sorted(options.items())))
        w_wall, w_cpu, ratio = written[key]
        walls = sorted(payload / w / 1e6 for w, _ in reads[name])
        cpus = sorted(payload / c / 1e6 for _, c in reads[name])
        out.append(
            {
                "dtype": dtype,
                "variant": name,
                "read MB/s (min/median/max)": "/".join(
                    f"{x:.0f}" for x in (walls[0], walls[len(walls) // 2], walls[-1])
                ),
                "read MB/CPU-s (median)": f"{cpus[len(cpus) // 2]:.0f}",
                "write MB/s": f"{payload / w_wall / 1e6:.0f}",
                "write MB/CPU-s": f"{payload / w_cpu / 1e6:.0f}",
                "ratio": f"{ratio:.2f}",
            }
        )
    for path in paths.values():
        shutil.rmtree(path)
    return out


def small_writes(folder: str, dtype: str, steps: int, block: int) -> list[dict]:
    """The cost of writing few steps at a time: each write re-encodes and rewrites the last,
    partial shard (the committed chunks it holds are copied as stored, a partial chunk is
    decoded and completed), so its cost grows with the shard, not with the steps written."""
    obs = observations(dtype, block)
    out = []
    for at_a_time, layout, options in [
        (1, "16 MiB shards", {}),
        (16, "16 MiB shards", {}),
        (256, "16 MiB shards", {}),
        (block, "16 MiB shards", {}),
        (1, "no shards", {"shard_steps": 0}),
        (16, "no shards", {"shard_steps": 0}),
    ]:
        # Enough writes to time (at least 1024 steps: whole shards), capped by --steps.
        count = min(steps // ROWS, max(at_a_time * 64, 1024))
        blocks = max(1, count // block)
        part = obs[:, : min(block, count)]
        path = os.path.join(folder, "small.zarr")
        wall, cpu, _ = _write_archive(path, part, blocks, at_a_time, **options)
        shutil.rmtree(path)
        n = blocks * part.shape[1]
        payload = n * ROWS * obs[0, 0].nbytes
        out.append(
            {
                "dtype": dtype,
                "layout": layout,
                "steps per write": at_a_time,
                "writes": n // at_a_time,
                "ms per write": f"{wall / (n // at_a_time) * 1e3:.2f}",
                "us per step": f"{wall / n * 1e6:.0f}",
                "MB/s": f"{payload / wall / 1e6:.1f}",
                "MB/CPU-s": f"{payload / cpu / 1e6:.1f}",
            }
        )
    return out


def background_writes(folder: str, dtype: str, block: int, writes: int, train_ms: float) -> list:
    """A training loop that writes a block of `block` steps per row after each training
    phase of `train_ms` (a sleep: the host waiting on an accelerator), with no write (the
    loop alone: the phases and refilling the ring), `write` and `write_async`: how long each
    call holds the loop, and the loop's wall time."""
    obs = observations(dtype, block)
    out = []
    for how in ("none", "write", "write_async"):
        example = {"obs": jnp.zeros(SHAPE, obs.dtype)}
        ring = eb.RingStorage(example, rows=ROWS, length=block)
        path = os.path.join(folder, f"bg-{how}.zarr")
        archive = Archive(path, ring, progress=False)
        held = []
        t_loop = time.perf_counter()
        for i in range(writes):
            time.sleep(train_ms / 1e3)
            ring = ring_holding(ring, [np.roll(obs, i, axis=1)], (i + 1) * block)
            t0 = time.perf_counter()
            if how != "none":
                getattr(archive, how)(ring)
            held.append(time.perf_counter() - t0)
        archive.close()  # waits for the background writes
        wall = time.perf_counter() - t_loop
        payload = writes * block * ROWS * obs[0, 0].nbytes
        out.append(
            {
                "dtype": dtype,
                "call": how,
                "writes": writes,
                "MB per write": f"{payload / writes / 1e6:.1f}",
                "training per write": f"{train_ms:.0f} ms",
                "loop held per write (median)": fmt_time(float(np.median(held))),
                "loop wall (close included)": fmt_time(wall),
            }
        )
        shutil.rmtree(path)
    return out


FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"


def _sample_rate(path: str, batches: int) -> float:
    """Windows per second of `sample()` (batches of 256 windows of `SEQ` steps) from a freshly
    opened archive."""
    reader = Archive(path, mode="r", progress=False)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(batches):
        reader.sample(rng, 256, SEQ)
    return 256 * batches / (time.perf_counter() - t0)


def zarr_paths(folder: str, dtype: str, steps: int, block: int, repeats: int) -> list[dict]:
    """The archive's own chunk and shard I/O against zarr's own path, the tested reference
    (`Archive._direct_io = False`: zarr's `resize`, array assignment and
    `update_attributes` for writes, its orthogonal selection for reads, one slice per
    window for samples), with zarr's default codec pipeline and with its opt-in
    `FusedCodecPipeline`: long writes (blocks of `block` steps), writes of 16 steps, a
    whole read and random windows, the variants interleaved in each of `repeats` rounds."""
    obs = observations(dtype, block)
    blocks = max(1, steps // ROWS // block)
    payload = blocks * block * ROWS * obs[0, 0].nbytes
    small = obs[:, : min(block, 256)]
    variants: list[tuple[str, bool, str | None]] = [
        ("own I/O (the default)", True, None),
        ("zarr's path", False, None),
        ("zarr's path, FusedCodecPipeline", False, FUSED),
    ]
    got: dict[str, list[tuple[float, float, float, float]]] = {v[0]: [] for v in variants}
    for _ in range(repeats):
        for name, direct, pipeline in variants:
            config = (
                zarr.config.set({"codec_pipeline.path": pipeline})
                if pipeline
                else contextlib.nullcontext()
            )
            path = os.path.join(folder, "paths.zarr")
            with config, mock.patch.object(Archive, "_direct_io", direct):
                wall, _, _ = _write_archive(path, obs, blocks)
                read, _ = _read_all(path, payload)
                rate = _sample_rate(path, 4)
                small_path = os.path.join(folder, "paths-small.zarr")
                small_wall, _, _ = _write_archive(small_path, small, 1, 16)
            shutil.rmtree(path)
            shutil.rmtree(small_path)
            got[name].append(
                (payload / wall, small_wall / (small.shape[1] // 16), payload / read, rate)
            )
    out = []
    own = [float(np.median([g[i] for g in got[variants[0][0]]])) for i in range(4)]
    for name, *_ in variants:
        med = [float(np.median([g[i] for g in got[name]])) for i in range(4)]
        out.append(
            {
                "dtype": dtype,
                "path": name,
                "write MB/s": f"{med[0] / 1e6:.0f} ({med[0] / own[0]:.2f}x)",
                "ms per 16-step write": f"{med[1] * 1e3:.1f} ({own[1] / med[1]:.2f}x)",
                "read MB/s": f"{med[2] / 1e6:.0f} ({med[2] / own[2]:.2f}x)",
                "sample() windows/s": f"{med[3]:.0f} ({med[3] / own[3]:.2f}x)",
            }
        )
    return out


def against(folder: str, old_dir: str, dtypes: list[str], codecs: list[str], rounds: int) -> list:
    """This archive against another version of it in the same process, interleaved call by
    call (the order flipped each time), so that the load of a shared machine falls on both
    alike: writes of 1024 steps (8 rows of frames), reads of the first 4096 steps of what
    they wrote (~100 MB of uint8: larger reads time the kernel's page faults on the fresh
    output more than the read), batches of 256 random windows of 8 steps, and writes of 1,
    16 and 256 steps (16 MiB shards and no shards); medians of wall and CPU time. `old_dir`
    holds the other version as a package named `equibuffer_old` (only relative imports
    inside, as equibuffer has), e.g.
    `git archive 2e64240 equibuffer | tar -x -C /tmp/old && mv /tmp/old/equibuffer
    /tmp/old/equibuffer_old`."""
    import importlib
    import statistics
    import sys

    sys.path.insert(0, old_dir)
    old = importlib.import_module("equibuffer_old")
    old_archive = importlib.import_module("equibuffer_old._archive")
    versions = {
        "old": (old.RingStorage, old.Archive, old_archive.ring_holding),
        "new": (eb.RingStorage, Archive, ring_holding),
    }

    def alternate(n: int, fn: Any) -> tuple[float, float]:
        """`(old / new wall time, old / new CPU time)` of `n` calls each, medians."""
        wall: dict[str, list[float]] = {v: [] for v in versions}
        cpu: dict[str, list[float]] = {v: [] for v in versions}
        for i in range(n):
            for v in ("old", "new") if i % 2 == 0 else ("new", "old"):
                t0, c0 = time.perf_counter(), time.process_time()
                fn(v, i)
                wall[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
        m = statistics.median
        return m(wall["old"]) / m(wall["new"]), m(cpu["old"]) / m(cpu["new"])

    def archives(block: int, obs: np.ndarray, n: int, **kwargs: Any) -> tuple[dict, dict]:
        opened, rings = {}, {}
        for v, (ring_cls, archive_cls, holding) in versions.items():
            ring = ring_cls({"obs": jnp.zeros(SHAPE, obs.dtype)}, rows=ROWS, length=block)
            opened[v] = archive_cls(os.path.join(folder, f"{v}.zarr"), ring, **kwargs)
            rings[v] = [
                holding(ring, [np.roll(obs, i, axis=1)[:, :block]], (i + 1) * block)
                for i in range(n)
            ]
        return opened, rings

    out = []
    for dtype in dtypes:
        obs = observations(dtype, 1024)
        for codec in codecs:
            opened, rings = archives(1024, obs, 2 * rounds, compression=codec, progress=False)
            w = alternate(2 * rounds, lambda v, i, o=opened, g=rings: o[v].write(g[v][i]))
            for a in opened.values():
                a.close()
            paths = {v: os.path.join(folder, f"{v}.zarr") for v in versions}
            readers = {v: versions[v][1](paths[v], mode="r", progress=False) for v in versions}
            r = alternate(2 * rounds, lambda v, i, rd=readers: rd[v].read(0, 4096))
            readers = {v: versions[v][1](paths[v], mode="r", progress=False) for v in versions}
            rng = {v: np.random.default_rng(0) for v in versions}
            s = alternate(5 * rounds, lambda v, i, rd=readers, g=rng: rd[v].sample(g[v], 256, SEQ))
            for op, (wall, cpu) in (("write 1024 steps", w), ("read", r), ("sample", s)):
                out.append(
                    {
                        "dtype": dtype,
                        "codec": codec,
                        "operation": op,
                        "speed new/old (wall)": f"{wall:.3f}",
                        "speed new/old (CPU)": f"{cpu:.3f}",
                    }
                )
            for p in paths.values():
                shutil.rmtree(p)
    obs = observations("uint8", 256)
    for layout, shard_steps in (("16 MiB shards", None), ("no shards", 0)):
        for steps in (1, 16, 256):
            n = 10 * rounds if steps < 256 else 2 * rounds
            opened, rings = archives(steps, obs, n, shard_steps=shard_steps, progress=False)
            wall, cpu = alternate(n, lambda v, i, o=opened, g=rings: o[v].write(g[v][i]))
            for a in opened.values():
                a.close()
            for v in versions:
                shutil.rmtree(os.path.join(folder, f"{v}.zarr"))
            out.append(
                {
                    "dtype": "uint8",
                    "codec": layout,
                    "operation": f"write {steps} steps",
                    "speed new/old (wall)": f"{wall:.3f}",
                    "speed new/old (CPU)": f"{cpu:.3f}",
                }
            )
    return out


BUCKET = "equibuffer-bench"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def moto_server() -> Iterator[dict]:
    """moto's S3 server on 127.0.0.1 and a free port, run by this process's threads (loopback
    only), with a bucket `BUCKET`; yields the storage options that reach it."""
    import logging
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        keys = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(
            Bucket=BUCKET
        )
        yield {
            "endpoint": endpoint,
            "access_key_id": "bench",
            "secret_access_key": "bench",
            "region": "us-east-1",
            "client_options": {"allow_http": True},
        }
    finally:
        server.stop()


def _reader_process() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks._archive_reader", "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _ask(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _answer(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a reader process ended (exit status {proc.wait()}): see its stderr")
    return line.strip()


def many_readers(
    folder: str, dtype: str, steps: int, block: int, counts: list[int], seconds: float
) -> list[dict]:
    """Sampling throughput with 1, 2, 4... reader processes at once, from one archive in a
    local directory and on moto's S3 server (started here, on loopback): each reader opens
    the archive, then (all at once) samples batches of 256 random windows of `SEQ` steps for
    `seconds`. Totals are the sum of every reader's rate; `n / 1` is the total with n
    readers over the total with one. The server's CPU time is this process's (moto's
    threads; this process only waits meanwhile)."""
    obs = observations(dtype, block)
    blocks = max(1, steps // ROWS // block)
    local = os.path.join(folder, f"readers-{dtype}.zarr")
    _write_archive(local, obs, blocks)
    out = []
    with moto_server() as options:
        url = f"s3://{BUCKET}/readers-{dtype}-{os.getpid()}.zarr"
        _write_archive(url, obs, blocks, storage_options=options)
        procs = [_reader_process() for _ in range(max(counts))]
        try:
            for where, store, opts in (("local", local, None), ("S3 (moto)", url, options)):
                first = None
                for n in counts:
                    run = {"store": store, "options": opts, "seconds": seconds, "batch": 256}
                    for i, proc in enumerate(procs[:n]):
                        _ask(proc, json.dumps({**run, "seq": SEQ, "seed": i}))
                    for proc in procs[:n]:
                        assert _answer(proc) == "ready"
                    c0 = time.process_time()
                    for proc in procs[:n]:
                        _ask(proc, "go")
                    got = [json.loads(_answer(proc)) for proc in procs[:n]]
                    server_cpu = time.process_time() - c0
                    rates = [g["windows"] / g["seconds"] for g in got]
                    mbs = [g["bytes"] / g["seconds"] / 1e6 for g in got]
                    first = first or sum(rates)
                    wall = max(g["seconds"] for g in got)
                    out.append(
                        {
                            "dtype": dtype,
                            "store": where,
                            "readers": n,
                            "windows/s": f"{sum(rates):.0f}",
                            "MB/s": f"{sum(mbs):.1f}",
                            "windows/s per reader": "/".join(f"{r:.0f}" for r in rates),
                            "MB/s per reader": "/".join(f"{m:.1f}" for m in mbs),
                            "n / 1": f"{sum(rates) / first:.2f}",
                            "readers' CPU (cores)": f"{sum(g['cpu'] for g in got) / wall:.2f}",
                            "server CPU (cores)": (
                                f"{server_cpu / wall:.2f}" if opts is not None else ""
                            ),
                        }
                    )
        finally:
            for proc in procs:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.close()
                proc.wait(timeout=60)
                proc.stdout.close()
    shutil.rmtree(local)
    return out


def readers_table(
    folder: str, dtypes: list[str], steps: int, block: int, counts: list[int], seconds: float
) -> str:
    rows = []
    for dtype in dtypes:
        rows += many_readers(folder, dtype, steps, block, counts, seconds)
    return (
        f"\n{', '.join(map(str, counts))} reader processes at once (this machine: "
        f"{os.cpu_count()} cores), each sampling batches of 256 windows of {SEQ} steps for "
        f"{seconds:g} s from one archive; per reader: reader 1/reader 2/...; moto's S3 server "
        "runs in this process, on loopback\n" + table(rows)
    )


def larger_than_memory(
    folder: str,
    dtype: str,
    data_bytes: int,
    limit_bytes: int,
    how: str,
    block: int,
    seconds: float,
) -> list[dict]:
    """Write an archive of `data_bytes` (raw) of `observations` and each step's index `t`,
    then, in a process limited to `limit_bytes` (`_memory.MemoryLimit`: a memory cgroup
    where one can be made, else `RLIMIT_DATA`; `how` chooses), read every step of it (`iter`)
    and sample batches of 256 random windows of `SEQ` steps from all of it for `seconds`,
    checking `t` in both; its peak resident memory, and whether the limit held (the process
    ended well, the kernel killed nothing) and is enforced (a process writing 1.5 times the
    limit, run the same way, does not survive)."""
    from ._memory import MemoryLimit

    obs = observations(dtype, block)
    step_bytes = obs[0, 0].nbytes + 4
    blocks = max(1, -(-data_bytes // (ROWS * block * step_bytes)))
    path = os.path.join(folder, f"large-{dtype}.zarr")
    example = {"obs": jnp.zeros(SHAPE, obs.dtype), "t": jnp.zeros((), jnp.int32)}
    ring = eb.RingStorage(example, rows=ROWS, length=block)
    archive = Archive(path, ring, progress=False)
    t_write = 0.0
    for i in range(blocks):
        t = np.broadcast_to(np.arange(i * block, (i + 1) * block, dtype=np.int32), (ROWS, block))
        ring = ring_holding(ring, [np.roll(obs, i, axis=1), t], (i + 1) * block)
        t0 = time.perf_counter()
        archive.write(ring)
        t_write += time.perf_counter() - t0
    raw, stored = archive.nbytes()
    archive.close()
    del ring
    evict(path)
    argv = [sys.executable, "-m", "benchmarks._archive_reader", "whole", path]
    argv += [str(seconds), "256", str(SEQ)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with MemoryLimit(limit_bytes, how) as limit:
        done = subprocess.run(
            limit.command(argv), capture_output=True, text=True, cwd=ROOT, env=env
        )
        stats = limit.stats()
        enforced = limit.enforced()
        mechanism = limit.mechanism
    shutil.rmtree(path)
    if done.returncode != 0:
        raise RuntimeError(
            f"the reader limited to {limit_bytes / 1e9:.2f} GB by {mechanism} failed (exit "
            f"status {done.returncode}, cgroup {stats}):\n{done.stderr[-3000:]}"
        )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    held = stats.get("oom_kills", 0) == 0 and got["peak_rss"] <= limit_bytes
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    rows = [
        ("data", f"{gb(raw)} raw, {gb(stored)} stored, {got['steps']} steps x {ROWS} rows"),
        ("limit", f"{gb(limit_bytes)} by {mechanism}"),
        ("write (unlimited process)", mbps(raw, t_write)),
        ("read every step (iter)", mbps(got["bytes"], got["read_s"])),
        ("read, per CPU-second", f"{got['bytes'] / got['read_cpu'] / 1e6:.0f} MB/CPU-s"),
        ("sample 256 x 8 steps", f"{got['windows'] / got['sample_s']:.0f} windows/s"),
        ("sample, bytes returned", mbps(got["window_bytes"], got["sample_s"])),
        (
            "peak RSS (VmHWM)",
            f"{gb(got['peak_rss'])} (after opening and one sample: {gb(got['base_rss'])})",
        ),
        ("VmData at the end (what RLIMIT_DATA counts)", gb(got["vm_data"])),
    ]
    if stats.get("peak_bytes") is not None:
        rows.append(("cgroup peak (page cache it brought in too)", gb(stats["peak_bytes"])))
    rows.append(("limit held", "yes" if held else f"NO (cgroup {stats})"))
    rows.append(("limit enforced (1.5x the limit stopped)", "yes" if enforced else "NO"))
    return [{"figure": k, "value": v} for k, v in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="total steps (rows x time)")
    parser.add_argument("--block", type=int, default=2048, help="ring length per row")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--codecs", default="zstd,lz4,none", help="compressions to run")
    parser.add_argument("--dtypes", default="uint8,float32")
    parser.add_argument("--fsync", action="store_true", help="also zstd with fsync=True")
    parser.add_argument("--no-vault", action="store_true")
    parser.add_argument(
        "--variants", action="store_true", help="only the read rate of threads/codecs/shards"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of --variants")
    parser.add_argument(
        "--small-writes", action="store_true", help="only the cost of writing 1, 16, 256 steps"
    )
    parser.add_argument(
        "--against",
        default=None,
        help="a folder holding another version as `equibuffer_old`: paired, in one process",
    )
    parser.add_argument(
        "--zarr-path",
        action="store_true",
        help="only the archive's own chunk I/O against zarr's own path (--repeats rounds)",
    )
    parser.add_argument(
        "--background",
        action="store_true",
        help="only write against write_async in a loop with a training phase between writes",
    )
    parser.add_argument(
        "--readers",
        default="1,2,4",
        help="reader processes sampling at once, local and on moto's S3 server ('' for none)",
    )
    parser.add_argument("--readers-only", action="store_true", help="only the table of --readers")
    parser.add_argument(
        "--reader-seconds",
        type=float,
        default=None,
        help="how long each reader samples (default 10 s, 3 with --quick)",
    )
    parser.add_argument(
        "--larger-than-memory",
        action="store_true",
        help="only: write --data-gb, read and sample it all in a process limited to --limit-gb",
    )
    parser.add_argument(
        "--data-gb", type=float, default=None, help="raw GB written (default 4, 1 with --quick)"
    )
    parser.add_argument(
        "--limit-gb",
        type=float,
        default=None,
        help="the reading process's memory limit (default 1, 0.5 with --quick)",
    )
    parser.add_argument(
        "--limit-with",
        choices=("auto", "cgroup", "rlimit"),
        default="auto",
        help="a memory cgroup (v2 or v1) where one can be made, else RLIMIT_DATA (auto)",
    )
    parser.add_argument(
        "--data",
        choices=("frames", "random"),
        default=None,
        help="compressible rendered frames (the default) or incompressible random steps "
        "(the default of --larger-than-memory: as large on disk as in memory)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="drop the files from the page cache before reads"
    )
    args = parser.parse_args()
    global DATA, COLD
    DATA = args.data or ("random" if args.larger_than_memory else "frames")
    COLD = args.cold
    steps = args.steps or (2**14 if args.quick else 2**17)
    block = min(args.block, steps // ROWS)
    counts = [int(n) for n in args.readers.split(",") if n]
    if args.readers_only and not counts:
        parser.error("--readers-only needs reader counts (--readers 1,2,4)")
    seconds = args.reader_seconds or (3.0 if args.quick else 10.0)
    folder = tempfile.mkdtemp(prefix="bench-archive-", dir=args.dir)
    try:
        print(
            f"{steps} steps = {ROWS} rows x {steps // ROWS}, obs {SHAPE}, ring {block}/row, "
            f"data {DATA}, page cache {'dropped before reads' if COLD else 'kept'}"
        )
        if args.larger_than_memory:
            data_gb = args.data_gb or (1.0 if args.quick else 4.0)
            limit_gb = args.limit_gb or (0.5 if args.quick else 1.0)
            dtype = args.dtypes.split(",")[0]
            figures = larger_than_memory(
                folder, dtype, int(data_gb * 1e9), int(limit_gb * 1e9), args.limit_with,
                block, seconds,
            )  # fmt: skip
            print(f"\nLarger than memory ({dtype}, {DATA}, 256 windows of {SEQ} steps)")
            print(table(figures), flush=True)
            return
        if args.readers_only:
            print(readers_table(folder, args.dtypes.split(","), steps, block, counts, seconds))
            return
        if args.background:
            for dtype in args.dtypes.split(","):
                print(table(background_writes(folder, dtype, block, 8, 200.0)), flush=True)
            return
        if args.against:
            rows = against(
                folder, args.against, args.dtypes.split(","), args.codecs.split(","), args.repeats
            )
            print(table(rows), flush=True)
            return
        if args.zarr_path:
            for dtype in args.dtypes.split(","):
                print(table(zarr_paths(folder, dtype, steps, block, args.repeats)), flush=True)
            return
        if args.variants or args.small_writes:
            for dtype in args.dtypes.split(","):
                if args.variants:
                    print(
                        table(read_variants(folder, dtype, steps, block, args.repeats)), flush=True
                    )
                if args.small_writes:
                    print(table(small_writes(folder, dtype, steps, block)), flush=True)
            return
        nbytes = min(steps * int(np.prod(SHAPE)) * 4, 1 << 30)
        dw, dr = disk_bandwidth(folder, nbytes)
        print(
            f"disk: write+fsync {dw / 1e6:.0f} MB/s, read {dr / 1e6:.0f} MB/s ({nbytes >> 20} MiB)"
        )
        rows = []
        windows = []
        for dtype in args.dtypes.split(","):
            default: dict = {}
            runs = ["zstd", *(c for c in args.codecs.split(",") if c != "zstd")]
            runs += ["zstd+fsync"] if args.fsync else []
            for run in runs:
                compression, _, sync = run.partition("+")
                r = bench_dtype(folder, dtype, steps, block, compression, fsync=bool(sync))  # type: ignore[arg-type]
                row = {
                    "dtype": dtype,
                    "store": f"equibuffer ({run})",
                    "write": mbps(r["payload"], r["write_s"]),
                    "read": mbps(r["payload"], r["read_s"]),
                    "write/disk": f"{r['payload'] / r['write_s'] / dw:.2f}",
                    "read/disk": f"{r['payload'] / r['read_s'] / dr:.2f}",
                    "ratio": f"{r['ratio']:.2f}",
                }
                rates = codec_rate(r["obs"], compression) if not sync else None  # type: ignore[arg-type]
                if rates:
                    row["write/codec"] = f"{r['payload'] / r['write_s'] / rates[0]:.2f}"
                    row["write/codec, writes 2+"] = (
                        f"{r['payload'] / r['steady_write_s'] / rates[0]:.2f}"
                    )
                    row["read/codec"] = f"{r['payload'] / r['read_s'] / rates[1]:.2f}"
                    row["codec encode, decode"] = (
                        f"{mbps(1, 1 / rates[0])}, {mbps(1, 1 / rates[1])}"
                    )
                else:
                    row.update(dict.fromkeys(CODEC_COLUMNS, ""))
                if run == "zstd":
                    default = r
                    wb, wo, length = bench_windows(r["path"], 8 if args.quick else 40)
                    windows.append(
                        {
                            "dtype": dtype,
                            "archive steps/row": length,
                            "sample() windows/s": f"{wb:.0f}",
                            "one zarr slice each, windows/s": f"{wo:.0f}",
                            "speed-up": f"{wb / wo:.1f}x",
                        }
                    )
                rows.append(row)
                shutil.rmtree(r["path"])
            if args.no_vault:
                continue
            vw, vr = bench_vault(folder, dtype, default["obs"], default["blocks"])
            shutil.rmtree(os.path.join(folder, "vaults"), ignore_errors=True)
            rows.append(
                {
                    "dtype": dtype,
                    "store": "flashbax Vault",
                    "write": mbps(default["payload"], vw),
                    "read": mbps(default["payload"], vr),
                    "write/disk": f"{default['payload'] / vw / dw:.2f}",
                    "read/disk": f"{default['payload'] / vr / dr:.2f}",
                    "ratio": "",
                    **dict.fromkeys(CODEC_COLUMNS, ""),
                }
            )
            rows.append(
                {
                    "dtype": dtype,
                    "store": "zstd vs Vault",
                    "write": f"{vw / default['write_s']:.1f}x",
                    "read": f"{vr / default['read_s']:.1f}x",
                    "write/disk": "",
                    "read/disk": "",
                    "ratio": "",
                    **dict.fromkeys(CODEC_COLUMNS, ""),
                }
            )
        print(table(rows))
        print(
            "\nRandom windows of 8 steps, uniform with replacement over (row, start), from a "
            "freshly opened archive; the baseline reads the same windows one zarr slice each"
        )
        print(table(windows))
        if counts:
            print(readers_table(folder, args.dtypes.split(","), steps, block, counts, seconds))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
