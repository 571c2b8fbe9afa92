"""A buffer on 1, 2, 4 and 8 devices: the per-device cost of add and sample (weak scaling).

Each device holds the same work at every device count: `--rows` rows of `--length` steps of
`obs (64,)` float32, an add of one step to each of its rows, and a sample of `--batch`
windows of 8 steps for itself. Three layouts, each run as a `lax.scan` of `--steps` calls
inside one donated jitted step (so Python's dispatch is not in the figure):

- `shard_rows`: one buffer, rows split over the devices, sampled by the global law (one
  sample of `n * batch` drawn over all rows);
- `row_blocks`: the same buffer, each device's block of the sample from its own rows
  (`sample(..., row_blocks=n)`);
- `per_device`: one whole buffer per device, stepped per device by `jax.shard_map`.

Figures: time per call for the whole mesh, and the efficiency against linear, `t(1) / t(n)`
(1.0: every device does its own work in the time one device takes for it). On a CPU the devices
are emulated (`--xla_force_host_platform_device_count`) and share the machine's cores, so the
figure is the overhead of the layout, not a speed-up: with `c` cores the best possible is
`min(n, c) / n`, printed beside it. On a machine with `n` accelerators the same script measures
real scaling (the issue's goal there: at least 0.9).

Each layout runs on a mesh of `Auto` axes and on one of `Explicit` axes (JAX's default), and
the ratio of the two is printed after.

    python -m benchmarks.bench_devices [--quick] [--devices 1,2,4,8] [--axis-types Auto,Explicit]
        [--json PATH]
"""

import argparse
import json
import os
from typing import Any

from ._timing import fmt_time, table, worker_json


WORKER = r"""
import json, sys, time
from functools import partial
import equinox as eqx, jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import equibuffer as eb

n, rows, length, batch, steps, repeat = (int(x) for x in sys.argv[1:7])
axis_type = AxisType[sys.argv[7]]
mesh = jax.make_mesh((n,), ("d",), axis_types=(axis_type,), devices=jax.devices()[:n])
split = NamedSharding(mesh, P("d"))
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # jax < 0.6
    from jax.experimental.shard_map import shard_map
example = {"obs": jnp.zeros(64, jnp.float32)}


def make(r):
    return eb.TrajectoryBuffer(example, add_batch_size=r, max_length_time_axis=length,
                               min_length_time_axis=8, sequence_length=8)


def filled(buffer, r):
    data = {"obs": jnp.ones((r, length, 64), jnp.float32)}
    return buffer.add(data)


def best(fn, *args):
    out = fn(*args)  # compile
    jax.block_until_ready(out)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return min(times) / steps


def best_donated(fn, state, x):
    # `fn` donates `state`: each call takes the state the previous one returned.
    box = [state]

    def call(x):
        box[0] = fn(box[0], x)
        return box[0]

    return best(call, x), box[0]


def scans(add, sample):
    # One call: `steps` adds (of one step per row), or `steps` samples, in a scan.
    def adds(buffer, step):
        def body(b, i):
            return add(b, jax.tree.map(lambda x: x + i.astype(x.dtype), step)), None
        return jax.lax.scan(body, buffer, jnp.arange(steps))[0]

    def samples(buffer, keys):
        def body(total, k):
            return total + sample(buffer, k), None
        return jax.lax.scan(body, jnp.zeros((), jnp.float32), keys)[0]

    return adds, samples


def total(tree):
    return jnp.sum(jax.tree.leaves(tree)[0][..., 0])  # the sample is computed in memory


result = {"devices": n, "axis": axis_type.name}
keys = jax.random.split(jax.random.key(0), steps)
one_step = {"obs": jnp.ones((n * rows, 64), jnp.float32)}

# shard_rows: one buffer of n * rows rows.
buffer = eb.shard_rows(jax.jit(filled, static_argnums=1)(make(n * rows), n * rows), mesh, "d")
step = jax.device_put(one_step, split)
for name, blocks in (("shard_rows", 1), ("row_blocks", n)):
    adds, samples = scans(
        lambda b, x: b.add(x),
        lambda b, k: total(b.sample(k, n * batch, row_blocks=blocks).experience))
    if name == "shard_rows":
        add_fn = jax.jit(adds, donate_argnums=0)
        result["shard_rows_add"], buffer = best_donated(add_fn, buffer, step)
    result[f"{name}_sample"] = best(jax.jit(samples), buffer, keys)
result["row_blocks_add"] = result["shard_rows_add"]  # the same add

# per_device: one buffer of `rows` rows on each device, shard_map.
buffers = eb.per_device(jax.jit(filled, static_argnums=1)(make(rows), rows), mesh, "d")
local = lambda t: jax.tree.map(lambda x: x[0], t)
stack = lambda t: jax.tree.map(lambda x: x[None], t)
adds, samples = scans(lambda b, x: b.add(x), lambda b, k: total(b.sample(k, batch).experience))
add_map = jax.jit(shard_map(lambda b, x: stack(adds(local(b), x)), mesh=mesh,
                            in_specs=P("d"), out_specs=P("d")), donate_argnums=0)
# (The scan's carry starts invariant and becomes per device: no replication check here.)
sample_map = jax.jit(shard_map(lambda b, k: samples(local(b), k)[None], mesh=mesh,
                               in_specs=(P("d"), P()), out_specs=P("d"), check_vma=False))
result["per_device_add"], buffers = best_donated(add_map, buffers, step)
result["per_device_sample"] = best(sample_map, buffers, keys)
print(json.dumps(result))
"""


