"""Core benchmark: add and sample of the uniform buffers, side by side with Flashbax.

Times, on `(32, 32, 3)` float32 observations and a buffer of `--capacity` steps (default
500,000, i.e. 6 GB of observations):

- add of one step (add batch 1 and 128) and of `T` steps, as one jitted call under donation and
  per add inside a `lax.scan`;
- sample of 256 windows, as one jitted call and per sample inside a `lax.scan`;
- the add at three capacities (capacity / 50, / 5, / 1) under donation, to show that the add is
  in place (flat in capacity).

Each equibuffer figure sits next to Flashbax's on the same configuration (its trajectory buffer
against `TrajectoryBuffer`, its flat buffer against `TransitionBuffer`), with the ratio
`Flashbax time / equibuffer time` (> 1: equibuffer is faster), and next to the machine's own
limit: a NumPy copy (memcpy between hot buffers) of the bytes one add writes or one sample
returns (`memcpy/ours`: the fraction of that rate reached), and for samples also a NumPy
fancy-index gather of the same windows from the very same buffer memory and XLA's own
contiguous copy of as many bytes (`xla slice/ours`: a jitted `dynamic_slice` of the buffer).
Only one buffer is alive at a time.

Run: `python -m benchmarks.bench_core [--quick] [--capacity N]`. Benchmarks never fail on speed.
"""

import argparse
import datetime
import gc
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import equibuffer as eb

from ._machine import describe
from ._timing import fmt_time, materialise, table


OBS = (32, 32, 3)
SAMPLE_BATCH = 256
SCAN_ADDS = {1: 1000, 128: 50}  # adds per lax.scan, by add batch size
SCAN_SAMPLES = 10


# --------------------------------------------------------------------------- helpers


def _example() -> dict[str, jax.Array]:
    return {"obs": jnp.zeros(OBS, jnp.float32)}


def _batch(rows: int, steps: int | None) -> dict[str, jax.Array]:
    shape = (rows, *OBS) if steps is None else (rows, steps, *OBS)
    return {"obs": jnp.ones(shape, jnp.float32)}


def _free() -> None:
    gc.collect()


def _donated_loop(step: Callable[[Any], Any], state: Any) -> tuple[Callable[[], Any], list[Any]]:
    """A zero-argument function that replaces `state` by `step(state)` (donated) each call."""
    box = [state]

    def call():
        box[0] = step(box[0])
        return box[0]

    return call, box


def _scan_keys(n: int) -> jax.Array:
    return jax.random.split(jax.random.key(1), n)


@dataclass
class Peer:
    """One library's way to build, fill, add to and sample from a buffer."""

    name: str
    make: Callable[[], Any]  # -> a buffer / state of the configuration
    mark_full: Callable[[Any], Any]
    add: Callable[[Any, Any], Any]  # (state, batch) -> state, traceable
    sample: Callable[[Any, jax.Array], Any]  # (state, key) -> experience, traceable
    data: Callable[[Any], jax.Array]  # (state) -> the (rows, length, *OBS) observation array
    jit: str  # "eqx" or "jax"


def _jit_add(peer: Peer) -> Callable[[Any, Any], Any]:
    if peer.jit == "eqx":
        f = eqx.filter_jit(lambda batch, state: peer.add(state, batch), donate="all-except-first")
        return lambda state, batch: f(batch, state)
    return jax.jit(peer.add, donate_argnums=0)


def _jit_scan_add(peer: Peer, k: int) -> Callable[[Any, Any], Any]:
    def run(state, batch):
        return jax.lax.scan(lambda s, _: (peer.add(s, batch), None), state, None, length=k)[0]

    if peer.jit == "eqx":
        f = eqx.filter_jit(lambda batch, state: run(state, batch), donate="all-except-first")
        return lambda state, batch: f(batch, state)
    return jax.jit(run, donate_argnums=0)


def _jit_sample(peer: Peer) -> Callable[[Any, jax.Array], Any]:
    jit = eqx.filter_jit if peer.jit == "eqx" else jax.jit
    return jit(peer.sample)


def _jit_scan_sample(peer: Peer) -> Callable[[Any, jax.Array], Any]:
    def run(state, keys):
        def body(acc, key):
            return acc + materialise(peer.sample(state, key)), None

        return jax.lax.scan(body, jnp.float32(0), keys)[0]

    jit = eqx.filter_jit if peer.jit == "eqx" else jax.jit
    return jit(run)


