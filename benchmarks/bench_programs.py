"""Host callbacks and conditionals in the compiled programs of every kind of buffer.

On a GPU a host callback (what `eqx.error_if` raises through) or a `conditional` whose
predicate the host must read makes the device wait for the host at every call (issue 25). This
script compiles, for every kind of buffer the library exports, its `add` (one step, and four
steps), its `sample` (`Queue`'s and `RateLimited`'s return the buffer too), its
`set_priorities` where it has one, and one loop of add + sample (+ `set_priorities`) inside a
`lax.scan`: each under `jax.jit(..., donate_argnums=0)` (the buffer donated), lowered and
compiled for the default backend (`jax.jit(f).lower(...).compile().as_text()`), and counts in
the optimized HLO (`count_ops`):

- `callbacks`: custom-calls whose target is a Python/host callback (the targets seen are
  listed, e.g. `xla_ffi_python_cpu_callback`);
- `conditionals`: `conditional` instructions, and `checks`: those of them whose branches
  reach a host callback (an `eqx.error_if`); the others are the library's own branches (the
  ring's block write on a CPU);
- `whiles`: `while` loops (on a CPU, also the PRNG's rolled loop; for information).

Counts are of instructions in the program (one call), so an op inside the scan's body counts
once however many iterations run. Each mode of `EQX_ON_ERROR` (unset: the default; `raise`;
`off`) runs in its own process, since Equinox reads the variable at import.

    python -m benchmarks.bench_programs [--json PATH] [--modes default,raise,off]

`count_ops(hlo_text)`, `programs()` and `compiled_text(fn, *args)` are importable without
pytest (a test can pin that no default program holds a host callback).
"""

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

import equibuffer as eb
from tests import mesh_kinds as mk

from ._machine import commit, describe
from ._timing import materialise, table


ROWS, LENGTH, BATCH, LOOP = 2, 64, 8, 4
OPS = ("add", "add 4 steps", "sample", "set_priorities", "loop")
_OPCODE = re.compile(r"[\])}] ([\w-]+)\(")  # `%x = f32[8]{0} opcode(...`: the opcode
_HEADER = re.compile(r"^(?:ENTRY )?%?([^\s(]+) \(.*\{$")  # `%region_2.12 (p: ...) -> ... {`
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def is_host_callback(target: str) -> bool:
    """Whether a custom-call target runs Python on the host: `xla_python_cpu_callback`,
    `xla_ffi_python_cpu_callback`, `xla_python_gpu_callback`, `xla_ffi_python_gpu_callback`,
    their partitioned variants, ..."""
    return "callback" in target.lower()


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, by name."""
    comps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        if current is None:
            match = _HEADER.match(line)
            if match:
                current = comps.setdefault(match.group(1), [])
        elif line.startswith("}"):
            current = None
        else:
            current.append(line)
    return comps


def _called(line: str) -> list[str]:
    names = []
    for one, many in _CALLED.findall(line):
        names += [one] if one else [n.strip().lstrip("%") for n in many.split(",")]
    return names


def count_ops(hlo_text: str) -> dict[str, int]:
    """Counts in an (optimized) HLO module's text: `callbacks` (custom-calls whose target is a
    host callback, `is_host_callback`), `conditionals`, `checks` (the conditionals whose
    branches reach a host callback, directly or through called computations), `whiles` and
    `host_transfers` (send/recv/infeed/outfeed to the host). No pytest, no JAX needed."""
    comps = _computations(hlo_text)
    lines = [line for body in comps.values() for line in body] or hlo_text.splitlines()
    names = ("callbacks", "conditionals", "checks", "whiles", "host_transfers")
    counts: dict[str, int] = dict.fromkeys(names, 0)
    reaches: dict[str, bool] = {}

    def reaches_callback(name: str) -> bool:
        if name not in reaches:
            reaches[name] = False  # (no cycles in HLO; this also stops a malformed one)
            reaches[name] = any(
                is_host_callback(t) for line in comps.get(name, []) for t in _TARGET.findall(line)
            ) or any(reaches_callback(c) for line in comps.get(name, []) for c in _called(line))
        return reaches[name]

    for line in lines:
        match = _OPCODE.search(line.split(", metadata=")[0])
        opcode = match.group(1) if match else ""
        if opcode == "custom-call" and any(map(is_host_callback, _TARGET.findall(line))):
            counts["callbacks"] += 1
        elif opcode == "conditional":
            counts["conditionals"] += 1
            counts["checks"] += any(map(reaches_callback, _called(line)))
        elif opcode == "while":
            counts["whiles"] += 1
        elif opcode in ("send", "recv", "infeed", "outfeed") and "is_host_transfer=true" in line:
            counts["host_transfers"] += 1
    return counts


def callback_targets(hlo_text: str) -> set[str]:
    """The host-callback custom-call targets named in an HLO module's text."""
    return {t for t in _TARGET.findall(hlo_text) if is_host_callback(t)}


