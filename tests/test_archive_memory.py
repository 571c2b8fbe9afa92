"""Offline data larger than memory: reading and sampling an archive several times larger than
the memory the process grows by (a test at a small scale of issue 18's 4 GB under 1 GB; the
throughput is `benchmarks/bench_archive.py`'s)."""

import json
import subprocess
import sys
import textwrap

import pytest


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import jax, jax.numpy as jnp, numpy as np
    import equibuffer as eb
    from equibuffer._archive import Archive, ring_holding

    path, mib = sys.argv[1], int(sys.argv[2])
    rows, length, shape = 8, 256, (32, 32, 3)  # one write: 8 x 256 x 3 KiB = 6 MiB
    example = {"obs": jnp.zeros(shape, jnp.uint8), "reward": jnp.float32(0)}
    ring = eb.RingStorage(example, rows=rows, length=length)
    writer = Archive(path, ring, progress=False)
    rng = np.random.default_rng(0)
    total = 0
    while writer.nbytes()[0] < mib << 20:
        obs = rng.integers(0, 256, (rows, length, *shape), dtype=np.uint8)
        reward = np.full((rows, length), total, np.float32) + np.arange(length)
        total += length
        ring = ring_holding(ring, [obs, reward], total)
        writer.write(ring)
        del obs, reward
    writer.close()
    del ring, writer
    reader = Archive(path, mode="r", progress=False)
    key = jax.random.key(0)
    first = reader.sample(key, 64, 8)  # compile and warm up what sampling keeps
    jax.block_until_ready(jax.tree.leaves(first))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, high-water mark
    seen = 0
    for start, block in reader.iter():  # every step, block after block
        seen += block["obs"].shape[1]
        del block
    for i in range(200):  # and random windows from anywhere
        batch = reader.sample(jax.random.fold_in(key, i), 64, 8)
        jax.block_until_ready(jax.tree.leaves(batch))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"steps": len(reader), "seen": seen, "data_mib": reader.nbytes()[0] >> 20,
                      "growth_mib": (peak - base) >> 10}))
    """
)


def test_reading_and_sampling_an_archive_larger_than_the_memory_used(tmp_path):
    """The process iterates over every step of an archive and samples windows from all of
    it, growing by a fraction of the data's size: nothing keeps what it has read."""
    data_mib = 512
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "big.zarr"), str(data_mib)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == got["steps"] and got["data_mib"] >= data_mib
    # A long read holds a few blocks (about 32 MiB each) and the shards fetched ahead of
    # them; the data is several times that.
    assert got["growth_mib"] < 128 <= got["data_mib"] / 4, got
