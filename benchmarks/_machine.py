"""What a benchmark ran on, for the JSON it writes and the page rendered from it."""

import datetime
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

import jax


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe() -> dict[str, Any]:
    """The machine and software of this run: CPU model and cores, memory, the accelerator JAX
    uses, OS, Python and the versions of jax, equinox, flashbax and zarr, the date, and the
    load average (the cores may be shared: a high load makes wall times noisy)."""
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "device": f"{device.platform}: {getattr(device, 'device_kind', device.platform)}",
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "equinox", "flashbax", "zarr")},
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def commit() -> str:
    """The checkout's commit (`git rev-parse --short HEAD`), with `+changes` when the package
    (`equibuffer/`) differs from it; `unknown` without git (a copied tree, as on a lent GPU
    machine)."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        head = run("rev-parse", "--short", "HEAD")
        return head + ("+changes" if run("status", "--porcelain", "--", "equibuffer") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