# --------------------------------------------------------------------------- peers


def _ours(kind: str, rows: int, capacity: int, seq: int, jit: str = "eqx") -> Peer:
    """equibuffer's buffer, under `eqx.filter_jit` (`jit="eqx"`, the documented way) or plain
    `jax.jit` (`jit="jax"`, which separates filter_jit's dispatch cost from the work)."""

    def make():
        if kind == "trajectory":
            return eb.TrajectoryBuffer(
                _example(), add_batch_size=rows, capacity=capacity, sequence_length=seq
            )
        return eb.TransitionBuffer(_example(), add_batch_size=rows, capacity=capacity)

    def mark_full(buf):
        # Counters of a full ring; the stored values do not change the cost of a gather.
        n = buf.max_length_time_axis
        storage = buf.storage.with_counters(fill=n, steps_added=n)
        return eqx.tree_at(lambda b: b.storage, buf, storage)

    return Peer(
        name="equibuffer" + ("" if jit == "eqx" else " (jax.jit)"),
        make=make,
        mark_full=mark_full,
        add=lambda buf, batch: buf.add(batch),
        sample=lambda buf, key: buf.sample(key, SAMPLE_BATCH).experience,
        data=lambda buf: buf.storage.data["obs"],
        jit=jit,
    )


def _flashbax(kind: str, rows: int, capacity: int, seq: int) -> Peer:
    import flashbax as fbx

    if kind == "trajectory":
        fb = fbx.make_trajectory_buffer(
            add_batch_size=rows,
            sample_batch_size=SAMPLE_BATCH,
            sample_sequence_length=seq,
            period=1,
            min_length_time_axis=seq,
            max_size=capacity,
        )
    else:
        fb = fbx.make_flat_buffer(
            max_length=capacity,
            min_length=2,
            sample_batch_size=SAMPLE_BATCH,
            add_sequences=True,
            add_batch_size=rows,
        )

    def add(state, batch):
        # Flashbax's trajectory buffer takes (rows, T, *leaf); give one step a time axis.
        leaf = batch["obs"]
        if leaf.ndim == 1 + len(OBS):
            batch = {"obs": leaf[:, None]}
        return fb.add(state, batch)

    return Peer(
        name="flashbax",
        make=lambda: fb.init(_example()),
        mark_full=lambda st: st.replace(is_full=jnp.array(True)),
        add=add,
        sample=lambda st, key: fb.sample(st, key).experience,
        data=lambda st: st.experience["obs"],
        jit="jax",
    )


# --------------------------------------------------------------------------- timing


Times = tuple[float, float]  # (wall, cpu) seconds


def _best(fn: Callable[[], Any], repeat: int, per: int = 1) -> Times:
    """Best wall time (as `best_time`) and median process CPU time of `fn()` over `repeat`
    calls, each divided by `per`. CPU time counts every thread of this process and not the
    time spent waiting for the shared cores, so it stays comparable when other jobs load the
    machine; its median is used because XLA's worker threads are billed late and unevenly
    (a single call can read too low)."""
    for _ in range(2):
        jax.block_until_ready(fn())
    walls, cpus = [], []
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return min(walls) / per, float(np.median(cpus)) / per


# --------------------------------------------------------------------------- machine limit


def _numpy_copy(nbytes: int) -> Times:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    return _best(lambda: np.copyto(dst, src), repeat=50)


def _xla_slice(data: jax.Array, nbytes: int) -> Times:
    """XLA's own copy of `nbytes` (one contiguous `dynamic_slice` of the buffer's memory, at a
    random step): the floor of any jitted sample of that many bytes on this backend."""
    flat = data.reshape(-1, int(np.prod(data.shape[2:])))
    steps = nbytes // (flat.shape[1] * flat.dtype.itemsize)
    copy = jax.jit(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, steps, axis=0))
    starts = iter(np.random.default_rng(0).integers(0, flat.shape[0] - steps + 1, 10_000))
    return _best(lambda: copy(flat, next(starts)), repeat=20)


