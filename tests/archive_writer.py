"""A writer for the archive crash tests: `python tests/archive_writer.py STORE [OPTIONS_JSON]
[SHARD_STEPS]`, or `python tests/archive_writer.py --serve` (a fork server, below).

A writer opens (or creates) the archive, restores its ring from it, then adds steps whose values
are a function of (row, absolute step) and writes them, in random amounts, forever, printing
`committed N` after every write returns. The test SIGKILLs it at a random moment.

It is light on purpose (one starts per kill): no buffer, so nothing is compiled (the ring state
after each add is built directly with `ring_holding`, what `RingStorage.write` leaves), and the
fork server pays the imports once: it reads lines `STORE<TAB>OPTIONS<TAB>SHARD_STEPS<TAB>LOG`,
forks a writer process for each (its output going to the file LOG) and answers `pid N`, then
`status S` (the `waitpid` status) once that writer has ended. It forks before JAX starts a
backend or zarr its event loop; each writer starts both itself.
"""

import json
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from equibuffer._archive import Archive, ring_holding
from equibuffer._ring import RingStorage


ROWS, MAX_LENGTH = 2, 24


def example() -> dict:
    return {"obs": jnp.zeros(4, jnp.float32), "flag": jnp.zeros((), jnp.bfloat16)}


def values(rows: int, first: int, count: int) -> dict:
    """The data every test expects at absolute steps `first, ..., first + count - 1`."""
    steps = np.arange(first, first + count, dtype=np.float64)
    row = np.arange(rows, dtype=np.float64)[:, None]
    obs = (row * 100_000 + steps)[..., None] + np.arange(4) / 8
    flag = (steps % 7)[None].repeat(rows, 0)
    return {"obs": obs.astype(np.float32), "flag": flag.astype(jnp.bfloat16)}


def run(store: str, options: dict | None, shard_steps: int | None) -> None:
    ring = RingStorage(example(), rows=ROWS, length=MAX_LENGTH)
    archive = Archive(
        store,
        ring,
        chunk_steps=4,
        shard_steps=shard_steps,
        progress=False,
        storage_options=options,
    )
    ring = archive.restore(ring)
    rng = np.random.default_rng()
    print(f"committed {len(archive)}", flush=True)
    while True:
        total = ring.steps_added() + int(rng.integers(1, MAX_LENGTH + 1))
        held = min(total, MAX_LENGTH)
        ring = ring_holding(ring, jax.tree.leaves(values(ROWS, total - held, held)), total)
        archive.write(ring)
        print(f"committed {len(archive)}", flush=True)


def serve() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)  # fork with numpy's idle BLAS thread
    for line in sys.stdin:
        store, options, shard_steps, log = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the writer: never returns to this loop
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                shards = int(shard_steps) if shard_steps else None  # "": the default
                run(store, json.loads(options) if options else None, shards)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"status {status}", flush=True)


def main() -> None:
    if sys.argv[1] == "--serve":
        serve()
        return
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
    run(sys.argv[1], options, int(sys.argv[3]) if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    main()
