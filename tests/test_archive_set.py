"""Several archives read as one data set (issue 18, one archive per writer process)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
from equibuffer._archive import Archive, ring_holding

from .archive_writer import ROWS, values
from .helpers import chi_square_pvalue


def _member(path: str, rows: int, steps: int, row0: int) -> None:
    """An archive of `rows` rows holding steps 0..steps-1, value 1000 * (row0 + row) + step."""
    ring = eb.RingStorage({"x": jnp.zeros((), jnp.float32)}, rows=rows, length=max(steps, 1))
    data = 1000 * (row0 + np.arange(rows, dtype=np.float32))[:, None] + np.arange(steps)
    with Archive(path, ring, progress=False, chunk_steps=4, shard_steps=8) as archive:
        archive.write(ring_holding(ring, [data.astype(np.float32)], steps))


def test_members_side_by_side(tmp_path):
    paths = [str(tmp_path / f"m{i}.zarr") for i in range(3)]
    for path, rows, steps, row0 in zip(paths, (2, 1, 3), (12, 9, 15), (0, 2, 3), strict=True):
        _member(path, rows, steps, row0)
    data = eb.ArchiveSet(paths, progress=False)
    assert data.rows == 6 and len(data) == 9 and data.lengths() == [12, 9, 15]
    assert "3 members, 6 rows" in repr(data)
    whole = data.read()["x"]
    expect = 1000 * np.arange(6, dtype=np.float32)[:, None] + np.arange(9)
    np.testing.assert_array_equal(whole, expect)
    np.testing.assert_array_equal(data.read(2, 5)["x"], expect[:, 2:5])
    with pytest.raises(IndexError, match=r"not within the 9 steps every member holds"):
        data.read(0, 10)
    # The law: uniform over every window of every row, each member up to its own length.
    seq = 4
    batch = data.sample(jax.random.key(0), 30_000, sequence_length=seq)
    x = batch.experience["x"]
    assert (np.diff(x, axis=1) == 1).all()
    assert (x[:, 0] == 1000 * batch.rows + batch.starts).all()
    lengths = [12, 12, 9, 15, 15, 15]  # per row of the set
    windows = [(r, s) for r in range(6) for s in range(lengths[r] - seq + 1)]
    index = {w: i for i, w in enumerate(windows)}
    counts = np.bincount(
        [index[(int(r), int(s))] for r, s in zip(batch.rows, batch.starts, strict=True)],
        minlength=len(windows),
    )
    assert chi_square_pvalue(counts, np.full(len(windows), 1 / len(windows))) > 1e-4
    again = data.sample(jax.random.key(0), 30_000, sequence_length=seq)
    np.testing.assert_array_equal(again.starts, batch.starts)  # the same key, the same draws
    with pytest.raises(ValueError, match=r"no window of sequence_length=16 .* fits in any member"):
        data.sample(0, 4, sequence_length=16)


def test_members_of_another_schema_are_refused(tmp_path):
    _member(str(tmp_path / "a.zarr"), 1, 4, 0)
    ring = eb.RingStorage({"x": jnp.zeros(2, jnp.float32)}, rows=1, length=4)
    with Archive(str(tmp_path / "b.zarr"), ring, progress=False) as archive:
        archive.write(ring_holding(ring, [np.zeros((1, 4, 2), np.float32)], 4))
    with pytest.raises(ValueError, match=r"member 1 .* has another schema than member 0"):
        eb.ArchiveSet([str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")], progress=False)
    with pytest.raises(TypeError, match="non-empty sequence"):
        eb.ArchiveSet(str(tmp_path / "a.zarr"))


READER = """
import sys, time, json
import numpy as np
sys.path.insert(0, sys.argv[1])
from tests.archive_writer import values, ROWS
import equibuffer as eb
stores, seconds = sys.argv[2].split(","), float(sys.argv[3])
options = json.loads(sys.argv[4]) if sys.argv[4] else None
data = None
checks = reads = 0
lengths_seen = []
end = time.time() + seconds
while time.time() < end:
    try:
        data = data or eb.ArchiveSet(stores, progress=False, storage_options=options)
    except ValueError:  # a member not created yet
        time.sleep(0.05)
        continue
    data.refresh()
    lengths = data.lengths()
    lengths_seen.append(lengths)
    n = len(data)
    if n:
        got, want = data.read(0, n), values(ROWS, 0, n)
        for leaf in want:  # member m's rows hold what its writer wrote
            for m in range(len(stores)):
                np.testing.assert_array_equal(got[leaf][ROWS * m : ROWS * (m + 1)], want[leaf])
        checks += 1
        if checks == 1:
            print("ready", flush=True)
        seq = min(1 + reads % 8, max(lengths))  # windows across chunks of 4 steps too
        batch = data.sample(reads, 32, seq)
        assert (batch.starts + seq <= np.repeat(lengths, ROWS)[batch.rows]).all()
        for leaf in want:  # each window: what its member's writer wrote there
            w = [values(ROWS, int(s), seq)[leaf][int(r) % ROWS]
                 for r, s in zip(batch.rows, batch.starts)]
            np.testing.assert_array_equal(batch.experience[leaf], np.stack(w))
        reads += 1