def compiled_text(fn: Callable[..., Any], *args: Any) -> str:
    """The optimized HLO of `jax.jit(fn, donate_argnums=0)` (the first argument, the buffer,
    donated) for `args`, compiled for the default backend."""
    text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    assert text is not None, "this JAX gives no text of a compiled program"
    return text


def kinds() -> dict[str, Callable[[], Any]]:
    """Builders of one buffer of every kind the library exports: the 13 of
    `tests/mesh_kinds.py` and the prioritised transition buffer (plain, n-step) and the
    episode-aware buffer's default mode (`never_cross`)."""
    ex, rows, length = mk.EXAMPLE, ROWS, LENGTH
    return {
        **mk.kinds(ROWS, LENGTH),
        "prioritised_transition": lambda: eb.PrioritisedTransitionBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length
        ),
        "prioritised_n_step": lambda: eb.PrioritisedTransitionBuffer(
            ex, add_batch_size=rows, max_length_time_axis=length, n_step=3, discount=0.9
        ),
        "episodes_never_cross": lambda: eb.EpisodeTrajectoryBuffer(
            ex,
            add_batch_size=rows,
            max_length_time_axis=length,
            sequence_length=3,
            episode_end="terminated",
        ),  # fmt: skip
    }


def _prioritised(buffer: Any) -> bool:
    inner = buffer.buffer if isinstance(buffer, eb.RateLimited) else buffer
    return isinstance(inner, eb.AbstractPrioritisedSource)


def _sample(buffer: Any, key: jax.Array) -> tuple[Any, Any]:
    """`(buffer, sample)` by the buffer's own `sample` (the queue's takes no key)."""
    if isinstance(buffer, eb.Queue | eb.RateLimited):
        return buffer.sample() if isinstance(buffer, eb.Queue) else mk.draw(buffer, key, BATCH)
    return buffer, mk.draw(buffer, key, BATCH)


def _set(buffer: Any, sample: Any) -> Any:
    return buffer.set_priorities(sample, sample.weights + 1.0)


def _loop(buffer: Any, steps: Any, key: jax.Array) -> tuple[Any, jax.Array]:
    """`LOOP` iterations of add one step + sample (+ set_priorities) in a `lax.scan`."""

    def body(carry: tuple[Any, jax.Array], xs: tuple[Any, jax.Array]) -> tuple[Any, None]:
        buffer, total = carry
        step, k = xs
        buffer, sample = _sample(mk.add(buffer, step), k)
        if _prioritised(buffer):
            buffer = _set(buffer, sample)
        return (buffer, total + materialise(sample.experience)), None

    xs = (jax.tree.map(lambda x: jnp.stack([x] * LOOP), steps), jax.random.split(key, LOOP))
    return jax.lax.scan(body, (buffer, jnp.float32(0)), xs)[0]


