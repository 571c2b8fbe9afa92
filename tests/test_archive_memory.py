"""Offline data larger than memory: reading and sampling an archive larger than the memory the
reading process may use, under a real limit (a memory cgroup where this machine allows one,
and `RLIMIT_DATA`: `benchmarks/_memory.py`), at a small scale of issue 18's 4 GB under 1 GB
(1 GiB under 512 MiB); `python -m benchmarks.bench_archive --larger-than-memory` measures it."""

import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks._memory import MemoryLimit


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


WRITE = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp, numpy as np
    import equibuffer as eb
    from equibuffer._archive import Archive, ring_holding

    path, mib = sys.argv[1], int(sys.argv[2])
    rows, length, shape = 8, 256, (32, 32, 3)  # one write: 8 x 256 x 3 KiB = 6 MiB
    example = {"obs": jnp.zeros(shape, jnp.uint8), "reward": jnp.float32(0)}
    ring = eb.RingStorage(example, rows=rows, length=length)
    writer = Archive(path, ring, progress=False)
    rng = np.random.default_rng(0)
    total = 0
    while writer.nbytes()[0] < mib << 20:  # random frames: stored raw, as large on disk
        obs = rng.integers(0, 256, (rows, length, *shape), dtype=np.uint8)
        reward = np.full((rows, length), total, np.float32) + np.arange(length)  # the step
        total += length
        ring = ring_holding(ring, [obs, reward], total)
        writer.write(ring)
    writer.close()
    """
)

READ = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from equibuffer._archive import Archive

    def high_water_mib():  # VmHWM: ru_maxrss would keep the forked launcher's (the parent's)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) >> 10 for l in f if l.startswith("VmHWM:"))

    reader = Archive(sys.argv[1], mode="r", progress=False)
    key = jax.random.key(0)
    first = reader.sample(key, 64, 8)  # compile and warm up what sampling keeps
    base = high_water_mib()
    seen = 0
    for start, block in reader.iter():  # every step, block after block
        steps = block["reward"].shape[1]
        assert (block["reward"] == start + np.arange(steps, dtype=np.float32)).all()
        seen += steps
        del block
    for i in range(200):  # and random windows from anywhere
        batch = reader.sample(jax.random.fold_in(key, i), 64, 8)
        assert (batch.experience["reward"] == batch.starts[:, None] + np.arange(8)).all()
    peak = high_water_mib()
    print(json.dumps({"steps": len(reader), "seen": seen, "data_mib": reader.nbytes()[0] >> 20,
                      "base_mib": base, "peak_mib": peak}))
    """
)


DATA_MIB, LIMIT_MIB = 1024, 512


@pytest.fixture(scope="module")
def big_archive(tmp_path_factory) -> str:
    """1 GiB of random frames (stored raw: as large on disk), the step in `reward`."""
    path = str(tmp_path_factory.mktemp("memory") / "big.zarr")
    out = subprocess.run(
        [sys.executable, "-c", WRITE, path, str(DATA_MIB)], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return path


@pytest.mark.parametrize("how", MemoryLimit.available())  # a cgroup where one can be made
def test_reading_and_sampling_an_archive_larger_than_the_memory_it_may_use(big_archive, how):
    """A process limited to 512 MiB (by a memory cgroup, or by `RLIMIT_DATA`) iterates over
    every step of a 1 GiB archive and samples windows from all of it, every value checked,
    and grows by a fraction of the data's size: nothing keeps what it has read. The limit is
    real: a process run the same way that writes past it does not survive."""
    with MemoryLimit(LIMIT_MIB << 20, how) as limit:
        out = subprocess.run(
            limit.command([sys.executable, "-c", READ, big_archive]), capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, (limit, out.returncode, out.stderr[-3000:])
        assert limit.stats().get("oom_kills", 0) == 0
        assert limit.enforced(), limit  # the same limit stops a process that writes past it
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == got["steps"] and got["data_mib"] >= DATA_MIB >= 2 * LIMIT_MIB
    assert got["peak_mib"] < LIMIT_MIB, got
    # A long read holds a few blocks (about 32 MiB each) and the shards fetched ahead of
    # them; the data is several times that.
    assert got["peak_mib"] - got["base_mib"] < 128 <= got["data_mib"] / 8, got
