"""`ArchiveLoader` from a cold archive larger than the memory limit (issue 27).

For uint8 frames and float32 observations (`(32, 32, 3)` per step, 8 rows, each step's index
in `t`): writes `--data-gb` of raw data (random, so stored about as large), drops it from the
page cache, and measures, in this order, each read cold:

- the disk's own rate: every file of the archive read in order by plain file reads;
- `Archive.iter` over every step (default blocks);
- in a process limited to `--limit-gb` (`_memory.MemoryLimit`), `ArchiveLoader` (batches of
  256 windows of 8 steps, `pool_blocks=2`) for `--seconds`: windows/s and bytes of windows
  per second against the disk's rate, its peak resident memory; then, from a cold cache
  again, a learner step of `--step-ms` milliseconds (a jitted loop of matrix products,
  calibrated) on each batch: the fraction of the time the learner waits for data.

    python -m benchmarks.bench_loader                      # 4 GB under 1 GB
    python -m benchmarks.bench_loader --quick              # 2 GB under 0.5 GB, 8 s runs

The archive is removed afterwards. Benchmarks, not tests: no pass/fail on speed.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb
from equibuffer._archive import Archive, ring_holding

from ._memory import MemoryLimit
from ._timing import table


ROWS, SHAPE, SEQ, BATCH, BLOCK = 8, (32, 32, 3), 8, 256, 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, sys, time
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
import equibuffer as eb

path, seconds, step_ms = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(field + ":"))

archive = eb.Archive(path, mode="r", progress=False)
w = jnp.ones((256, 256), jnp.float32) / 256

@eqx.filter_jit
def learn(x, batch, reps):
    def body(_, x):
        return jnp.tanh(x @ w)
    x = jax.lax.fori_loop(0, reps, body, x)
    return x + jnp.mean(batch.experience["t"][:, 0].astype(jnp.float32)) * 0

x = jnp.ones((256, 256), jnp.float32)
reps = jnp.int32(1)  # traced: one compile for every count
if step_ms > 0:  # calibrate the learner step to step_ms
    fake = eb.LoaderBatch({"t": jnp.zeros((256, 8), jnp.int32)}, jnp.zeros(256, jnp.int32),
                          jnp.zeros(256, jnp.int32), jnp.ones(256, bool))
    jax.block_until_ready(learn(x, fake, reps))
    for k in range(20):
        reps = jnp.int32(2 ** k)
        times = []
        for _ in range(3):  # the least of 3: a loaded machine's spikes do not stop the search
            t0 = time.perf_counter(); jax.block_until_ready(learn(x, fake, reps))
            times.append(time.perf_counter() - t0)
        if min(times) * 1e3 >= step_ms:
            break
base = status("VmHWM")
loader = eb.ArchiveLoader(archive, jax.random.key(0), 256, sequence_length=8, pool_blocks=2,
                          epochs=1)
windows = nbytes = 0
wait = learn_s = 0.0
t0 = time.perf_counter()
with loader:
    it = iter(loader)
    while True:
        a = time.perf_counter()
        batch = next(it, None)
        wait += time.perf_counter() - a
        if batch is None or time.perf_counter() - t0 > seconds:
            break
        m = np.asarray(batch.mask)
        assert (np.asarray(batch.experience["t"])[m] ==
                np.asarray(batch.starts)[m][:, None] + np.arange(8)).all()
        windows += int(m.sum())
        nbytes += sum(x.nbytes for x in jax.tree.leaves(batch.experience)) * int(m.sum()) // 256
        if step_ms > 0:
            a = time.perf_counter(); x = jax.block_until_ready(learn(x, batch, reps))
            learn_s += time.perf_counter() - a
elapsed = time.perf_counter() - t0
print(json.dumps({"windows": windows, "bytes": nbytes, "seconds": elapsed, "wait": wait,
                  "learn": learn_s, "base_rss": base, "peak_rss": status("VmHWM"),
                  "resident_bytes": loader.resident_bytes}))
"""


