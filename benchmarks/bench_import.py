"""Offline imports (issue 39): `eb.from_d4rl` and `eb.from_minari` of a data set several times
larger than `memory=`, against the disk's own sequential read rate of the source.

Four sources, written first (not timed), episodes of `--episode` steps, actions `(6,)`
float32, of `--gb` GB each (the D4RL files) and `--minari-gb` (the Minari data sets, whose
import is bound by Minari's per-episode reads: 1 GB of them already takes a minute):

- `d4rl-mujoco`: a D4RL-layout HDF5 file (h5py, contiguous datasets unless `--h5-compression
  gzip`): `observations` and `next_observations` `(17,)` float32 (random normal, nearly
  incompressible), `rewards` float32, `terminals`/`timeouts` bool;
- `d4rl-image`: the same with `(64, 64, 3)` uint8 observations (random pixels of 16 levels:
  zstd stores about half);
- `minari-mujoco`, `minari-image`: the same steps as Minari data sets
  (`minari.create_dataset_from_buffers` from `EpisodeBuffer`s, Minari's HDF5 format; the
  images stored raw, `jpeg_encoding=False`; `--jpeg` adds `minari-jpeg`, JPEG-encoded frames).

For each source and each of `--compressions` (default `zstd`, then `none` and `lz4`; for the
Minari sources `--minari-compressions`, default `zstd`), in this order: the source files
dropped from the page cache (`posix_fadvise(DONTNEED)`) and read cold, in order, by 16 MiB
reads; dropped again, the import in a process of its own (`_timing.worker_json`) with
`memory=` `--memory-mib` MiB and `progress=False`; the cold read again. The import's process
reports its wall time (and, apart, the `os.sync` after it), the time in the source's `read`
and in `Archive.append` ("other": opening, the episode scan, the final open), and its peak
resident memory above what it held just before the import (after importing jax, h5py,
minari and equibuffer and starting jax's backend: `/proc/self/status` VmHWM reset through
`/proc/self/clear_refs`). The reference is the faster of the two cold reads (this machine's
disk rate moves by 2x between reads of the same file); the ratio is the import's rate of
source bytes over it. `--profile` adds one cProfile'd zstd import per source (its main
thread: the archive's encoding and writes run on its I/O threads).

    python -m benchmarks.bench_import                  # 2 GB (Minari 1 GB), memory=256 MiB
    python -m benchmarks.bench_import --quick          # 0.25 GB sources, memory=64 MiB
    python -m benchmarks.bench_import --cases d4rl-image --compressions zstd --profile

The sources and archives are removed afterwards. Benchmarks, not tests: no pass/fail on speed.
"""

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from ._machine import commit, describe
from ._timing import fmt_time, table, worker_json
from .bench_loader import disk_rate, evict


CASES = ("d4rl-mujoco", "d4rl-image", "minari-mujoco", "minari-image", "minari-jpeg")
ACTION = 6
BLOCK_BYTES = 64 << 20  # what the writers generate at a time

WORKER = r"""
import cProfile, io, json, os, pstats, resource, sys, time
import h5py, jax, numpy as np
import minari
import equibuffer as eb
from equibuffer._archive._archive import Archive
from equibuffer._offline._d4rl import D4RLSource
from equibuffer._offline._minari import MinariSource

kind, source, out, memory, compression, profile = sys.argv[1:7]
jax.devices()  # the backend started, as in a program that uses the buffers


def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(field + ":"))


spent = {"read": 0.0, "append": 0.0}


def timed(cls, name, what):
    inner = getattr(cls, name)

    def wrapper(self, *args):
        t0 = time.perf_counter()
        try:
            return inner(self, *args)
        finally:
            spent[what] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


timed(D4RLSource, "read", "read")
timed(MinariSource, "read", "read")
timed(Archive, "append", "append")
run = eb.from_d4rl if kind == "d4rl" else eb.from_minari
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current resident size
    reset = True
except OSError:
    reset = False
before = status("VmRSS")
profiler = cProfile.Profile() if profile else None
t0 = time.perf_counter()
if profiler:
    profiler.enable()
archive = run(source, out, memory=int(memory), compression=compression, progress=False)
if profiler:
    profiler.disable()
seconds = time.perf_counter() - t0
peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
t1 = time.perf_counter()
os.sync()
sync = time.perf_counter() - t1
raw, stored = archive.nbytes()
got = {"seconds": seconds, "sync": sync, "read": spent["read"], "append": spent["append"],
       "before_rss": before, "peak_rss": peak, "peak_reset": reset, "steps": len(archive),
       "raw": raw, "stored": stored, "codecs": {}}
if profiler:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(int(profile))
    got["profile"] = text.getvalue()
print(json.dumps(got))
"""