def _numpy_gather(data: jax.Array, seq: int) -> Times:
    """Fancy-index gather of SAMPLE_BATCH windows of `seq` steps from the buffer's own memory
    (a zero-copy NumPy view of the JAX array)."""
    view = np.asarray(data)
    rows, length = view.shape[:2]
    flat = view.reshape(rows * length, -1)
    rng = np.random.default_rng(0)
    per_row = length - seq + 1
    start = rng.integers(0, rows * per_row, SAMPLE_BATCH)
    idx = ((start // per_row * length + start % per_row)[:, None] + np.arange(seq)).reshape(-1)
    out = np.empty((idx.size, flat.shape[1]), flat.dtype)
    # mode="clip": with the default mode="raise", NumPy buffers `out` (an extra copy).
    return _best(lambda: np.take(flat, idx, axis=0, out=out, mode="clip"), repeat=20)


# --------------------------------------------------------------------------- sections


def _time_peer(peer: Peer, rows: int, steps_t: int, seq: int) -> dict[str, Times]:
    """All figures for one peer on one configuration (one buffer alive)."""
    out: dict[str, Times] = {}
    k_add = SCAN_ADDS.get(rows, 50)
    one, many = _batch(rows, None), _batch(rows, steps_t)
    add = _jit_add(peer)
    call, box = _donated_loop(lambda s: add(s, one), peer.mark_full(peer.make()))
    out["add 1 step"] = _best(call, repeat=50)
    call, box = _donated_loop(lambda s: add(s, many), box[0])
    out[f"add {steps_t} steps"] = _best(call, repeat=20)
    scan_add = _jit_scan_add(peer, k_add)
    call, box = _donated_loop(lambda s: scan_add(s, one), box[0])
    out["add 1 step, in scan"] = _best(call, repeat=5, per=k_add)
    state = peer.mark_full(box[0])
    del box, call

    sample = _jit_sample(peer)
    key = jax.random.key(0)
    out["sample 256"] = _best(lambda: sample(state, key), repeat=20)
    scan_sample = _jit_scan_sample(peer)
    keys = _scan_keys(SCAN_SAMPLES)
    out["sample 256, in scan"] = _best(lambda: scan_sample(state, keys), repeat=5, per=SCAN_SAMPLES)
    out["_numpy gather"] = _numpy_gather(peer.data(state), seq)
    gathered = jax.eval_shape(lambda s: peer.sample(s, key), state)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(gathered))
    out["_memcpy"] = _numpy_copy(nbytes)
    out["_xla slice"] = _xla_slice(peer.data(state), nbytes)
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}"


def section_ops(capacity: int, steps_t: int, jax_jit_too: bool) -> list[dict[str, Any]]:
    rows_out: list[dict[str, Any]] = []
    step_bytes = int(np.prod(OBS)) * 4
    for kind, seq in (("trajectory", 8), ("transition", 2)):
        for rows in (1, 128):
            peers = [_flashbax(kind, rows, capacity, seq), _ours(kind, rows, capacity, seq)]
            if jax_jit_too:
                peers.append(_ours(kind, rows, capacity, seq, jit="jax"))
            figures = {}
            for peer in peers:
                figures[peer.name] = _time_peer(peer, rows, steps_t, seq)
                _free()  # the buffer died with _time_peer's frame
                print(f"  done {kind} R={rows} {peer.name}", flush=True)
            # The machine's limit: a NumPy copy of the bytes an add writes or a sample returns
            # (a memcpy between hot buffers); for samples also NumPy's own gather of them.
            limit = {
                "add 1 step": _numpy_copy(rows * step_bytes),
                f"add {steps_t} steps": _numpy_copy(rows * steps_t * step_bytes),
                "sample 256": figures["equibuffer"]["_memcpy"],
            }
            gather = figures["equibuffer"]["_numpy gather"]
            xla = figures["equibuffer"]["_xla slice"]
            limit["add 1 step, in scan"] = limit["add 1 step"]
            limit["sample 256, in scan"] = limit["sample 256"]
            for op in figures["equibuffer"]:
                if op.startswith("_"):
                    continue
                (fw, fc), (ow, oc) = figures["flashbax"][op], figures["equibuffer"][op]
                row = {
                    "buffer": f"{kind} S={seq}",
                    "R": rows,
                    "op": op,
                    "fbx wall": fmt_time(fw),
                    "ours wall": fmt_time(ow),
                    "fbx/ours wall": _ratio(fw, ow),
                    "fbx cpu": fmt_time(fc),
                    "ours cpu": fmt_time(oc),
                    "fbx/ours cpu": _ratio(fc, oc),
                }
                raw = {"flashbax": (fw, fc), "equibuffer": (ow, oc), "numpy": limit[op]}
                if jax_jit_too:
                    jw, jc = figures["equibuffer (jax.jit)"][op]
                    row["ours jax.jit cpu"] = fmt_time(jc)
                    row["fbx/jax.jit cpu"] = _ratio(fc, jc)
                    raw["equibuffer (jax.jit)"] = (jw, jc)
                row["memcpy cpu"] = fmt_time(limit[op][1])
                row["memcpy/ours cpu"] = _ratio(limit[op][1], oc)
                sample = op.startswith("sample")
                row["xla slice/ours cpu"] = _ratio(xla[1], oc) if sample else "-"
                row["np gather/ours cpu"] = _ratio(gather[1], oc) if sample else "-"
                if sample:
                    raw["numpy gather"], raw["xla slice"] = gather, xla
                row["_raw"] = raw
                rows_out.append(row)
    return rows_out


