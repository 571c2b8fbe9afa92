"""`ArchiveLoader`: the epoch law (every valid window exactly once per epoch, in a random
order: exact counts and chi-square on archives larger than the pool), the views, episodes and
gaps against a NumPy reference, reproducibility from the key, resuming, errors raised before
any thread starts, and no thread or open file left behind."""

import collections
import os
import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equibuffer as eb
from equibuffer._archive import ring_holding

from .helpers import by_profile


ROWS = 3


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("equibuffer-loader")]


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def write(path, length, *, rows=ROWS, shard_steps=32, done=None, gap_at=None):
    """An archive of `rows` rows of `length` steps: leaf `t` holds the step's archive index
    plus 1000 times its row, `reward` its float, `done` the given flags (or none); with
    `gap_at`, 50 steps are lost there (a gap between two segments)."""
    example = {"t": jnp.int32(0), "reward": jnp.float32(0), "terminated": jnp.bool_(False)}
    ring = eb.RingStorage(example, rows=rows, length=length)
    t = np.arange(length)[None, :] + 1000 * np.arange(rows)[:, None]
    flags = np.zeros((rows, length), bool) if done is None else done
    data = [t.astype(np.int32), t.astype(np.float32), flags]
    archive = eb.Archive(path, ring, chunk_steps=8, shard_steps=shard_steps, progress=False,
                         on_lost="warn")  # fmt: skip
    if gap_at is None:
        archive.write(ring_holding(ring, data, length))
    else:
        archive.write(ring_holding(ring, [d[:, :gap_at] for d in data], gap_at))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", eb.StepsLostWarning)
            archive.write(ring_holding(ring, [d[:, gap_at:] for d in data], length + 50))
    archive.close()
    return eb.Archive(path, mode="r", progress=False)


def reference(archive, window, period, done=None):
    """Every valid window `(row, start)`, by a plain loop."""
    out = []
    for a, b in archive.segments:
        for s in range(a, b - window + 1):
            if s % period:
                continue
            for r in range(archive.rows):
                if done is not None and done[r, s : s + window - 1].any():
                    continue
                out.append((r, s))
    return sorted(out)


def run(loader):
    """Every batch of `loader`, on the host, with the position after it."""
    out = []
    with loader:
        for batch in loader:
            out.append((jax.device_get(batch), loader.position))
    return out


def windows_of(batches):
    """Per epoch, the `(row, start)` of every unmasked window, in order."""
    per_epoch: dict[int, list] = collections.defaultdict(list)
    epoch = 0
    for batch, after in batches:
        m = np.asarray(batch.mask)
        per_epoch[epoch] += list(zip(batch.rows[m].tolist(), batch.starts[m].tolist(), strict=True))
        epoch = after.epoch
    return per_epoch


@pytest.mark.parametrize(
    "shard_steps, block_steps, pool_blocks",
    [(32, 32, 2), (32, 20, 3), (0, 16, 1), (32, None, 4)],
)
def test_every_window_exactly_once_per_epoch(tmp_path, shard_steps, block_steps, pool_blocks):
    archive = write(str(tmp_path / "a.zarr"), 203, shard_steps=shard_steps)
    loader = eb.ArchiveLoader(archive, jax.random.key(1), 16, sequence_length=5, period=2,
                              block_steps=block_steps, pool_blocks=pool_blocks,
                              epochs=3)  # fmt: skip
    assert loader.num_windows == len(reference(archive, 5, 2))
    batches = run(loader)
    epochs = windows_of(batches)
    expected = reference(archive, 5, 2)
    assert sorted(epochs) == [0, 1, 2]
    for e in range(3):
        assert sorted(epochs[e]) == expected  # each once: no repeats, none missing
    assert epochs[0] != epochs[1]  # a new order each epoch
    for batch, _ in batches:
        t, m = batch.experience["t"], batch.mask
        rows, starts = batch.rows[:, None], batch.starts[:, None]
        assert (t[m] == (starts + np.arange(5) + 1000 * rows)[m]).all()
        assert (t[~m] == 0).all() and (batch.rows[~m] == -1).all()
    # only an epoch's last batch is short
    short = [i for i, (b, _) in enumerate(batches) if not b.mask.all()]
    ends = [i for i, (_, after) in enumerate(batches) if after.group == after.offset == 0]
    assert set(short) <= set(ends) and len(ends) == 3


