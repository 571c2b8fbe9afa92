"""A real memory limit on a child process, for "larger than memory" measured and enforced.

The strongest mechanism this machine allows, in this order:

- a **cgroup v2** child (`memory.max`, `memory.swap.max = 0`), where the cgroup this process
  is in delegates the memory controller;
- a **cgroup v1** child of the memory controller (`memory.limit_in_bytes`, and
  `memory.memsw.limit_in_bytes` where swap is accounted): root inside a container usually may
  make one. The kernel counts the process's resident memory and the page cache it brings in
  (which it reclaims first) and kills the process past the limit;
- **`RLIMIT_DATA`** otherwise (Linux 4.7+): the process's private writable address space
  (heap, anonymous mappings, thread stacks), reserved or touched; an allocation past it fails
  (`MemoryError`). Unlike `RLIMIT_AS` it leaves out the address space JAX reserves without
  writing (XLA aborts at its first compile under `RLIMIT_AS` = 1 GiB); it counts more than
  resident memory, so it is the stricter bound.

`MemoryLimit.command(argv)` wraps a command so that it runs under the limit (a shell that joins
the cgroup, or sets the rlimit, then `exec`s it: nothing runs in the parent between `fork` and
`exec`, so it is safe in a process with threads); `enforced()` proves the limit is real by
running a process that writes past it and checking that it did not survive.
"""

import os
import shlex
import subprocess
import sys
import uuid
from typing import Any


def _mounts() -> list[tuple[str, str, set[str]]]:
    """`(mount point, filesystem type, super options)` of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _, options = (right.split() + ["", "", ""])[:3]
                if fstype in ("cgroup", "cgroup2"):
                    out.append((left.split()[4], fstype, set(options.split(","))))
    except OSError:
        pass
    return out


def _own_path(controller: str) -> str:
    """This process's cgroup path in the hierarchy of `controller` ("" for cgroup v2)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(",") or controllers == controller:
                return path
    raise OSError(f"no {controller or 'cgroup v2'} line in /proc/self/cgroup")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _make_cgroup_v2(nbytes: int) -> str:
    mount = next(m for m, t, _ in _mounts() if t == "cgroup2")
    parent = os.path.join(mount, _own_path("").lstrip("/"))
    if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
        raise OSError(f"the memory controller is not available in {parent}")
    if "memory" not in _read(os.path.join(parent, "cgroup.subtree_control")).split():
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
    group = os.path.join(parent, f"equibuffer-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        _write(os.path.join(group, "memory.max"), str(nbytes))
        if os.path.exists(os.path.join(group, "memory.swap.max")):
            _write(os.path.join(group, "memory.swap.max"), "0")
    except OSError:
        os.rmdir(group)
        raise
    return group


def _make_cgroup_v1(nbytes: int) -> str:
    mount = next(m for m, t, opts in _mounts() if t == "cgroup" and "memory" in opts)
    parent = os.path.join(mount, _own_path("memory").lstrip("/"))
    if not os.path.isdir(parent):  # a cgroup namespace: its root is the mount's root
        parent = mount
    group = os.path.join(parent, f"equibuffer-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        _write(os.path.join(group, "memory.limit_in_bytes"), str(nbytes))
        memsw = os.path.join(group, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            try:  # no swap beyond the limit either (absent where swap is not accounted)
                _write(memsw, str(nbytes))
            except OSError:
                pass
    except OSError:
        os.rmdir(group)
        raise
    return group


class MemoryLimit:
    """A limit of `nbytes` for the processes run through `command`; `how` is `"auto"` (the
    strongest mechanism available, see the module), `"cgroup"` (v2 or v1, or an error) or
    `"rlimit"` (`RLIMIT_DATA`). A context manager: the cgroup is removed on exit."""

    def __init__(self, nbytes: int, how: str = "auto"):
        if how not in ("auto", "cgroup", "rlimit"):
            raise ValueError(f"how must be 'auto', 'cgroup' or 'rlimit', got {how!r}")
        self.nbytes = int(nbytes)
        self.group: str | None = None
        self.mechanism = "RLIMIT_DATA"
        failures = []
        if how != "rlimit":
            for name, make in (("cgroup v2", _make_cgroup_v2), ("cgroup v1", _make_cgroup_v1)):
                try:
                    self.group = make(self.nbytes)
                    self.mechanism = name
                    break
                except (OSError, StopIteration) as e:
                    failures.append(f"{name}: {e!r}")
        if how == "cgroup" and self.group is None:
            raise OSError("no memory cgroup could be made here: " + "; ".join(failures))
        self.failures = failures

    @staticmethod
    def available() -> list[str]:
        """The `how` values that make a limit here: `"cgroup"` where one can be made, and
        `"rlimit"` (always, on Linux)."""
        try:
            MemoryLimit(1 << 30, "cgroup").close()
        except OSError:
            return ["rlimit"]
        return ["cgroup", "rlimit"]

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run under the limit (the shell `exec`s it: same pid, same output)."""
        if self.group is None:
            kib = max(1, self.nbytes >> 10)
            return ["/bin/sh", "-c", f'ulimit -d {kib} && exec "$@"', "sh", *argv]
        procs = shlex.quote(os.path.join(self.group, "cgroup.procs"))
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def enforced(self) -> bool:
        """Whether a process that writes 1.5 times the limit (and that runs as the command
        above does) is stopped: killed by the kernel (cgroup) or refused (RLIMIT_DATA)."""
        code = f"x = b'\\x01' * {self.nbytes * 3 // 2}; print('survived')"
        out = subprocess.run(
            self.command([sys.executable, "-c", code]), capture_output=True, text=True
        )
        return out.returncode != 0 and "survived" not in out.stdout

    def stats(self) -> dict[str, Any]:
        """What the cgroup recorded (empty without one): its peak usage (resident memory and
        the page cache charged to it) and the number of processes the kernel killed in it."""
        if self.group is None:
            return {}
        g = self.group
        if self.mechanism == "cgroup v1":
            oom = dict(
                line.split() for line in _read(os.path.join(g, "memory.oom_control")).splitlines()
            )
            return {
                "peak_bytes": int(_read(os.path.join(g, "memory.max_usage_in_bytes"))),
                "oom_kills": int(oom.get("oom_kill", 0)),
            }
        events = dict(line.split() for line in _read(os.path.join(g, "memory.events")).splitlines())
        peak = os.path.join(g, "memory.peak")  # Linux 5.19+
        return {
            "peak_bytes": int(_read(peak)) if os.path.exists(peak) else None,
            "oom_kills": int(events.get("oom_kill", 0)),
        }

    def reset_peak(self) -> None:
        """Restart the cgroup's peak usage count (cgroup v1; v2's `memory.peak` is kept)."""
        if self.mechanism == "cgroup v1" and self.group is not None:
            _write(os.path.join(self.group, "memory.max_usage_in_bytes"), "0")

    def close(self) -> None:
        if self.group is not None:
            try:
                os.rmdir(self.group)
            except OSError:
                pass
            self.group = None

    def __enter__(self) -> "MemoryLimit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryLimit({self.nbytes >> 20} MiB by {self.mechanism})"