print(json.dumps({"checks": checks, "samples": reads, "lengths": lengths_seen}))
"""


def _lines(proc: subprocess.Popen) -> list[str]:
    """The lines `proc` prints, collected by a thread as they come."""
    lines: list[str] = []

    def collect() -> None:
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)
        except ValueError:  # closed once the process is gone
            pass

    threading.Thread(target=collect, daemon=True).start()
    return lines


def _wait(condition, seconds: float, what: str) -> None:
    end = time.time() + seconds
    while not condition():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_four_writers_four_readers_one_killed(tmp_path):
    """4 writer processes, each writing its own archive (tests/archive_writer.py: values a
    function of row and step), 4 reader processes reading and sampling the set meanwhile;
    writer 0 is killed mid-write while they read, the others after. Readers only ever see
    committed prefixes, and no step a writer reported committed is lost."""
    readers_while_writers_are_killed([str(tmp_path / f"host{i}.zarr") for i in range(4)])


def readers_while_writers_are_killed(stores: list[str], options: dict | None = None) -> None:
    """One writer process per store in `stores` (tests/archive_writer.py, `options` its
    storage options), then 4 reader processes reading and sampling the set of them (each for
    6 s); 1.5 s after every reader's first check writer 0 is killed mid-write while they read,
    the others 1.5 s later, and the readers go on reading the archives as the kills left them.
    Every value a reader reads or samples is checked, its lengths never go back, and no step
    a writer reported committed is lost."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(root, "tests", "archive_writer.py")
    given = json.dumps(options) if options else ""
    writers = [
        subprocess.Popen(
            [sys.executable, script, s, given], stdout=subprocess.PIPE, text=True, env=env
        )
        for s in stores
    ]
    readers: list[subprocess.Popen] = []
    try:
        logs = [_lines(w) for w in writers]
        _wait(lambda: all(len(log) >= 3 for log in logs), 180, "every writer's commits")
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", READER, root, ",".join(stores), "6", given],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )  # fmt: skip
            for _ in range(4)
        ]
        outs = [_lines(r) for r in readers]
        _wait(lambda: all(out for out in outs), 180, "every reader's first check")
        time.sleep(1.5)  # the readers read while every writer appends
        writers[0].send_signal(signal.SIGKILL)  # mid-write, while the readers read
        time.sleep(1.5)
        for w in writers[1:]:
            w.send_signal(signal.SIGKILL)
        for w in writers:
            w.wait(timeout=60)
        committed = [
            max(int(line.split()[1]) for line in log if line.startswith("committed"))
            for log in logs
        ]
        seen = []
        for r, out in zip(readers, outs, strict=True):
            r.wait(timeout=180)
            assert r.returncode == 0, r.stderr.read()[-3000:]  # type: ignore[union-attr]
            got = json.loads(out[-1])
            assert got["checks"] > 0 and got["samples"] > 0
            for a, b in zip(got["lengths"], got["lengths"][1:], strict=False):
                assert all(y >= x for x, y in zip(a, b, strict=True))  # never goes back
            seen.append(got["lengths"])
        assert any(s[0] != s[-1] for s in seen)  # they read while the writers appended
    finally:
        for p in writers + readers:
            p.kill()
            p.wait(timeout=60)
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
    data = eb.ArchiveSet(stores, progress=False, storage_options=options)
    for length, reported in zip(data.lengths(), committed, strict=True):
        assert length >= reported  # nothing reported committed is lost
    n = len(data)
    got, want = data.read(0, n), values(ROWS, 0, n)
    for leaf in want:
        for m in range(len(stores)):
            np.testing.assert_array_equal(got[leaf][ROWS * m : ROWS * (m + 1)], want[leaf])
