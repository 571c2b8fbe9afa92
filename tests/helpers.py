"""Small shared helpers for the tests."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine


def spread(values, keep: int = 4, *, unpack: bool = False) -> list:
    """`values` for `pytest.mark.parametrize`, all but `keep` of them (spread evenly over the
    list, both ends included) marked `thorough`: a test run for every kind of buffer runs
    `keep` kinds in the quick tier (`nox -s tests`; each kind's own test file keeps testing
    it there) and every kind in `nox -s tests-all` and CI. `unpack`: each value is the tuple
    of several arguments."""
    values = list(values)
    kept = spread_kept(len(values), keep)

    def param(v):
        return pytest.param(*(v if unpack else (v,)), marks=pytest.mark.thorough)

    return [v if i in kept else param(v) for i, v in enumerate(values)]


def spread_kept(n: int, keep: int = 4) -> set[int]:
    """The positions among `n` values that `spread` keeps in the quick tier."""
    return {round(i * (n - 1) / (keep - 1)) for i in range(keep)} if n > keep else set(range(n))


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test of `counts` against `expected_probs`
    (categories with zero expected probability must have zero counts: checked separately)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(expected_probs, dtype=np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a category of zero probability was sampled"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    import scipy.stats  # (imported when used: it takes ~2 s in each test process)

    return float(scipy.stats.chisquare(counts[keep], expected).pvalue)


class ReferenceRing:
    """A NumPy reference model of the ring: every step ever added, per row, by absolute time.

    Values are chosen unique per (row, time) by the tests, so comparing a sampled window with
    `window(row, start)` checks both the data and its place.
    """

    def __init__(self, rows: int, length: int, sequence_length: int, period: int):
        self.rows, self.length = rows, length
        self.sequence_length, self.period = sequence_length, period
        self.steps: list[np.ndarray] = []  # each (rows, *leaf)

    @property
    def total(self) -> int:
        return len(self.steps)

    @property
    def fill(self) -> int:
        return min(self.total, self.length)

    def add(self, batch: np.ndarray) -> None:
        """`batch` shaped (rows, T, *leaf)."""
        for t in range(batch.shape[1]):
            self.steps.append(np.asarray(batch[:, t]))

    def valid_starts(self) -> list[int]:
        """Absolute start steps of every valid window (the same for each row)."""
        oldest = self.total - self.fill
        last = self.total - self.sequence_length
        return [t for t in range(oldest, last + 1) if t % self.period == 0]

    def window(self, row: int, start: int) -> np.ndarray:
        return np.stack([self.steps[t][row] for t in range(start, start + self.sequence_length)])


# --- Stateful tests: one scale for all of them, and a count of the sequences they run --------

# `EQUIBUFFER_STATEFUL_EXAMPLES=k` multiplies every stateful test's `max_examples` by `k`
# (`nox -s stateful` sets it); unset, each runs its small per-commit budget.
# The quick profile's `max_examples` (`nox -s tests`; registered in tests/conftest.py).
QUICK_EXAMPLES = 3
STATEFUL_EXAMPLES = "EQUIBUFFER_STATEFUL_EXAMPLES"

# Random operation sequences run in this process, by machine (or test) name. `conftest.py`
# adds up the xdist workers' counts and prints them when the variable above is set.
SEQUENCES: collections.Counter[str] = collections.Counter()


def stateful_scale() -> int:
    value = os.environ.get(STATEFUL_EXAMPLES, "").strip()
    if not value:
        return 1
    scale = int(value)
    if scale < 1:
        raise ValueError(f"{STATEFUL_EXAMPLES} must be a positive integer, got {value!r}.")
    return scale


def budget(n: int) -> int:
    """A property test's `max_examples`: `n` under the hypothesis profile `full` (the default,
    which `nox -s tests-all`, `nox -s stateful` and CI run), at most the `quick` profile's
    `max_examples` under it (`nox -s tests`). See tests/conftest.py."""
    return min(n, settings.default.max_examples)


def by_profile(full: int, quick: int) -> int:
    """A size for a non-property test (epochs of a statistical test, say): `full` under the
    hypothesis profile `full` (`nox -s tests-all`, CI), `quick` under `quick` (`nox -s
    tests`)."""
    return quick if settings.default.max_examples <= QUICK_EXAMPLES else full


def stateful_settings(max_examples: int, stateful_step_count: int | None = None) -> settings:
    """Settings of a stateful test: `budget(max_examples)` (times the scale above), no
    deadline (the first call of each configuration compiles)."""
    kw = {} if stateful_step_count is None else {"stateful_step_count": stateful_step_count}
    return settings(max_examples=budget(max_examples) * stateful_scale(), deadline=None, **kw)


def count_sequence(name: str) -> None:
    """Count one random operation sequence of the stateful test `name`."""
    SEQUENCES[name] += 1


class CountedMachine(RuleBasedStateMachine):
    """A state machine that counts its runs: hypothesis builds one instance per sequence."""

    def __init__(self) -> None:
        super().__init__()
        count_sequence(type(self).__name__)
        if sum(SEQUENCES.values()) % 16 == 0:  # one scaled-up test runs thousands of sequences
            release_compiled_programs()


# --- Compiled programs: a long test process drops them before the kernel refuses it memory ----

# Each program XLA compiles for the CPU maps memory for its code (about five areas of the
# process's address space and 0.4 MB each, measured with jax 0.12.1: 3,000 small jitted
# functions took a process from 492 to 16,116 mapped areas and from 223 to 1,142 MB) and keeps
# it while JAX's caches hold the program. Twice a worker running the whole suite at the full
# budgets aborted inside a compilation near its end ("Fatal Python error: Aborted" in
# `backend_compile_and_load`: CI on 3.13 and a run on 3.12). Run so without the clearing
# below (3.12, two workers), one worker reached 65,221 mapped areas, 309 below the kernel's
# limit (`vm.max_map_count`, 65,530 by default), and 4.3 GB: the likely cause, though that
# run passed. Past a quarter of the limit the caches are cleared (a worker then peaked at
# 22,322 areas and 2.4 GB): later tests compile again (or load from the persistent cache)
# what they use.
_MAPS = pathlib.Path("/proc/self/maps")
_MAX_MAPS = pathlib.Path("/proc/sys/vm/max_map_count")


def release_compiled_programs() -> bool:
    """Clear JAX's caches (`jax.clear_caches()`) when this process has mapped more than a
    quarter of the areas the kernel allows it; return whether it did. (Not on Linux: no-op.)"""
    try:
        limit = int(_MAX_MAPS.read_text())
        mapped = _MAPS.read_bytes().count(b"\n")
    except OSError:
        return False
    if mapped <= limit // 4:
        return False
    jax.clear_caches()
    return True


def xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a process of the tests with `devices` emulated CPU devices: this
    process's flags (tests/conftest.py compiles without LLVM's optimisations) and the count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"


def run_on_host_devices(script: str, devices: int, timeout: float, **env: str):
    """Run the Python `script` in a fresh process with `devices` emulated CPU devices (the test
    process has one) and return the `subprocess.CompletedProcess`. The script prints what it
    checked; a hang becomes `subprocess.TimeoutExpired` rather than a stuck suite."""
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",  # host devices, also on a machine with an accelerator
        **env,
    }
    # From the repository root, so that the script may `from tests.helpers import ...`.
    root = pathlib.Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=root,
    )


def json_lines_on_host_devices(
    script: str, devices: int, timeout: float, key: str, **env: str
) -> dict:
    """`run_on_host_devices`, for a script that prints one JSON object per case as it finishes:
    `{"cases": {obj[key]: obj}, "stderr": ...}`. A hang keeps the cases printed before it."""
    try:
        out = run_on_host_devices(script, devices, timeout, **env)
        stdout, stderr = out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        stdout, stderr = (e.stdout or b"").decode(), "timed out"
    cases = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            cases[case[key]] = case
    return {"cases": cases, "stderr": stderr[-3000:]}


_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
    r"(-start)?\("
)
_COPY = re.compile(r"= (\(?[^=]*?) (copy)(-start)?\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def compiled_hlo(fn, *args, donate: bool = False) -> str:
    """The optimised HLO text of `fn(*args)` compiled for the default device (arrays traced,
    the rest static), with every array of `args[0]` donated if `donate` (as
    `eqx.filter_jit(donate="all")` does for a state returned updated)."""
    (first, rest), static = eqx.partition((args[0], args[1:]), eqx.is_array)

    def raw(first, rest):
        head, tail = eqx.combine((first, rest), static)
        out = fn(head, *tail)
        return eqx.partition(out, eqx.is_array)[0]

    jitted = jax.jit(raw, donate_argnums=0 if donate else ())
    return compiled_as_users_compile(jitted.lower(first, rest))


def compiled_as_users_compile(lowered: jax.stages.Lowered) -> str:
    """The optimised HLO text of `lowered` compiled with the emitters users' XLA takes: the
    tests' processes compile with older, faster ones where jaxlib has them
    (tests/conftest.py), which lower some scatters and gathers otherwise."""
    older = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    options = {"xla_cpu_use_fusion_emitters": True} if older else None
    return lowered.compile(compiler_options=options).as_text()


def result_sizes(pattern: re.Pattern, hlo: str) -> list[int]:
    """The size, in elements, of every array result of the instructions `pattern` finds
    (its group 1: the result's type, an array or a tuple of them)."""
    return [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for m in pattern.finditer(hlo)
        for dims in _SHAPE.findall(m.group(1))
    ]


def scatters(jaxpr) -> list:
    """Every scatter equation of `jaxpr` and of the jaxprs inside it, in order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter"):
            out.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(scatters(inner))
    return out


def largest_collective(fn, *args) -> int:
    """The largest result, in elements, of any collective of the compiled `fn(*args)` (0 when
    it has none): on a mesh, what `fn` moves between devices at most in one collective."""
    return max([0, *result_sizes(_COLLECTIVE, compiled_hlo(fn, *args))])


def collectives(fn, *args) -> list[int]:
    """The size, in elements, of the result of every collective of the compiled `fn(*args)`
    (its `args[0]` donated), largest first: what `fn` moves between devices."""
    return sorted(result_sizes(_COLLECTIVE, compiled_hlo(fn, *args, donate=True)), reverse=True)


def copies(fn, *args) -> list[int]:
    """The size, in elements, of every copy (`copy`, `copy-start`) in the compiled
    `fn(*args)` with `args[0]` donated: a copy of a whole donated array means XLA could not
    update it in place."""
    return result_sizes(_COPY, compiled_hlo(fn, *args, donate=True))