def test_windows_never_cross_a_gap(tmp_path):
    archive = write(str(tmp_path / "a.zarr"), 150, gap_at=70)
    assert len(archive.segments) == 2
    loader = eb.ArchiveLoader(archive, 0, 8, sequence_length=6, block_steps=16, epochs=1)
    got = windows_of(run(loader))[0]
    assert sorted(got) == reference(archive, 6, 1)


def test_law_is_uniform_over_windows_chi_square(tmp_path):
    """8 blocks of 16 window starts (one row), a pool of 2 blocks: the archive is 4 times the
    pool. Over 200 epochs (80 in the quick session: still 10 draws a cell), the windows of
    each epoch's first batch, the first block visited and a window's batch index are
    uniform."""
    seq, epochs, bs = 4, by_profile(200, 80), 16
    archive = write(str(tmp_path / "a.zarr"), 8 * 16 + seq - 1, rows=1)
    loader = eb.ArchiveLoader(archive, jax.random.key(7), bs, sequence_length=seq,
                              block_steps=16, pool_blocks=2, epochs=epochs)  # fmt: skip
    per_epoch = windows_of(run(loader))
    assert len(per_epoch) == epochs
    first = np.array([s for e in range(epochs) for _, s in per_epoch[e][:bs]])
    counts = np.bincount(first, minlength=128)
    import scipy.stats  # (imported when used: it takes ~2 s in each test process)

    assert scipy.stats.chisquare(counts).pvalue > 1e-3
    blocks = np.bincount([per_epoch[e][0][1] // 16 for e in range(epochs)], minlength=8)
    assert scipy.stats.chisquare(blocks).pvalue > 1e-3
    # window 37's batch index over the epochs: uniform over the 8 batches
    where = [[s for _, s in per_epoch[e]].index(37) // bs for e in range(epochs)]
    assert scipy.stats.chisquare(np.bincount(where, minlength=8)).pvalue > 1e-3


def test_same_key_same_batches_and_resume(tmp_path):
    archive = write(str(tmp_path / "a.zarr"), 120)

    def make(key, position=None):
        return eb.ArchiveLoader(archive, key, 12, sequence_length=3, block_steps=16,
                                pool_blocks=2, epochs=2, position=position)  # fmt: skip

    full = run(make(jax.random.key(3)))
    again = run(make(jax.random.key(3)))
    other = run(make(jax.random.key(4)))
    assert [b.starts.tolist() for b, _ in full] == [b.starts.tolist() for b, _ in again]
    assert [b.starts.tolist() for b, _ in full] != [b.starts.tolist() for b, _ in other]
    # resume after every batch: mid-group, at a group's end, at the epoch's end
    for k in [0, 3, 6, len(full) // 2, len(full) - 2]:
        position = tuple(full[k][1])  # stored as plain ints
        rest = run(make(jax.random.key(3), position))
        assert len(rest) == len(full) - k - 1
        for (a, pa), (b, pb) in zip(full[k + 1 :], rest, strict=True):
            assert pa == pb
            assert a.starts.tolist() == b.starts.tolist() and a.rows.tolist() == b.rows.tolist()
            assert (a.experience["t"] == b.experience["t"]).all()


def test_views_pairs_and_n_step(tmp_path):
    rng = np.random.default_rng(0)
    done = rng.random((ROWS, 100)) < 0.1
    archive = write(str(tmp_path / "a.zarr"), 100, done=done)
    pairs = run(eb.ArchiveLoader(archive, 0, 16, view="transition", block_steps=16, epochs=1))
    for batch, _ in pairs:
        m = batch.mask
        assert isinstance(batch.experience, eb.Transition)
        assert (batch.experience.first["t"][m] == (batch.starts + 1000 * batch.rows)[m]).all()
        assert (batch.experience.second["t"][m] == batch.experience.first["t"][m] + 1).all()
    assert sorted(windows_of(pairs)[0]) == reference(archive, 2, 1)
    n = 3
    nstep = run(eb.ArchiveLoader(archive, 0, 16, view="transition", n_step=n, discount=0.9,
                                 truncated=None, block_steps=16, epochs=1))  # fmt: skip
    t_all = archive.read()["t"]
    for batch, _ in nstep:
        m = np.asarray(batch.mask)
        r, s = batch.rows[m], batch.starts[m]
        steps = {"reward": t_all[r[:, None], s[:, None] + np.arange(n + 1)].astype(np.float32),
                 "terminated": done[r[:, None], s[:, None] + np.arange(n + 1)]}  # fmt: skip
        steps = jax.tree.map(jnp.asarray, steps)
        want = eb.n_step_transition(steps, n=n, discount=0.9, truncated=None)
        assert isinstance(batch.experience, eb.NStepTransition)
        np.testing.assert_allclose(batch.experience.reward[m], want.reward, rtol=1e-6)
        np.testing.assert_allclose(batch.experience.discount[m], want.discount, rtol=1e-6)
        assert (batch.experience.steps[m] == want.steps).all()
    assert sorted(windows_of(nstep)[0]) == reference(archive, n + 1, 1)


def test_episode_aware_windows(tmp_path):
    rng = np.random.default_rng(1)
    done = rng.random((ROWS, 160)) < 0.15
    archive = write(str(tmp_path / "a.zarr"), 160, done=done)
    loader = eb.ArchiveLoader(archive, 5, 8, sequence_length=4, episode_end="terminated",
                              block_steps=16, pool_blocks=2, epochs=2)  # fmt: skip
    epochs = windows_of(run(loader))
    expected = reference(archive, 4, 1, done=done)
    assert 0 < len(expected) < len(reference(archive, 4, 1))
    assert sorted(epochs[0]) == expected and sorted(epochs[1]) == expected


def test_archive_set(tmp_path):
    a = write(str(tmp_path / "a.zarr"), 90)
    b = write(str(tmp_path / "b.zarr"), 60, rows=2)
    data = eb.ArchiveSet([str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")], progress=False)
    batches = run(eb.ArchiveLoader(data, 0, 32, sequence_length=5, block_steps=16, epochs=1))
    expected = reference(a, 5, 1) + [(r + ROWS, s) for r, s in reference(b, 5, 1)]
    assert sorted(windows_of(batches)[0]) == sorted(expected)
    for batch, _ in batches:
        m = batch.mask
        local = np.where(batch.rows >= ROWS, batch.rows - ROWS, batch.rows)
        assert (batch.experience["t"][m][:, 0] == (batch.starts + 1000 * local)[m]).all()


def test_learner_step_under_filter_jit_never_retraces(tmp_path):
    archive = write(str(tmp_path / "a.zarr"), 70)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(total, batch):
        return total + jnp.sum(jnp.where(batch.mask, batch.experience["reward"][:, 0], 0.0))

    total = jnp.float32(0)
    with eb.ArchiveLoader(archive, 0, 16, sequence_length=2, block_steps=16, epochs=2) as loader:
        for batch in loader:  # the masked last batches have the same shapes
            total = step(total, batch)
    t = archive.read()["reward"][:, :-1]
    assert float(total) == pytest.approx(2 * float(t.sum()))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, "`batch_size` must be at least 1"),
        ({"period": 0}, ValueError, "`period` must be at least 1"),
        ({"sequence_length": None}, TypeError, "view='window' needs `sequence_length`"),
        ({"n_step": 3}, ValueError, "`n_step` and `discount` are for view='transition'"),
        ({"view": "transition"}, ValueError, "drop `sequence_length`"),
        ({"episode_end": "done"}, ValueError, "names no leaf of the archive"),
        ({"episode_end": "reward"}, TypeError, "must be a 0-d bool per step"),
        ({"sequence_length": 500}, ValueError, "no window of 500 steps"),
        ({"pool_blocks": 0}, ValueError, "`pool_blocks` must be at least 1"),
        ({"position": (0, 99, 0)}, ValueError, "is not a position of this loader"),
        ({"position": (0, 0, -1)}, ValueError, "is not a position of this loader"),
    ],
)
def test_errors_before_any_thread(tmp_path, kwargs, error, match):
    archive = write(str(tmp_path / "a.zarr"), 40)
    args = {"key": 0, "batch_size": 4, "sequence_length": 3, **kwargs}
    if args.get("view") == "transition" and "sequence_length" in kwargs:
        args["sequence_length"] = 3
    before = loader_threads()
    with pytest.raises(error, match=match):
        eb.ArchiveLoader(archive, **args)
    assert loader_threads() == before == []


def test_n_step_leaves_checked(tmp_path):
    archive = write(str(tmp_path / "a.zarr"), 40)
    with pytest.raises(ValueError, match="has no leaf 'rew'"):
        eb.ArchiveLoader(archive, 0, 4, view="transition", n_step=2, reward="rew")
    with pytest.raises(TypeError, match="source"):  # (jaxtyping names it first in tests)
        eb.ArchiveLoader(str(tmp_path / "a.zarr"), 0, 4, sequence_length=2)  # type: ignore


def test_no_thread_or_file_left_behind(tmp_path):
    archive = write(str(tmp_path / "a.zarr"), 400)
    archive.read()  # the archive's own I/O pools, shared by every read, exist from here
    files = open_files()

    def make():
        return eb.ArchiveLoader(archive, 0, 8, sequence_length=4, block_steps=16, prefetch=2)

    # a generator exit: `break` out of an endless loader
    for i, _ in enumerate(make()):
        if i == 5:
            break
    assert loader_threads() == [] and open_files() == files
    # an exception in the learner, inside `with`
    with pytest.raises(RuntimeError, match="learner failed"):
        with make() as loader:
            for i, _ in enumerate(loader):
                if i == 3:
                    raise RuntimeError("learner failed")
    assert loader_threads() == [] and open_files() == files
    # close() before the end, then iterating again is refused
    loader = make()
    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 2
    loader.close()
    assert loader_threads() == [] and open_files() == files
    with pytest.raises(RuntimeError, match="iterates once"):
        iter(loader)


def test_error_in_the_reader_reaches_the_learner(tmp_path):
    rng = np.random.default_rng(2)
    done = rng.random((ROWS, 60)) < 0.9  # almost every step ends an episode
    archive = write(str(tmp_path / "a.zarr"), 60, done=done)
    loader = eb.ArchiveLoader(archive, 0, 4, sequence_length=8, episode_end="terminated",
                              block_steps=16)  # fmt: skip
    with pytest.raises(ValueError, match="lies inside one episode"):
        run(loader)
    assert loader_threads() == []


LOADER = """
import json, sys
import jax, numpy as np
import equibuffer as eb

def high_water_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) >> 10 for l in f if l.startswith("VmHWM:"))

archive = eb.Archive(sys.argv[1], mode="r", progress=False)
base = high_water_mib()
loader = eb.ArchiveLoader(archive, jax.random.key(0), 256, sequence_length=8, pool_blocks=2,
                          epochs=1)
seen = 0
with loader:
    for batch in loader:
        m = np.asarray(batch.mask)
        t = np.asarray(batch.experience["reward"])[m]
        assert (t == np.asarray(batch.starts)[m][:, None] + np.arange(8)).all()
        seen += int(m.sum())
print(json.dumps({"seen": seen, "windows": loader.num_windows, "base_mib": base,
                  "peak_mib": high_water_mib(), "bound_mib": loader.resident_bytes >> 20}))
"""


@pytest.mark.slow  # starts processes: `nox -s slow`, and CI
def test_memory_bound_on_an_archive_larger_than_the_limit(tmp_path):
    """A process limited to 512 MiB delivers one epoch (every window once, values checked) of
    a 1 GiB archive, under the limit."""
    import json
    import subprocess
    import sys

    from benchmarks._memory import MemoryLimit

    from .test_archive_memory import WRITE

    path = str(tmp_path / "big.zarr")
    out = subprocess.run([sys.executable, "-c", WRITE, path, "1024"], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    with MemoryLimit(512 << 20, MemoryLimit.available()[0]) as limit:
        out = subprocess.run(limit.command([sys.executable, "-c", LOADER, path]),
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert out.returncode == 0, (limit, out.stderr[-3000:])
        assert limit.stats().get("oom_kills", 0) == 0
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == got["windows"]
    assert got["peak_mib"] < 512
    # The growth includes the first device transfers and the runtime's warm-up after `base`
    # (measured: 276 MiB for a bound of 120 MiB); it does not grow with the archive.
    assert got["peak_mib"] - got["base_mib"] < got["bound_mib"] + 256, got
