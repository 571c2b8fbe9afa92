"""A reader process of `bench_archive.py` (`python -m benchmarks._archive_reader MODE`).

`serve`: many readers sampling at once. Each line on stdin is a JSON run `{"store", "options",
"seconds", "batch", "seq", "seed"}`: the reader opens the archive (read-only), samples one batch
(untimed), prints `ready`, waits for a line `go`, then samples random windows
(`archive.sample(rng, batch, seq)`) for `seconds` and prints a JSON line of what it did
(`windows`, `bytes` of the windows returned, `seconds`, `cpu` seconds). The parent starts the
timed part of every reader of a run at once.

`whole PATH SECONDS BATCH SEQ`: larger than memory, run under a memory limit by the parent.
Reads every step of the archive at PATH block by block (`iter`), then samples random windows
from all of it for SECONDS; both check the leaf `t` (each step's index); prints a JSON line of
the rates and the process's peak resident memory.
"""

import json
import sys
import time

import jax
import numpy as np

from equibuffer._archive import Archive


def _nbytes(tree: object) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def serve() -> None:
    for line in sys.stdin:
        run = json.loads(line)
        archive = Archive(run["store"], mode="r", progress=False, storage_options=run["options"])
        rng = np.random.default_rng(run["seed"])
        archive.sample(rng, run["batch"], run["seq"])  # untimed: opening, first reads
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
        windows = nbytes = 0
        t0, c0 = time.perf_counter(), time.process_time()
        end = t0 + run["seconds"]
        while time.perf_counter() < end:
            batch = archive.sample(rng, run["batch"], run["seq"])
            windows += run["batch"]
            nbytes += _nbytes(batch.experience)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        out = {"windows": windows, "bytes": nbytes, "seconds": seconds, "cpu": cpu}
        print(json.dumps(out), flush=True)


def _status(field: str) -> int:
    """A `/proc/self/status` figure in bytes (Linux), 0 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def whole(path: str, seconds: float, batch: int, seq: int) -> None:
    archive = Archive(path, mode="r", progress=False)
    rng = np.random.default_rng(0)
    archive.sample(rng, batch, seq)  # what sampling keeps, before the baseline
    base = _status("VmHWM")
    nbytes = steps = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for start, block in archive.iter():  # every step, block after block
        t = block["t"]
        assert (t == start + np.arange(t.shape[1])).all(), f"wrong steps at {start}"
        steps += t.shape[1]
        nbytes += _nbytes(block)
        del block, t
    read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert steps == len(archive), (steps, len(archive))
    windows = window_bytes = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:  # random windows from anywhere
        sample = archive.sample(rng, batch, seq)
        t = sample.experience["t"]
        assert (t == sample.starts[:, None] + np.arange(seq)).all(), "wrong window"
        windows += batch
        window_bytes += _nbytes(sample.experience)
    sample_s = time.perf_counter() - t0
    out = {
        "steps": steps,
        "bytes": nbytes,
        "read_s": read_s,
        "read_cpu": read_cpu,
        "windows": windows,
        "window_bytes": window_bytes,
        "sample_s": sample_s,
        "base_rss": base,
        # VmHWM, not ru_maxrss: that one keeps the high-water mark of the image before
        # `exec`, a copy of the parent's memory where the launcher forked.
        "peak_rss": _status("VmHWM"),
        "vm_data": _status("VmData"),  # the address space RLIMIT_DATA counts, at the end
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        whole(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
