"""Several processes, one sharded buffer (issue 18, many hosts): the recipe of
docs/scaling.md, taken from the page, run as 2 processes on loopback (`jax.distributed`, CPU
collectives through gloo), each with 2 devices and its own rows: a check raised inside jit
surfaces in both, each process adds its rows and samples from all of them, and a checkpoint
restores on the same layout (orbax: each process writes and reads its own shards)."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from .helpers import chi_square_pvalue


pytestmark = pytest.mark.slow  # starts processes: `nox -s slow`, and CI


ROOT = pathlib.Path(__file__).resolve().parents[1]
PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    pid, coordinator, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    """
)
CHECKS = textwrap.dedent(
    """
    from jax.experimental import multihost_utils  # (the test's own comparisons)
    # A check inside jit raises its own message in every process, never a hang (recorded in
    # the sample, raised by `eb.check` on the host).
    start = time.perf_counter()
    try:
        eb.check(sample(eb.shard_rows(make(), mesh, "envs"), jax.random.key(0)))
        early = "no error"
    except Exception as error:
        early = str(error)
    early_s = time.perf_counter() - start
    counts = {}
    for i in range(40):
        got = multihost_utils.process_allgather(
            sample(buffer, jax.random.key(i)).experience["x"], tiled=True)
        assert (np.diff(got, axis=1) == 1).all()  # consecutive steps of one row
        for w in got[:, 0].tolist():
            counts[w] = counts.get(w, 0) + 1
    key = jax.random.key(99)
    again = [multihost_utils.process_allgather(sample(b, key).experience["x"], tiled=True)
             for b in (buffer, restored)]
    print(json.dumps({
        "pid": pid, "processes": jax.process_count(), "devices": jax.device_count(),
        "early": early, "early_s": early_s,
        "counts": {str(k): v for k, v in counts.items()},
        "restored_same": bool((again[0] == again[1]).all()),
        "spec": str(restored.storage.data["x"].sharding.spec),
        "steps_added": int(jax.device_get(restored.steps_added())),
        "restored_shards": sorted(
            s.device.id for s in restored.storage.data["x"].addressable_shards),
        "own_devices": sorted(d.id for d in jax.local_devices()),
    }))
    jax.distributed.shutdown()
    """
)


def _recipe() -> str:
    """The `py` block of docs/scaling.md's "Many hosts" section."""
    page = (ROOT / "docs" / "scaling.md").read_text()
    section = page[page.index("## Many hosts") :]
    return re.search(r"```py\n(.*?)```", section, flags=re.S).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(script: str, ckpt: str, timeout: float) -> list[str]:
    """Run `PRELUDE + script` as processes 0 and 1 of one `jax.distributed` run on loopback
    (from the project's root, so that `tests` imports); their standard outputs, in order,
    once both have exited successfully."""
    port = str(_free_port())
    # Without the run's persistent compilation cache (tests/conftest.py): with jax 0.12.1 two
    # processes of one `jax.distributed` run that share it hang (the checks' script ran past
    # 400 s, where without the cache it ends in 30 s; with jax 0.10 and 0.12.0 it did not).
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRELUDE + script, str(pid), f"localhost:{port}", ckpt],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for pid in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(stdout)
    finally:
        for p in procs:
            p.kill()
    return outs


def test_two_processes_share_one_sharded_buffer(tmp_path):
    recipe = _recipe()
    assert "process_allgather" not in recipe  # the checkpoint gathers nothing onto a host
    stdouts = _two_processes(recipe + CHECKS, str(tmp_path / "ckpt"), timeout=240)
    outs = [json.loads(stdout.strip().splitlines()[-1]) for stdout in stdouts]
    for pid, out in enumerate(outs):
        assert (out["pid"], out["processes"], out["devices"]) == (pid, 2, 4)
        assert "cannot be sampled yet" in out["early"] and out["early_s"] < 60
        assert out["restored_same"] and out["spec"].startswith("P('envs',")
        assert out["steps_added"] == 10
        # Each process read back the shards of its own devices only.
        assert out["restored_shards"] == out["own_devices"], out
    # Each process wrote its own shards: one OCDBT directory per process.
    written = sorted(os.listdir(tmp_path / "ckpt" / "10" / "default"))
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(written), written
    assert outs[0]["counts"] == outs[1]["counts"]  # both processes see the same samples
    # The law: uniform over the 8 windows of each of the 8 rows (10 steps, windows of 3),
    # of both processes' rows.
    counts = outs[0]["counts"]
    starts = [100 * r + t for r in range(8) for t in range(8)]
    assert sorted(int(k) for k in counts) == starts
    observed = np.array([counts[str(w)] for w in starts])
    assert chi_square_pvalue(observed, np.full(len(starts), 1 / len(starts))) > 1e-4


EVERY_CHECK = textwrap.dedent(
    """
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import AxisType
    import equibuffer as eb
    from tests.mesh_errors import CASES, run

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    mesh = jax.make_mesh((jax.device_count(),), ("envs",), axis_types=(AxisType.Auto,))
    for name, case in CASES.items():
        state, step = case()
        # Built in each process alike; placed from host memory (a process cannot move its
        # own device's arrays onto the other's devices).
        state = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
        error, seconds = run(eb.shard_rows(state, mesh, "envs"), step)
        print(json.dumps({"case": name, "error": error, "seconds": seconds}), flush=True)
    jax.distributed.shutdown()
    """
)


def test_every_check_raises_its_message_in_every_process():
    """Each check of tests/test_sharding_errors.py, on a buffer sharded over the 4 devices of
    2 processes: every process raises the check's own message, at once (no hang in a
    collective, no abort)."""
    from .test_sharding_errors import EXPECTED

    outs = []
    for stdout in _two_processes(EVERY_CHECK, "", timeout=400):
        cases = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        outs.append({case["case"]: case for case in cases})
    for out in outs:
        assert sorted(out) == sorted(EXPECTED)
        for name, pattern in EXPECTED.items():
            case = out[name]
            assert case["error"] is not None, f"{name}: no error"
            assert re.search(pattern, case["error"]), (name, case["error"])
            assert case["seconds"] < 60, case
    assert {n: c["error"] for n, c in outs[0].items()} == {
        n: c["error"] for n, c in outs[1].items()
    }