def section_capacity(capacity: int, steps_t: int) -> list[dict[str, Any]]:
    # At least two T-step adds of 128 rows per ring (Flashbax refuses T > max_length).
    caps = sorted({max(c, 2 * steps_t * 128) for c in (capacity // 50, capacity // 5, capacity)})
    out: list[dict[str, Any]] = []
    for rows in (1, 128):
        for steps in (None, steps_t):
            batch = _batch(rows, steps)
            row: dict[str, Any] = {"R": rows, "T": steps or 1}
            raw: dict[str, Times] = {}
            for cap in caps:
                for make in (_flashbax, _ours):
                    peer = make("trajectory", rows, cap, 8)
                    add = _jit_add(peer)
                    call, box = _donated_loop(
                        lambda s, add=add, batch=batch: add(s, batch), peer.make()
                    )
                    times = _best(call, repeat=30)
                    del box, call
                    _free()
                    short = "fbx" if peer.name == "flashbax" else "ours"
                    raw[f"{short} {cap}"] = times
                    row[f"{short} {cap:,}"] = f"{fmt_time(times[0])} / {fmt_time(times[1])}"
            for short in ("fbx", "ours"):
                big, small = raw[f"{short} {caps[-1]}"], raw[f"{short} {caps[0]}"]
                row[f"{short} max/min cpu"] = _ratio(big[1], small[1])
            row["_raw"] = raw
            out.append(row)
            print(f"  done capacity sweep R={rows} T={steps or 1}", flush=True)
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    print(table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 steps instead of 500,000")
    parser.add_argument("--capacity", type=int, default=None, help="total steps per buffer")
    parser.add_argument("--steps", type=int, default=16, help="T of the multi-step add")
    parser.add_argument(
        "--jax-jit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time equibuffer under plain jax.jit (the docs' spelling for one call per "
        "step from Python; on by default)",
    )
    parser.add_argument("--only", choices=("ops", "capacity"), default=None)
    parser.add_argument("--json", default=None, help="write the raw figures to this file")
    args = parser.parse_args()
    # Flashbax warns that `max_size` sets `max_length_time_axis`: that is what is meant here.
    warnings.filterwarnings("ignore", message="Setting max_size dynamically")
    capacity = args.capacity or (20_000 if args.quick else 500_000)

    print(
        f"equibuffer core benchmark: {capacity:,} steps of {OBS} float32 "
        f"({capacity * int(np.prod(OBS)) * 4 / 2**30:.2f} GiB per buffer), "
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores), "
        f"{datetime.date.today()}",
        flush=True,
    )
    machine = describe()
    results: dict[str, Any] = {"capacity": capacity, "observation": f"{OBS} float32"}
    if args.only in (None, "ops"):
        ops = section_ops(capacity, args.steps, args.jax_jit)
        print("\nadd / sample, best of N (ratio > 1: equibuffer faster):")
        _print(ops)
        results["ops"] = ops
    if args.only in (None, "capacity"):
        caps = section_capacity(capacity, args.steps)
        print("\nadd under donation vs capacity (trajectory buffers, one jitted call; wall / cpu):")
        _print(caps)
        results["capacity_sweep"] = caps
    if args.json:
        results["machine"] = {**machine, "load_average_after": describe()["load_average_1_5_15"]}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
