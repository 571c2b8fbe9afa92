"""A writer for the archive crash tests: `python tests/archive_writer.py STORE [OPTIONS_JSON]`.

It opens (or creates) the archive, restores its buffer from it, then adds steps whose values are
a function of (row, absolute step) and writes them, in random amounts, forever, printing
`committed N` after every write returns. The test SIGKILLs it at a random moment.
"""

import json
import sys

import jax.numpy as jnp
import numpy as np

import equibuffer as eb
from equibuffer._archive import Archive


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


def main() -> None:
    store = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    buffer = eb.TrajectoryBuffer(
        example(), add_batch_size=ROWS, max_length=MAX_LENGTH, sequence_length=2
    )
    archive = Archive(
        store, buffer, chunk_steps=4, shard_steps=8, progress=False, storage_options=options
    )
    buffer = archive.restore(buffer)
    rng = np.random.default_rng()
    print(f"committed {len(archive)}", flush=True)
    while True:
        total = buffer.storage.steps_added()
        count = int(rng.choice([1, 3, 7, MAX_LENGTH]))  # few shapes: few compilations
        batch = values(ROWS, total, count)
        buffer = buffer.add({k: jnp.asarray(v) for k, v in batch.items()})
        archive.write(buffer)
        print(f"committed {len(archive)}", flush=True)


if __name__ == "__main__":
    main()
