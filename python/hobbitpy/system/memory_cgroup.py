"""A memory cap for benchmark runs: a child memory cgroup that limits RSS and page
cache together, so stock llama.cpp (which maps the model) and hobbitpy (which reads
experts into its cache) are held to the same memory.

cgroup v1: a child of the process's own memory cgroup (../shared/DESIGN.md §6).
cgroup v2: a child of the own cgroup, if the memory controller is delegated there.
Where neither is writable, ``MemoryCap.create`` returns None and the caller falls back
to expert budgets alone (and says so).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def _own_cgroups() -> list[tuple[str, str]]:
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    return [tuple(line.split(":", 2)[1:]) for line in lines if line.count(":") >= 2]


class MemoryCap:
    """One child cgroup; ``set_limit`` before each run, ``enter`` in the child process."""

    def __init__(self, path: pathlib.Path, v2: bool):
        self._events_at_limit = 0
        self.path = path
        self.v2 = v2

    @classmethod
    def create(cls, name: str) -> "MemoryCap | None":
        for controllers, rel in _own_cgroups():
            if controllers == "":  # v2 unified hierarchy
                parent = CGROUP_ROOT / rel.lstrip("/")
                if not (parent / "memory.max").exists() and "memory" not in _read(parent / "cgroup.subtree_control"):
                    continue
                v2 = True
            elif "memory" in controllers.split(","):
                parent = CGROUP_ROOT / "memory" / rel.lstrip("/")
                v2 = False
            else:
                continue
            remove_stale(parent)
            path = parent / name
            try:
                path.mkdir()
            except OSError:
                continue
            cap = cls(path, v2)
            if cap._writable():
                return cap
            cap.remove()
        return None

    def _writable(self) -> bool:
        try:
            self.set_limit(None)
            return True
        except OSError:
            return False

    def set_limit(self, limit_bytes: int | None) -> None:
        """Limit RSS + page cache of the processes inside; None lifts the limit. Resets the peak.
        Between runs (no process inside) the page cache the last run left charged here is
        reclaimed first, so every run starts from nothing charged."""
        self._reclaim()
        if self.v2:
            (self.path / "memory.max").write_text("max" if limit_bytes is None else str(limit_bytes))
            peak = self.path / "memory.peak"
            if peak.exists():
                try:
                    peak.write_text("0")  # resettable since Linux 6.12
                except OSError:
                    pass
        else:
            (self.path / "memory.limit_in_bytes").write_text("-1" if limit_bytes is None else str(limit_bytes))
            (self.path / "memory.max_usage_in_bytes").write_text("0")
            (self.path / "memory.failcnt").write_text("0")
        self._events_at_limit = self._limit_events()

    def _reclaim(self) -> None:
        try:
            if self.v2:
                if (self.path / "memory.reclaim").exists():
                    (self.path / "memory.reclaim").write_text(str(1 << 40))
            elif not _read(self.path / "tasks").strip():
                (self.path / "memory.force_empty").write_text("0")
        except OSError:  # v2 reports EAGAIN when less could be reclaimed than asked: nothing to do
            pass

    def _limit_events(self) -> int:
        if not self.v2:
            text = _read(self.path / "memory.failcnt").strip()
            return int(text) if text.isdigit() else 0
        for line in _read(self.path / "memory.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "max" and value.strip().isdigit():
                return int(value)
        return 0

    def times_at_limit(self) -> int:
        """How often the processes inside ran into the limit since set_limit (cgroup v1
        memory.failcnt, v2 the "max" events): 0 = the cap never had to reclaim anything."""
        return self._limit_events() - self._events_at_limit

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        text = _read(self.path / name).strip()
        return int(text) if text.isdigit() else 0

    def enter(self) -> None:
        """Move the calling process inside (use as ``preexec_fn`` of the child)."""
        (self.path / ("cgroup.procs" if self.v2 else "tasks")).write_text(str(os.getpid()))

    def remove(self) -> None:
        """Stop whatever still runs inside (a worker of an interrupted run) and remove the cgroup."""
        _kill_tasks(self.path, self.v2)
        try:
            self.path.rmdir()
        except OSError:
            pass

    def __str__(self) -> str:
        return f"cgroup {'v2' if self.v2 else 'v1'} {self.path}"


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# a bench's cgroup is named after the process that made it (bench.py)
STALE_NAME = re.compile(r"hobbitpy-bench-(\d+)$")


def remove_stale(parent: pathlib.Path) -> None:
    """Remove the cgroups a killed bench left under parent (SIGKILL leaves no time to clean
    up): those whose owning process is gone, after stopping what still runs inside."""
    try:
        children = list(parent.iterdir())
    except OSError:
        return
    for child in children:
        m = STALE_NAME.match(child.name)
        if m is None or not child.is_dir() or _alive(int(m.group(1))):
            continue
        v2 = (child / "cgroup.procs").exists() and not (child / "tasks").exists()
        _kill_tasks(child, v2)
        try:
            child.rmdir()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_tasks(path: pathlib.Path, v2: bool) -> None:
    """SIGKILL every process inside the cgroup and wait (briefly) until none is left."""
    procs = path / ("cgroup.procs" if v2 else "tasks")
    for _ in range(100):
        pids = [int(p) for p in _read(procs).split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
