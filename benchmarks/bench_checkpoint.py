"""Checkpoints with orbax (docs/checkpoints.md): a train state of `--gb` GB of stored steps
saved by a `CheckpointManager` and restored into a template, against the disk's own rates.

Each phase runs in its own process, which reports its peak resident memory above what it
held before the phase (`/proc/self/status` VmHWM, reset through `/proc/self/clear_refs`):

- `disk`: the same number of bytes written from memory to a file (with and without `fsync`)
  and read back (`np.fromfile`): the disk's own rates, as the save and restore meet them (the
  page cache is dropped before each read where this process may: `drop_caches` says);
- `save`: the state built (its buffer filled by donated adds), then saved: the time `save`
  blocks (the arrays copied off the devices), the time until the write is committed, and the
  peak memory above the state (orbax's staging); once with orbax's default chunks and once
  for each other `--chunk-mib` (`ocp.SaveArgs(chunk_byte_size=...)` for every array, as
  docs/checkpoints.md advises for large buffers);
- `restore`: after each save, that step restored into `eqx.filter_eval_shape`'s template:
  the time, and the peak memory above the restored state;
- `train`: a donated training step (add, sample, a stand-in learner) run `--steps` times on a
  state of `--train-gb` GB, without saving and with an async save every `--every` steps: the
  learner's time lost to the saves, as a fraction of its step time.

    python -m benchmarks.bench_checkpoint [--quick] [--gb 6] [--dir PATH] [--json PATH]
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

from ._timing import fmt_time, table, worker_json


WORKER = r"""
import json, os, sys, time
import equinox as eqx, jax, jax.numpy as jnp, numpy as np