def run(n: int, axis: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    import jax  # only to ask the platform; the worker imports it again with its devices

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) < n:  # emulate the devices on the CPU
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        ).strip()
    sizes = (n, args.rows, args.length, args.batch, args.steps, args.repeat)
    argv = [*map(str, sizes), axis]
    figures = worker_json(WORKER, argv, env, 1800, f"the worker on {n} devices")
    figures["platform"] = "accelerator" if len(accelerators) >= n else "cpu (emulated)"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--rows", type=int, default=16, help="rows per device")
    parser.add_argument("--length", type=int, default=4096, help="steps per row")
    parser.add_argument("--batch", type=int, default=256, help="windows sampled per device")
    parser.add_argument("--steps", type=int, default=200, help="calls per scan")
    parser.add_argument("--repeat", type=int, default=5, help="timed scans (best taken)")
    parser.add_argument(
        "--axis-types",
        default="Auto,Explicit",
        help="mesh axis types, each run at every device count (the ratio printed after)",
    )
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.length, args.steps, args.repeat = 512, 20, 3
    counts = [int(x) for x in args.devices.split(",") if x]
    cores = os.cpu_count() or 1
    axes = [a for a in args.axis_types.split(",") if a]
    results = [run(n, axis, args) for n in counts for axis in axes]
    rows = []
    for r in results:
        n = r["devices"]
        base = next(b for b in results if b["axis"] == r["axis"])  # its axis type's first
        row: dict[str, Any] = {"devices": n, "axis": r["axis"], "platform": r["platform"]}
        for layout in ("shard_rows", "row_blocks", "per_device"):
            for op in ("add", "sample"):
                t = r[f"{layout}_{op}"]
                row[f"{layout} {op}"] = f"{fmt_time(t)} ({base[f'{layout}_{op}'] / t:.2f})"
        if r["platform"] != "accelerator":
            row["best possible"] = f"{min(n, cores) / n:.2f}"
        rows.append(row)
    print(
        f"Per-device work fixed: {args.rows} rows x {args.length} steps of obs (64,) float32, "
        f"add of 1 step per row, sample of {args.batch} windows of 8 per device; time per "
        f"call for the whole mesh (efficiency against linear, t(1) / t(n))."
    )
    print(table(rows))
    if len(axes) > 1:  # the same layouts on the second axis type, against the first
        ratios = []
        for n in counts:
            first, second = (
                next(r for r in results if r["devices"] == n and r["axis"] == a) for a in axes[:2]
            )
            row = {"devices": n}
            for layout in ("shard_rows", "row_blocks", "per_device"):
                for op in ("add", "sample"):
                    key = f"{layout}_{op}"
                    row[f"{layout} {op}"] = f"{second[key] / first[key]:.2f}"
            ratios.append(row)
        print(f"\nTime on {axes[1]} axes / time on {axes[0]} axes (1.00: the same):")
        print(table(ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