def _episodes(nbytes: int, step: int, episode: int) -> int:
    return max(2, nbytes // (step * episode))


def _observations(rng: np.random.Generator, shape: tuple, count: int) -> np.ndarray:
    """`count` observations: normal float32 for a state vector, 16-level uint8 pixels."""
    if len(shape) == 1:
        return rng.standard_normal((count, *shape), dtype=np.float32)
    return rng.integers(0, 16, (count, *shape), dtype=np.uint8) * np.uint8(16)


def _obs_shape(case: str) -> tuple:
    return (17,) if case.endswith("mujoco") else (64, 64, 3)


def write_d4rl(path: str, case: str, nbytes: int, episode: int, h5_compression: str) -> int:
    """A D4RL-layout file of about `nbytes`; returns its number of steps."""
    import h5py

    shape = _obs_shape(case)
    obs_dtype = np.float32 if len(shape) == 1 else np.uint8
    obs_bytes = int(np.prod(shape)) * np.dtype(obs_dtype).itemsize
    step = 2 * obs_bytes + 4 * ACTION + 4 + 2
    count = _episodes(nbytes, step, episode)
    n = count * episode
    per = max(1, BLOCK_BYTES // (step * episode))  # episodes a block
    rng = np.random.default_rng(0)
    opts = {"compression": "gzip"} if h5_compression == "gzip" else {}
    with h5py.File(path, "w") as f:
        f.attrs["env"] = f"bench-{case}"
        made = {
            "observations": f.create_dataset("observations", (n, *shape), obs_dtype, **opts),
            "next_observations": f.create_dataset(
                "next_observations", (n, *shape), obs_dtype, **opts
            ),
            "actions": f.create_dataset("actions", (n, ACTION), np.float32, **opts),
            "rewards": f.create_dataset("rewards", (n,), np.float32, **opts),
            "terminals": f.create_dataset("terminals", (n,), bool, **opts),
            "timeouts": f.create_dataset("timeouts", (n,), bool, **opts),
        }
        for e0 in range(0, count, per):
            e1 = min(count, e0 + per)
            k = e1 - e0
            a, b = e0 * episode, e1 * episode
            o = _observations(rng, shape, k * (episode + 1)).reshape(k, episode + 1, *shape)
            made["observations"][a:b] = o[:, :-1].reshape(-1, *shape)
            made["next_observations"][a:b] = o[:, 1:].reshape(-1, *shape)
            made["actions"][a:b] = rng.uniform(-1, 1, (b - a, ACTION)).astype(np.float32)
            made["rewards"][a:b] = rng.standard_normal(b - a, dtype=np.float32)
            ends = np.zeros((k, episode), bool)
            ends[:, -1] = True
            terminal = (np.arange(e0, e1) % 2 == 0)[:, None]  # even episodes terminate
            made["terminals"][a:b] = (ends & terminal).reshape(-1)
            made["timeouts"][a:b] = (ends & ~terminal).reshape(-1)
    return n


def write_minari(folder: str, case: str, nbytes: int, episode: int) -> tuple[str, int]:
    """A Minari data set of about `nbytes` of steps under `folder` (its datasets root);
    returns its directory and number of steps (actions)."""
    os.environ["MINARI_DATASETS_PATH"] = folder
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    shape = _obs_shape(case)
    if len(shape) == 1:
        space = gym.spaces.Box(-np.inf, np.inf, shape, np.float32)
        obs_bytes = int(np.prod(shape)) * 4
    else:
        space = gym.spaces.Box(0, 255, shape, np.uint8)
        obs_bytes = int(np.prod(shape))
    step = obs_bytes + 4 * ACTION + 8 + 2
    count = _episodes(nbytes, step, episode)
    per = max(1, BLOCK_BYTES // (step * episode))
    rng = np.random.default_rng(0)
    name = f"bench/{case}-v0"
    dataset = None
    for e0 in range(0, count, per):
        buffers = []
        for e in range(e0, min(count, e0 + per)):
            ends = np.zeros(episode, bool)
            ends[-1] = True
            buffers.append(
                EpisodeBuffer(
                    observations=_observations(rng, shape, episode + 1),
                    actions=rng.uniform(-1, 1, (episode, ACTION)).astype(np.float32),
                    rewards=rng.standard_normal(episode),
                    terminations=ends & (e % 2 == 0),
                    truncations=ends & (e % 2 == 1),
                )
            )
        if dataset is None:
            with warnings.catch_warnings():  # Minari's notes on what a benchmark leaves unset
                warnings.simplefilter("ignore")
                dataset = minari.create_dataset_from_buffers(
                    name,
                    buffers,
                    algorithm_name="random",
                    author="equibuffer benchmarks",
                    author_email="none@example.com",
                    code_permalink="benchmarks/bench_import.py",
                    description="bench_import's source",
                    observation_space=space,
                    action_space=gym.spaces.Box(-1, 1, (ACTION,), np.float32),
                    jpeg_encoding=case == "minari-jpeg",
                )
        else:
            dataset.storage.update_episodes(buffers)
    return os.path.join(folder, *name.split("/")), count * episode


def source_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, name)) for d, _, files in os.walk(path) for name in files
    )


