"""Issue 18: several writer processes of one data set, each its own rows. One archive per writer,
or all of them in one archive? Measured side by side, in one run:

- **A**, one archive per writer (the library): each writer process writes a `TrajectoryBuffer`
  of its rows to its own `eb.Archive` every block; read as one data set by `eb.ArchiveSet`.
- **B**, one zarr array, each writer its rows, shards one row high (so no two writers share an
  object); the parent makes the array at its full size (no writer changes shared metadata);
  each writer writes with zarr's own API, then renames its own commit document (its committed
  length) over the old one. The readable length is the least of the writers' commits.
- **C**, one zarr array in the archive's own layout (each shard holds every row): writers
  share the shards, so each write holds an flock and zarr rewrites the shards it touches
  (read, modify, write). A short run without the lock counts the steps lost to races.

Chunks, shards (in steps) and codec are those `eb.Archive` picks: for A and B those of an
archive of one writer's rows, for C of one of every row. `R = 8` rows of `(32, 32, 3)` uint8
frames (`bench_archive.frames`), blocks of `--block` steps, `--writes` blocks per row, with 1,
2 and 4 writer processes (`benchmarks/_writer.py`, each started with `subprocess`, all
writing at once once every one has opened its part). Reported: the write rate (raw bytes over
the time from the first write to the last commit of all writers, and each writer's own), the
stored objects (files) per GB of raw data, and the reader's side (page cache warm: the data
was just written and checked), a full read and random windows (256 x 8 steps): A through
`ArchiveSet`, and every layout through zarr (one slice per window), ratios to A.

Killed writer: 4 writers; one, at random, is SIGKILLed at a random moment; meanwhile this
process reads the readable prefix and checks it; then every step a writer reported committed
is checked, value for value, and a new process reopens the killed writer's part (A: `Archive`
and `restore`; B: its commit document; C: the flock too) and writes the rest.

    python -m benchmarks.bench_writers            # 16 writes of 512 steps (201 MB), 5 kills
    python -m benchmarks.bench_writers --quick    # 4 writes, 2 kills
    python -m benchmarks.bench_writers --json out.json   # the tables, and the machine
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import jax.numpy as jnp
import numpy as np
import zarr
import zarr.storage

import equibuffer as eb
from equibuffer._archive import _format

from ._machine import describe
from ._timing import table
from ._writer import committed, expected
from .bench_archive import frames, ROWS, SEQ, SHAPE


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 256
STEP = int(np.prod(SHAPE))  # bytes of one step (uint8)


def archive_layout(rows: int, block: int) -> tuple[int, int, str]:
    """`(chunk_steps, shard_steps, compression)` that `eb.Archive` picks for `rows` rows."""
    buffer = eb.TrajectoryBuffer(
        {"obs": jnp.zeros(SHAPE, jnp.uint8)},
        add_batch_size=rows,
        max_length_time_axis=block,
        sequence_length=1,
    )
    with eb.Archive(zarr.storage.MemoryStore(), buffer, progress=False) as archive:
        assert archive.shard_steps is not None
        return archive.chunk_steps, archive.shard_steps, archive.compression


def prepare(layout: str, folder: str, source: str, writers: int, writes: int, lock: bool = True):
    """The folder of a data set of `writers` writers (for B and C, the array at its full
    size); returns each writer's configuration (`benchmarks/_writer.py`) and the shards."""
    os.makedirs(os.path.join(folder, "commits"))
    per = ROWS // writers
    steps = np.load(source, mmap_mode="r").shape[1]
    chunk, shard, compression = archive_layout(ROWS if layout == "C" else per, steps)
    high = {"A": per, "B": 1, "C": ROWS}[layout]
    if layout != "A":
        zarr.open_group(os.path.join(folder, "set.zarr"), mode="w").create_array(
            "obs",
            shape=(ROWS, writes * steps, *SHAPE),
            chunks=(1, chunk, *SHAPE),
            shards=(high, shard, *SHAPE),
            dtype="uint8",
            compressors=_format.compressor(compression),
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": "."},  # as the archive's
        )
    configs = [
        {"layout": layout, "dir": folder, "block": source, "index": i,
         "rows": [i * per, (i + 1) * per], "writes": writes, "lock": lock and layout == "C"}
        for i in range(writers)
    ]  # fmt: skip
    return configs, f"{high} x {shard}"