phase, directory, gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
ROWS, DIM, CHUNK = 64, 1024, 64  # rows, floats per step, steps per add
length = max(CHUNK, int(gb * 1e9 / (ROWS * DIM * 4)) // CHUNK * CHUNK)
nbytes = ROWS * length * DIM * 4


def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def make():
    import equibuffer as eb
    buffer = eb.TrajectoryBuffer({"obs": jnp.zeros(DIM)}, add_batch_size=ROWS,
                                 max_length_time_axis=length, sequence_length=2)
    return {"buffer": buffer, "key": jax.random.key(0), "step": jnp.int32(0)}


def filled():
    import equibuffer as eb
    add = eb.filter_jit(lambda s, t: {**s, "buffer": s["buffer"].add(
        {"obs": jnp.full((ROWS, CHUNK, DIM), t, jnp.float32)})}, donate="all")
    state = make()
    for t in range(length // CHUNK):
        state = add(state, jnp.float32(t))
    jax.block_until_ready(state)
    return state


out = {"phase": phase, "bytes": nbytes}
if phase == "disk":
    data = np.ones(nbytes // 4, np.float32)
    path = os.path.join(directory, "raw.bin")
    for sync in (True, False, True, False):  # each twice, the best kept (a new file first)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            data.tofile(f)
            if sync:
                f.flush(); os.fsync(f.fileno())
        name = "write_fsync" if sync else "write"
        out[name] = min(out.get(name, float("inf")), time.perf_counter() - t0)
    del data
    out["drop_caches"] = drop_caches()
    t0 = time.perf_counter()
    back = np.fromfile(path, np.float32)
    out["read"] = time.perf_counter() - t0
    assert back.size == nbytes // 4
    os.remove(path)
elif phase == "save":
    import orbax.checkpoint as ocp
    chunk = int(sys.argv[4])  # chunk_byte_size; 0: orbax's default
    state = filled()
    arrays = eqx.filter(state, eqx.is_array)
    save_args = None
    if chunk:
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), arrays)
    before = rss("VmRSS")
    reset_peak()
    with ocp.CheckpointManager(os.path.join(directory, f"ckpt{chunk}")) as manager:
        t0 = time.perf_counter()
        manager.save(1, args=ocp.args.StandardSave(arrays, save_args=save_args))
        out["blocking"] = time.perf_counter() - t0
        manager.wait_until_finished()
        out["save"] = time.perf_counter() - t0
    out["peak_above_state"] = rss("VmHWM") - before
elif phase == "restore":
    import orbax.checkpoint as ocp
    chunk = int(sys.argv[4])
    out["drop_caches"] = drop_caches()
    template = eqx.filter_eval_shape(make)
    arrays, static = eqx.partition(template, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    before = rss("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    with ocp.CheckpointManager(os.path.join(directory, f"ckpt{chunk}")) as manager:
        restored = manager.restore(1, args=ocp.args.StandardRestore(arrays))
    jax.block_until_ready(restored)
    out["restore"] = time.perf_counter() - t0
    out["peak_above_state"] = rss("VmHWM") - before - nbytes
    assert float(restored["buffer"].storage.data["obs"][0, -1, 0]) == length // CHUNK - 1
elif phase == "train":
    import orbax.checkpoint as ocp
    import equibuffer as eb
    steps, every = int(sys.argv[4]), int(sys.argv[5])
    state = filled()
    params = jnp.ones((DIM, 256), jnp.float32) / DIM
    state["params"] = params

    @eb.filter_jit(donate="all")
    def step(state):
        key, draw = jax.random.split(state["key"])
        buffer = state["buffer"].add({"obs": jax.random.normal(key, (ROWS, DIM))})
        obs = buffer.sample(draw, 256).experience["obs"][:, 0]
        for _ in range(8):  # a stand-in learner: a few matrix products per step
            loss_grad = obs.T @ jnp.tanh(obs @ state["params"]) / 256
        params = state["params"] - 1e-3 * loss_grad
        return {**state, "buffer": buffer, "key": key, "params": params,
                "step": state["step"] + 1}

    state = step(state)
    jax.block_until_ready(state)
    times = {}
    for mode in ("plain", "saving", "plain", "saving"):  # interleaved: the machine drifts
        with ocp.CheckpointManager(os.path.join(directory, "train"),
                                   options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
            blocking = []
            t0 = time.perf_counter()
            for i in range(steps):
                state = step(state)
                if mode == "saving" and i % every == every - 1:
                    s0 = time.perf_counter()
                    m.save(int(state["step"]),
                           args=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)))
                    blocking.append(time.perf_counter() - s0)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - t0  # the loop; the last write may still run
            m.wait_until_finished()
        best = min(times.get(mode, (float("inf"), []))[0], elapsed)
        times[mode] = (best, blocking if best == elapsed else times[mode][1])
    out["step_plain"] = times["plain"][0] / steps
    out["step_saving"] = times["saving"][0] / steps
    out["save_blocking"] = sum(times["saving"][1]) / max(1, len(times["saving"][1]))
    out["saves"] = len(times["saving"][1])
print(json.dumps(out))
"""


def _run(phase: str, directory: str, gb: float, *extra: Any) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    argv = [phase, directory, str(gb), *map(str, extra)]
    return worker_json(WORKER, argv, env, 3600, f"the {phase} phase")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--gb", type=float, default=6.0, help="GB of stored steps saved")
    parser.add_argument("--train-gb", type=float, default=1.0, help="GB of the trained state")
    parser.add_argument("--steps", type=int, default=200, help="training steps per timing")
    parser.add_argument("--every", type=int, default=50, help="steps between async saves")
    parser.add_argument(
        "--chunk-mib",
        default="0,64",
        help="the saves' chunk_byte_size in MiB, each saved and restored (0: orbax's default)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.gb, args.train_gb, args.steps, args.every = 0.25, 0.1, 40, 10
    chunks = [int(c) << 20 for c in args.chunk_mib.split(",")]
    directory = tempfile.mkdtemp(dir=args.dir)
    saves, restores = {}, {}
    try:
        disk = _run("disk", directory, args.gb)
        for chunk in chunks:
            saves[chunk] = _run("save", directory, args.gb, chunk)
            restores[chunk] = _run("restore", directory, args.gb, chunk)
            shutil.rmtree(os.path.join(directory, f"ckpt{chunk}"), ignore_errors=True)
        train = _run("train", directory, args.train_gb, args.steps, args.every)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gb = disk["bytes"] / 1e9

    def rate(seconds: float) -> str:
        return f"{fmt_time(seconds)} ({gb / seconds:.2f} GB/s)"

    rows = [
        {"what": "disk write (no fsync)", "time": rate(disk["write"]), "against disk": ""},
        {"what": "disk write + fsync", "time": rate(disk["write_fsync"]), "against disk": ""},
        {"what": "disk read", "time": rate(disk["read"]), "against disk": ""},
    ]
    for chunk in chunks:
        save, restore = saves[chunk], restores[chunk]
        how = f"chunk_byte_size={chunk >> 20} MiB" if chunk else "orbax's default chunks"
        rows += [
            {
                "what": f"orbax save (committed), {how}",
                "time": rate(save["save"]),
                "against disk": f"{disk['write'] / save['save']:.2f}x write, "
                f"{disk['write_fsync'] / save['save']:.2f}x write+fsync",
                "peak above the state": f"{save['peak_above_state'] / 1e9:.2f} GB",
            },
            {
                "what": f"orbax save: blocking part, {how}",
                "time": fmt_time(save["blocking"]),
                "against disk": "",
                "peak above the state": "",
            },
            {
                "what": f"orbax restore, {how}",
                "time": rate(restore["restore"]),
                "against disk": f"{disk['read'] / restore['restore']:.2f}x read",
                "peak above the state": f"{restore['peak_above_state'] / 1e9:.2f} GB",
            },
        ]
    for row in rows[:3]:
        row["peak above the state"] = ""
    print(
        f"A train state of {gb:.2f} GB of stored steps (page cache dropped before reads: "
        f"{disk['drop_caches'] and all(r['drop_caches'] for r in restores.values())}):"
    )
    print(table(rows))
    lost = train["step_saving"] / train["step_plain"] - 1
    print(
        f"Training on {train['bytes'] / 1e9:.2f} GB, an async save every {args.every} steps: "
        f"step {fmt_time(train['step_plain'])} without saving, "
        f"{fmt_time(train['step_saving'])} with ({100 * lost:+.1f}% of the step time; "
        f"each save blocks {fmt_time(train['save_blocking'])}, "
        f"{train['save_blocking'] / (args.every * train['step_plain']):.1%} of the "
        f"{args.every} steps between saves)."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "disk": disk,
                    "save": {str(c): saves[c] for c in chunks},
                    "restore": {str(c): restores[c] for c in chunks},
                    "train": train,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
