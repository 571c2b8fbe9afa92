"""A writer process of `bench_writers.py` (`python -m benchmarks._writer CONFIG`).

`CONFIG` is a JSON object: `layout` ("A", "B" or "C"), `dir` (the data set's folder),
`block` (the path of a `.npy` of every row's first block, `(rows, steps, *obs)`), `index` and
`rows` (this writer's number and its rows `[r0, r1)`), `writes` (blocks in all) and `lock`
(layout C: hold an flock around every write). Write `k` of a row is its block rolled by `k`
steps along time, so that every stored step can be checked against what was written.

The writer opens its part (a resumed writer continues after its last commit), prints
`opened SECONDS COMMITTED` (the time the opening took, the steps already committed), waits for
a line `go`, then for each block prints `start STEPS` (the length it is writing up to) and,
once that block is committed, `commit STEPS T0 T1` (`time.monotonic()` before and after).
"""

import contextlib
import fcntl
import functools
import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import zarr


def expected(block: np.ndarray, k: int) -> np.ndarray:
    """Write `k` of the rows whose first block is `block`."""
    return np.roll(block, k, axis=1)


class ArchiveWriter:
    """Layout A: this writer's own archive (`eb.Archive`), written from a `TrajectoryBuffer`
    of its rows, added to by a donated jitted call as in training; a resumed writer restores
    the buffer from the archive (`restore`)."""

    def __init__(self, config: dict, rows: int, steps: int, shape: tuple[int, ...]):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        import equibuffer as eb

        def make() -> eb.TrajectoryBuffer:
            example = {"obs": jnp.zeros(shape, jnp.uint8)}
            return eb.TrajectoryBuffer(
                example, add_batch_size=rows, max_length_time_axis=steps, sequence_length=1
            )

        # Committed to the device as the add's results are: one compilation serves every add
        # (a fresh or restored buffer's uncommitted arrays would compile it again).
        on_device = functools.partial(jax.device_put, device=jax.devices()[0])

        self.add = eqx.filter_jit(lambda buffer, x: buffer.add(x), donate="all")
        self.add(on_device(make()), {"obs": np.zeros((rows, steps, *shape), np.uint8)})
        t0 = time.perf_counter()
        path = f"{config['dir']}/w{config['index']}.zarr"
        self.archive = eb.Archive(path, make(), progress=False)
        self.committed = len(self.archive)
        self.buffer = on_device(self.archive.restore(make()) if self.committed else make())
        self.open_s = time.perf_counter() - t0

    def write(self, start: int, data: np.ndarray) -> None:
        self.buffer = self.add(self.buffer, {"obs": data})
        self.archive.write(self.buffer)


class ZarrWriter:
    """Layouts B and C: rows `[r0, r1)` of the one zarr array `obs` (made by the parent, at
    its full size), written with zarr's own API; then this writer's committed length, in its
    own document `commits/w{index}.json` beside the array (a temporary file renamed over it).
    With `lock` (layout C), every write holds an exclusive flock on the file `lock` there."""

    def __init__(self, config: dict, rows: int, steps: int, shape: tuple[int, ...]):
        t0 = time.perf_counter()
        folder = config["dir"]
        self.rows = slice(*config["rows"])
        self.array = zarr.open_array(os.path.join(folder, "set.zarr"), path="obs", mode="r+")
        self.doc = os.path.join(folder, "commits", f"w{config['index']}.json")
        self.committed = committed(self.doc)
        self.lock = open(os.path.join(folder, "lock"), "a") if config["lock"] else None  # noqa: SIM115
        with self.locked():  # taken once: a killed holder's flock went with its process
            pass
        self.open_s = time.perf_counter() - t0

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if self.lock is None:
            yield
            return
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)

    def write(self, start: int, data: np.ndarray) -> None:
        with self.locked():
            self.array[self.rows, start : start + data.shape[1]] = data
        with open(self.doc + ".tmp", "w") as f:
            json.dump({"length": start + data.shape[1]}, f)
        os.replace(self.doc + ".tmp", self.doc)


def committed(doc: str) -> int:
    """The length a commit document of layouts B and C holds (0 where none was written)."""
    try:
        with open(doc) as f:
            return json.load(f)["length"]
    except FileNotFoundError:
        return 0


def main() -> None:
    config = json.loads(sys.argv[1])
    r0, r1 = config["rows"]
    block = np.load(config["block"])[r0:r1]
    steps = block.shape[1]
    kind = ArchiveWriter if config["layout"] == "A" else ZarrWriter
    writer = kind(config, r1 - r0, steps, block.shape[2:])
    print(f"opened {writer.open_s} {writer.committed}", flush=True)
    assert sys.stdin.readline().strip() == "go"
    for k in range(writer.committed // steps, config["writes"]):
        data = expected(block, k)
        print(f"start {(k + 1) * steps}", flush=True)
        t0 = time.monotonic()
        writer.write(k * steps, data)
        print(f"commit {(k + 1) * steps} {t0} {time.monotonic()}", flush=True)


if __name__ == "__main__":
    main()