class Writer:
    """A writer process and the lines it prints (split into words), collected as they come."""

    def __init__(self, config: dict):
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._writer", json.dumps(config)],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[list[str]] = []
        self.reading = threading.Thread(target=self._collect, daemon=True)
        self.reading.start()

    def _collect(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.split())

    def said(self, word: str) -> list[list[str]]:
        return [line[1:] for line in list(self.lines) if line[0] == word]

    def last(self, word: str) -> int:
        """The steps of the last line `word` (`start` or `commit`), 0 where none."""
        said = self.said(word)
        return int(said[-1][0]) if said else 0

    def finish(self) -> int:
        rc = self.proc.wait(600)
        self.reading.join()
        return rc


def start(configs: list[dict]) -> list[Writer]:
    """Start one writer per configuration; once every one has opened its part, tell them all
    to go."""
    writers = [Writer(c) for c in configs]
    while not all(w.said("opened") for w in writers):
        failed = [w.proc.returncode for w in writers if w.proc.poll() is not None]
        if failed:
            raise RuntimeError(f"a writer exited before writing (exit status {failed})")
        time.sleep(0.02)
    for w in writers:
        w.proc.stdin.write("go\n")  # type: ignore[union-attr]
        w.proc.stdin.flush()  # type: ignore[union-attr]
    return writers


def finish(writers: list[Writer]) -> None:
    codes = [w.finish() for w in writers]
    if any(codes):
        raise RuntimeError(f"writers exited with {codes}")


def paths(configs: list[dict]) -> list[str]:
    """The archives of layout A's writers."""
    return [f"{c['dir']}/w{c['index']}.zarr" for c in configs]


def stored(layout: str, config: dict) -> np.ndarray:
    """A writer's rows as stored, up to its own committed length."""
    if layout == "A":
        return eb.Archive(paths([config])[0], mode="r", progress=False).read()["obs"]
    array = zarr.open_array(os.path.join(config["dir"], "set.zarr"), path="obs", mode="r")
    length = committed(os.path.join(config["dir"], "commits", f"w{config['index']}.json"))
    return np.asarray(array[slice(*config["rows"]), :length])