def import_run(
    kind: str, source: str, out: str, memory: int, compression: str, profile: int = 0
) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    argv = [kind, source, out, str(memory), compression, str(profile or "")]
    return worker_json(WORKER, argv, env, 3600, f"the {kind} import of {source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of each D4RL file")
    parser.add_argument("--minari-gb", type=float, default=1.0, help="GB of each Minari set")
    parser.add_argument("--memory-mib", type=int, default=256, help="the imports' memory=")
    parser.add_argument("--episode", type=int, default=1000, help="steps an episode")
    parser.add_argument("--cases", default=",".join(CASES[:4]), help=f"of {', '.join(CASES)}")
    parser.add_argument("--jpeg", action="store_true", help="add minari-jpeg to the cases")
    parser.add_argument("--compressions", default="zstd,none,lz4")
    parser.add_argument("--minari-compressions", default="zstd")
    parser.add_argument("--h5-compression", choices=("none", "gzip"), default="none")
    parser.add_argument("--profile", action="store_true", help="a cProfile'd zstd import")
    parser.add_argument("--quick", action="store_true", help="0.25 GB sources, memory=64 MiB")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.gb, args.minari_gb, args.memory_mib = 0.25, 0.25, 64
    cases = args.cases.split(",") + (["minari-jpeg"] if args.jpeg else [])
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    memory = args.memory_mib << 20
    machine = {**describe(), "commit": commit()}
    print(
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"load {machine['load_average_1_5_15']}, {machine['date']}, {machine['commit']}"
    )
    rows, results = [], []
    for case in cases:
        folder = tempfile.mkdtemp(dir=args.dir)
        try:
            t0 = time.perf_counter()
            if case.startswith("d4rl"):
                src = os.path.join(folder, "source")
                os.mkdir(src)
                steps = write_d4rl(
                    os.path.join(src, f"{case}.hdf5"),
                    case,
                    int(args.gb * 1e9),
                    args.episode,
                    args.h5_compression,
                )
                kind, given = "d4rl", os.path.join(src, f"{case}.hdf5")
            else:
                src, steps = write_minari(
                    os.path.join(folder, "minari"), case, int(args.minari_gb * 1e9), args.episode
                )
                kind, given = "minari", src
            written = time.perf_counter() - t0
            size = source_bytes(src)
            print(
                f"{case}: {size / 1e9:.2f} GB, {steps} steps, written in {written:.0f} s",
                flush=True,
            )
            codecs = args.compressions if kind == "d4rl" else args.minari_compressions
            runs = [(c, 0) for c in codecs.split(",")]
            if args.profile:
                runs.append(("zstd", 25))
            for compression, profile in runs:
                out = os.path.join(folder, "archive.zarr")
                before = disk_rate(src)  # evicts first
                evict(src)
                got = import_run(kind, given, out, memory, compression, profile)
                shutil.rmtree(out)
                after = disk_rate(src)
                disk = max(before, after)
                rate = size / got["seconds"]
                above = got["peak_rss"] - got["before_rss"]
                other = got["seconds"] - got["read"] - got["append"]
                got.update(
                    case=case,
                    compression=compression,
                    source_bytes=size,
                    disk_before=before,
                    disk_after=after,
                    disk=disk,
                    rate=rate,
                )
                results.append(got)
                if profile:
                    print(
                        f"cProfile of the {case} import (zstd, main thread; "
                        f"{got['seconds']:.1f} s):\n{got['profile']}"
                    )
                    continue
                rows.append({
                    "source": case,
                    "codec": compression,
                    "size": f"{size / 1e9:.2f} GB",
                    "cold read (before, after)": f"{disk / 1e6:.0f} MB/s "
                                                 f"({before / 1e6:.0f}, {after / 1e6:.0f})",
                    "import": f"{fmt_time(got['seconds'])} (+{fmt_time(got['sync'])} sync)",
                    "rate": f"{rate / 1e6:.0f} MB/s",
                    "ratio": f"{rate / disk:.2f}x",
                    "read / append / other": f"{got['read']:.1f} / {got['append']:.1f} / "
                                             f"{other:.1f} s",
                    "stored": f"{got['stored'] / 1e9:.2f} GB",
                    "peak above": f"{above / 2**20:.0f} MiB",
                    "<= memory": "yes" if above <= memory else "NO",
                })  # fmt: skip
                print(table(rows[-1:]), flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\nmemory={args.memory_mib} MiB; ratio = import rate of source bytes / the faster cold "
        "read (targets: ratio >= 0.5x, peak above the baseline <= memory):"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "runs": results}, f, indent=1)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