def evict(path: str) -> None:
    """Flush, then drop every file under `path` from the page cache (no root needed)."""
    os.sync()
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_rate(path: str) -> float:
    """Bytes per second of every file under `path` read in order by plain reads, cold."""
    evict(path)
    total, t0 = 0, time.perf_counter()
    for d, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(d, name), "rb", buffering=0) as f:
                while chunk := f.read(16 << 20):
                    total += len(chunk)
    return total / (time.perf_counter() - t0)


def write(path: str, dtype: str, data_bytes: int, storage_options: dict | None = None) -> int:
    rng = np.random.default_rng(0)
    step_bytes = int(np.prod(SHAPE)) * np.dtype(dtype).itemsize + 4
    blocks = max(1, -(-data_bytes // (ROWS * BLOCK * step_bytes)))
    example = {"obs": jnp.zeros(SHAPE, dtype), "t": jnp.int32(0)}
    ring = eb.RingStorage(example, rows=ROWS, length=BLOCK)
    if dtype == "uint8":
        obs = rng.integers(0, 256, (ROWS, BLOCK, *SHAPE), dtype=np.uint8)
    else:
        obs = rng.standard_normal((ROWS, BLOCK, *SHAPE), dtype=np.float32)
    with Archive(path, ring, progress=False, storage_options=storage_options) as archive:
        for i in range(blocks):
            t = np.broadcast_to(
                np.arange(i * BLOCK, (i + 1) * BLOCK, dtype=np.int32), (ROWS, BLOCK)
            )
            ring = ring_holding(ring, [np.roll(obs, i, axis=1), t], (i + 1) * BLOCK)
            archive.write(ring)
        return archive.nbytes()[1]


def iter_rate(path: str) -> float:
    evict(path)
    archive = Archive(path, mode="r", progress=False)
    raw, t0 = archive.nbytes()[0], time.perf_counter()
    for _ in archive.iter():
        pass
    return raw / (time.perf_counter() - t0)


def loader_run(path: str, limit: int, seconds: float, step_ms: float) -> dict:
    evict(path)
    argv = [sys.executable, "-c", CHILD, path, str(seconds), str(step_ms)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with MemoryLimit(limit) as lim:
        done = subprocess.run(lim.command(argv), capture_output=True, text=True, cwd=ROOT, env=env)
        stats = lim.stats()
    if done.returncode:
        raise RuntimeError(f"loader process failed ({stats}):\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["held"] = stats.get("oom_kills", 0) == 0 and got["peak_rss"] <= limit
    return got


def s3_run(dtype: str, data_bytes: int, seconds: float) -> dict:
    """On moto's S3 server (started here, on loopback, served by this process's threads): the
    store's own rate (every object of the archive fetched in order, as plain GETs),
    `Archive.iter` and the loader (in this process, no memory limit: the archive is small
    enough to stay on the server) against it."""
    import obstore

    from .bench_archive import BUCKET, moto_server

    with moto_server() as options:
        prefix = f"loader-{dtype}-{os.getpid()}.zarr"
        url = f"s3://{BUCKET}/{prefix}"
        stored = write(url, dtype, data_bytes, storage_options=options)
        store = obstore.store.S3Store(BUCKET, **options)
        t0 = time.perf_counter()
        total = 0
        for batch in obstore.list(store, prefix=prefix):
            for meta in sorted(batch, key=lambda m: m["path"]):
                total += len(obstore.get(store, meta["path"]).bytes())
        store_rate = total / (time.perf_counter() - t0)
        archive = Archive(url, mode="r", progress=False, storage_options=options)
        raw, t0 = archive.nbytes()[0], time.perf_counter()
        for _ in archive.iter():
            pass
        iter_rate = raw / (time.perf_counter() - t0)
        loader = eb.ArchiveLoader(
            archive, jax.random.key(0), BATCH, sequence_length=SEQ, pool_blocks=2, epochs=1
        )
        windows = nbytes = 0
        t0 = time.perf_counter()
        with loader:
            for batch in loader:
                m = int(np.asarray(batch.mask).sum())
                windows += m
                nbytes += sum(x.nbytes for x in jax.tree.leaves(batch.experience)) * m // BATCH
                if time.perf_counter() - t0 > seconds:
                    break
        elapsed = time.perf_counter() - t0
    return {
        "stored": stored,
        "store": store_rate,
        "iter": iter_rate,
        "windows": windows / elapsed,
        "bytes": nbytes / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-gb", type=float, default=4.0)
    parser.add_argument("--limit-gb", type=float, default=1.0)
    parser.add_argument("--dtypes", default="uint8,float32")
    parser.add_argument("--seconds", type=float, default=20.0, help="per loader run, at most")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the learner step's cost")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--folder", default=None, help="where the archive goes (default /tmp)")
    parser.add_argument(
        "--s3-gb", type=float, default=0.5, help="data on moto's S3 server (0: no S3 run)"
    )
    parser.add_argument("--no-local", action="store_true", help="only the S3 run")
    args = parser.parse_args()
    if args.quick:
        args.data_gb, args.limit_gb, args.seconds, args.s3_gb = 2.0, 0.5, 8.0, 0.25
    rows = []
    for dtype in args.dtypes.split(",") if not args.no_local else []:
        folder = tempfile.mkdtemp(dir=args.folder)
        path = os.path.join(folder, f"loader-{dtype}.zarr")
        try:
            stored = write(path, dtype, int(args.data_gb * 1e9))
            disk = disk_rate(path)
            it = iter_rate(path)
            free = loader_run(path, int(args.limit_gb * 1e9), args.seconds, 0.0)
            learner = loader_run(path, int(args.limit_gb * 1e9), args.seconds, args.step_ms)
        finally:
            shutil.rmtree(folder)
        rate = free["bytes"] / free["seconds"]
        learner_rate = learner["windows"] / learner["learn"] if learner["learn"] else 0.0
        rows.append({
            "dtype": dtype,
            "data (stored)": f"{stored / 1e9:.2f} GB",
            "limit": f"{args.limit_gb:.2f} GB",
            "disk, cold in order": f"{disk / 1e6:.0f} MB/s",
            "Archive.iter": f"{it / 1e6:.0f} MB/s ({it / disk:.2f}x)",
            "loader windows/s": f"{free['windows'] / free['seconds']:.0f}",
            "loader bytes/s": f"{rate / 1e6:.0f} MB/s ({rate / disk:.2f}x)",
            "peak RSS": f"{free['peak_rss'] / 1e9:.2f} GB (base {free['base_rss'] / 1e9:.2f}, "
                        f"loader bound {free['resident_bytes'] / 1e9:.2f})",
            f"learner {args.step_ms:g} ms: waits": f"{learner['wait'] / learner['seconds']:.0%}",
            "learner alone windows/s": f"{learner_rate:.0f}",
            "loader with learner windows/s": f"{learner['windows'] / learner['seconds']:.0f}",
            "limit held": "yes" if free["held"] and learner["held"] else "NO",
        })  # fmt: skip
    print(table(rows))
    if args.s3_gb > 0:
        s3 = []
        for dtype in args.dtypes.split(","):
            got = s3_run(dtype, int(args.s3_gb * 1e9), args.seconds)
            s3.append({
                "dtype": dtype,
                "data (stored)": f"{got['stored'] / 1e9:.2f} GB",
                "S3 (moto), objects in order": f"{got['store'] / 1e6:.0f} MB/s",
                "Archive.iter": f"{got['iter'] / 1e6:.0f} MB/s ({got['iter'] / got['store']:.2f}x)",
                "loader windows/s": f"{got['windows']:.0f}",
                "loader bytes/s": f"{got['bytes'] / 1e6:.0f} MB/s "
                                  f"({got['bytes'] / got['store']:.2f}x)",
            })  # fmt: skip
        print(table(s3))


if __name__ == "__main__":
    main()