def wrong_steps(data: np.ndarray, block: np.ndarray, first: int = 0) -> int:
    """The (row, step) pairs of `data` (whole blocks, from block number `first`) that differ
    from what was written."""
    steps, wrong = block.shape[1], 0
    for i in range(0, data.shape[1], steps):
        differs = data[:, i : i + steps] != expected(block, first + i // steps)
        wrong += int(differs.any(axis=(2, 3, 4)).sum())
    return wrong


def check(layout: str, configs: list[dict], block: np.ndarray) -> list[tuple[int, int]]:
    """Each writer's committed length and the (row, step) pairs in it that are wrong."""
    out = []
    for c in configs:
        data = stored(layout, c)
        out.append((data.shape[1], wrong_steps(data, block[slice(*c["rows"])])))
    return out


def zarr_members(layout: str, configs: list[dict]) -> tuple[list[zarr.Array], int]:
    """The zarr arrays of the data set (rows in order) and its readable length."""
    folder = configs[0]["dir"]
    if layout == "A":
        length = len(eb.ArchiveSet(paths(configs), progress=False))
        return [zarr.open_array(p, path="obs", mode="r") for p in paths(configs)], length
    docs = [os.path.join(folder, "commits", f"w{c['index']}.json") for c in configs]
    length = min(committed(d) for d in docs)  # the documents first, then the data
    return [zarr.open_array(os.path.join(folder, "set.zarr"), path="obs", mode="r")], length


def read_rates(layout: str, configs: list[dict], batches: int) -> dict[str, tuple[float, float]]:
    """Full-read MB/s and windows/s of `BATCH` x `SEQ` steps: through `ArchiveSet` (A) and
    through zarr (every layout: one slice per window)."""
    out = {}
    if layout == "A":
        data = eb.ArchiveSet(paths(configs), progress=False)
        t0 = time.perf_counter()
        nbytes = data.read()["obs"].nbytes
        full = nbytes / (time.perf_counter() - t0) / 1e6
        data, rng = eb.ArchiveSet(paths(configs), progress=False), np.random.default_rng(0)
        t0 = time.perf_counter()
        for _ in range(batches):
            data.sample(rng, BATCH, SEQ)
        out["ArchiveSet"] = full, batches * BATCH / (time.perf_counter() - t0)
    arrays, length = zarr_members(layout, configs)
    t0 = time.perf_counter()
    nbytes = sum(np.asarray(a[:, :length]).nbytes for a in arrays)
    full = nbytes / (time.perf_counter() - t0) / 1e6
    arrays, _ = zarr_members(layout, configs)
    member = np.repeat(np.arange(len(arrays)), [a.shape[0] for a in arrays])
    offset = np.cumsum([0, *(a.shape[0] for a in arrays)])
    rng, windows = np.random.default_rng(0), BATCH * max(1, batches // 10)
    rows, starts = rng.integers(0, ROWS, windows), rng.integers(0, length - SEQ + 1, windows)
    t0 = time.perf_counter()
    for r, s in zip(rows, starts, strict=True):
        arrays[member[r]][r - offset[member[r]], s : s + SEQ]
    out["zarr"] = full, len(rows) / (time.perf_counter() - t0)
    return out


def newest_block(layout: str, configs: list[dict], steps: int) -> tuple[int, np.ndarray]:
    """The data set's readable length and its newest `steps` steps, read as its reader
    would (A: `ArchiveSet`; B and C: the commit documents, then the array)."""
    if layout == "A":
        data = eb.ArchiveSet(paths(configs), progress=False)
        n = len(data)
        return n, data.read(n - steps, n)["obs"] if n else np.zeros(0)
    arrays, n = zarr_members(layout, configs)
    return n, np.asarray(arrays[0][:, n - steps : n]) if n else np.zeros(0)


def run(layout: str, folder: str, source: str, writers: int, args: argparse.Namespace) -> dict:
    """One data set written by `writers` processes at once, checked, then read."""
    configs, shards = prepare(layout, folder, source, writers, args.writes)
    procs = start(configs)
    finish(procs)
    commits = [[(float(t0), float(t1)) for _, t0, t1 in w.said("commit")] for w in procs]
    spans = [(c[0][0], c[-1][1]) for c in commits]
    wall = max(b for _, b in spans) - min(a for a, _ in spans)
    raw = ROWS * args.writes * args.block * STEP
    assert all(w == 0 for _, w in check(layout, configs, np.load(source))), "wrong data"
    objects = sum(len(files) for _, _, files in os.walk(folder))
    reads = read_rates(layout, configs, args.batches)
    shutil.rmtree(folder)
    return {
        "shards": shards,
        "objects": objects / (raw / 1e9),
        "write": raw / wall / 1e6,
        "per_writer": [raw / writers / (b - a) / 1e6 for a, b in spans],
        "wall": wall,
        "reads": reads,
    }


def killed_writer(layout: str, root: str, source: str, est: float, trial: int, args) -> dict:
    """4 writers; one SIGKILLed `uniform(0.1, 0.8) * est` seconds after they start, while
    this process checks the readable prefix; then the checks and the resumed writer."""
    rng = random.Random(trial)
    folder = os.path.join(root, f"kill-{layout}-{trial}")
    configs, _ = prepare(layout, folder, source, 4, args.writes)
    block = np.load(source)
    victim, delay = rng.randrange(4), rng.uniform(0.1, 0.8) * est
    writers = start(configs)
    t_go, killed_at, reads, seen_wrong = time.monotonic(), None, 0, 0
    while killed_at is None or any(w.proc.poll() is None for w in writers):
        if killed_at is None and time.monotonic() >= t_go + delay:
            early = writers[victim].proc.poll() is not None
            writers[victim].proc.kill()
            writers[victim].finish()
            killed_at = "finished first" if early else f"{time.monotonic() - t_go:.2f}"
        length, data = newest_block(layout, configs, args.block)
        if length:
            seen_wrong += wrong_steps(data, block, length // args.block - 1)
            reads += 1
        time.sleep(0.02)
    finish([w for i, w in enumerate(writers) if i != victim])
    reported, started = writers[victim].last("commit"), writers[victim].last("start")
    state = check(layout, configs, block)
    total = args.writes * args.block
    length = state[victim][0]
    lost = max(0, reported - length) + sum(
        total - n for i, (n, _) in enumerate(state) if i != victim
    )
    resumed = start([configs[victim]])[0]
    finish([resumed])
    opened = float(resumed.said("opened")[0][0])
    first = resumed.said("commit")
    after = check(layout, configs, block)
    shutil.rmtree(folder)
    return {
        "layout": layout,
        "killed at (s)": killed_at,
        "committed lost": lost,
        "committed wrong": sum(w for _, w in state),
        "uncommitted lost": max(0, started - length),
        "reader checks (wrong)": f"{reads} ({seen_wrong})",
        "reopen": ms(opened),
        "reopen + first write": ms(opened + float(first[0][2]) - float(first[0][1]))
        if first
        else "(none left)",
        "complete after": all(n == total and w == 0 for n, w in after),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--writes", type=int, default=None, help="blocks per row (16; 4 quick)")
    parser.add_argument("--block", type=int, default=512, help="steps per write")
    parser.add_argument("--writers", default="1,2,4", help="writer processes per data set")
    parser.add_argument("--trials", type=int, default=None, help="killed writers (5; 2 quick)")
    parser.add_argument("--batches", type=int, default=None, help="sampled batches (20; 5)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    args.writes = args.writes or (4 if args.quick else 16)
    args.trials = args.trials or (2 if args.quick else 5)
    args.batches = args.batches or (5 if args.quick else 20)
    counts = [int(n) for n in args.writers.split(",")]
    root = tempfile.mkdtemp(prefix="bench-writers-", dir=args.dir)
    source = os.path.join(root, "block.npy")
    np.save(source, frames(ROWS, args.block, seed=1))
    machine = describe()
    raw = ROWS * args.writes * args.block * STEP
    print(
        f"{ROWS} rows x {args.writes} writes of {args.block} steps of {SHAPE} uint8 frames "
        f"({raw / 1e6:.0f} MB raw); page cache warm; load average {machine['load_average_1_5_15']}"
    )
    try:
        got = {
            (layout, n): run(layout, os.path.join(root, f"{layout}{n}"), source, n, args)
            for n in counts
            for layout in "ABC"
        }
        writes, reads = [], []
        for (layout, n), r in got.items():
            a = got["A", n]
            writes.append({
                "layout": layout, "W": n, "shards (rows x steps)": r["shards"],
                "objects per GB": f"{r['objects']:.0f}", "write MB/s": f"{r['write']:.0f}",
                "write / A": f"{r['write'] / a['write']:.2f}",
                "per writer MB/s": "/".join(f"{x:.0f}" for x in r["per_writer"]),
            })  # fmt: skip
            for reader, (full, windows) in r["reads"].items():
                full_a, windows_a = a["reads"][reader]
                reads.append({
                    "layout": layout, "W": n, "reader": reader, "read MB/s": f"{full:.0f}",
                    "read / A": f"{full / full_a:.2f}", "windows/s": f"{windows:.0f}",
                    "windows / A": f"{windows / windows_a:.2f}",
                })  # fmt: skip
        print("\nWrites (all writers at once)")
        print(table(writes))
        print(f"\nReads (page cache warm; windows of {SEQ} steps; ratios: the same reader on A)")
        print(table(reads), flush=True)
        kills = []
        for layout in "ABC":
            est = got.get((layout, 4), got[layout, counts[-1]])["wall"]
            for trial in range(args.trials):
                kills.append(killed_writer(layout, root, source, est, trial, args))
        print("\nOne of 4 writers SIGKILLed (lost: steps; wrong: (row, step) pairs)")
        print(table(kills))
        configs, shards = prepare(
            "C", os.path.join(root, "unlocked"), source, 4, args.writes, False
        )
        finish(start(configs))
        state = check("C", configs, np.load(source))
        unlocked = {
            "shards": shards,
            "row-steps written": ROWS * args.writes * args.block,
            "committed": sum(n for n, _ in state) * (ROWS // 4),
            "wrong (lost updates)": sum(w for _, w in state),
        }
        print("\nLayout C, 4 writers WITHOUT the lock")
        print(table([unlocked]))
        if args.json:
            with open(args.json, "w") as f:
                results = {"machine": machine, "args": vars(args), "writes": writes}
                json.dump({**results, "reads": reads, "killed": kills, "unlocked": [unlocked]},
                          f, indent=1)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