def programs() -> Iterator[tuple[str, str, Callable[..., Any], tuple[Any, ...]]]:
    """`(kind, op, fn, args)` for every kind and op (`OPS`; `set_priorities` only where the
    kind has priorities): `fn(*args)` is the program, its first argument the buffer."""
    key = jax.random.key(0)
    steps4 = mk.batch(0, ROWS)  # (rows, 4 steps, ...)
    step = jax.tree.map(lambda x: x[:, 0], steps4)
    for name, build in kinds().items():
        buffer = mk.add(build(), steps4)
        yield name, "add", mk.add, (buffer, step)
        yield name, "add 4 steps", mk.add, (buffer, steps4)
        yield name, "sample", _sample, (buffer, key)
        if _prioritised(buffer):
            sample = _sample(buffer, key)[1]
            yield name, "set_priorities", _set, (buffer, sample)
        yield name, "loop", _loop, (buffer, step, key)


def measure() -> dict[str, Any]:
    """Counts for every program, in this process's `EQX_ON_ERROR`."""
    rows, targets = [], set()
    for name, op, fn, args in programs():
        text = compiled_text(fn, *args)
        targets |= callback_targets(text)
        rows.append({"kind": name, "op": op, **count_ops(text)})
        print(f"  {name:24s} {op:16s} {rows[-1]}", file=sys.stderr, flush=True)
    return {"rows": rows, "callback_targets": sorted(targets)}


def _in_mode(mode: str) -> dict[str, Any]:
    """`measure()` in a fresh process with `EQX_ON_ERROR=mode` (`default`: unset)."""
    env = dict(os.environ)
    env.pop("EQX_ON_ERROR", None)
    if mode != "default":
        env["EQX_ON_ERROR"] = mode
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_programs", "--measure"],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])  # (the last line: the JSON)


def merge(by_mode: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, op): callbacks and conditionals (checks among them) per mode."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for mode, result in by_mode.items():
        for r in result["rows"]:
            row = merged.setdefault((r["kind"], r["op"]), {"kind": r["kind"], "op": r["op"]})
            row[f"callbacks {mode}"] = r["callbacks"]
            row[f"conditionals {mode}"] = r["conditionals"]
            row[f"checks {mode}"] = r["checks"]
            row[f"whiles {mode}"] = r["whiles"]
    return list(merged.values())


def summary(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """Per mode: how many programs hold a host callback or a conditional, and which
    conditionals are not checks."""
    lines = ["summary"]
    for mode in modes:
        with_callback = [r for r in rows if r[f"callbacks {mode}"]]
        with_cond = [r for r in rows if r[f"conditionals {mode}"]]
        other = [
            f"{r['kind']} {r['op']} ({r[f'conditionals {mode}'] - r[f'checks {mode}']})"
            for r in with_cond
            if r[f"conditionals {mode}"] > r[f"checks {mode}"]
        ]
        lines.append(
            f"EQX_ON_ERROR={mode}: {len(with_callback)} of {len(rows)} programs hold a host "
            f"callback, {len(with_cond)} a conditional; conditionals that are not checks: "
            + (", ".join(other) or "none")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", default="benchmarks/results/programs.json")
    parser.add_argument("--modes", default=None, help="EQX_ON_ERROR values (default,raise,off)")
    parser.add_argument("--quick", action="store_true", help="only the modes default and off")
    parser.add_argument("--label", default=None, help="what this run is, kept in the JSON")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # one mode, in this process: JSON on stdout
        print(json.dumps(measure()))
        return
    machine = describe()
    modes = args.modes or ("default,off" if args.quick else "default,raise,off")
    by_mode = {}
    for mode in modes.split(","):
        print(f"EQX_ON_ERROR={mode}: compiling every program", flush=True)
        by_mode[mode] = _in_mode(mode)
    rows = merge(by_mode)
    shown = [{k: v for k, v in r.items() if not k.startswith("whiles")} for r in rows]
    print(table(shown))
    print(summary(rows, list(by_mode)))
    result = {
        **({"label": args.label} if args.label else {}),
        "commit": commit(),
        "what": "instructions in the optimized HLO of one call (jax.jit, buffer donated)",
        "backend": jax.default_backend(),
        "sizes": f"rows {ROWS}, length {LENGTH}, batch {BATCH}, loop {LOOP} iterations",
        "callback_targets": {mode: r["callback_targets"] for mode, r in by_mode.items()},
        "programs": rows,
        "machine": machine,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
