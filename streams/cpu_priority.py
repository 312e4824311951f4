"""A lower CPU priority that holds against every process on the host, not only the caller's session.

`nice` alone is not enough where the kernel schedules by session (autogroup scheduling,
CONFIG_SCHED_AUTOGROUP, on by default in many distributions' kernels): each session is then a
scheduling group of its own, weighted like any other, and a thread's nice value weighs only against
the threads of its own session. A role that runs in a session of its own (the fleet and the ingest
API's bulk process start every process that way, and so do service managers) at nice 10 took as
much CPU as the broker beside it: two busy loops pinned to one core, in two sessions, one at nice 19,
got 50% each. So the session's group gets the same nice value (`/proc/<pid>/autogroup`), unless
that would lower a process that did not ask for it (another role in the same session).

Autogroup applies only to processes in the host's root CPU cgroup. Inside a cgroup with a CPU
controller (a container, a systemd unit with CPU accounting) the write changes nothing and nice
weighs against that cgroup's own processes: the cgroup's CPU weight (Kubernetes CPU requests,
systemd `CPUWeight=`, compose `cpu_shares`) sets its share of the host.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROC = Path("/proc")
# An unprivileged process may change an autogroup's nice value once per 100 ms, host-wide; writers
# that start together retry at jittered intervals for this long.
AUTOGROUP_RETRY_FOR_S = 3.0


def lower_own_priority(increment: int) -> int:
    """Add `increment` to this process's nice value and set its session's group to the result, when
    every other process of the session is one of its ancestors (a shell or init that started it).
    Returns the new nice value."""
    value = os.nice(increment)
    others = _others_in_session(os.getpid())
    if others:
        log.info("nice %d holds against this session only: its group is not lowered, since it would lower "
                 "processes %s too (start this role in a session of its own)", value, sorted(others)[:5])
    else:
        lower_session_group(os.getpid(), value)
    return value


def start_in_own_session(argv: list[str], nice: int = 0, **popen: Any) -> subprocess.Popen:
    """Start `argv` in a session of its own, at nice value `nice` when given, its session's
    scheduling group included (`nice` execs the command: the pid is the command's)."""
    proc = subprocess.Popen(["nice", "-n", str(nice), *argv] if nice else argv,  # noqa: S603
                            start_new_session=True, **popen)
    if nice:
        lower_session_group(proc.pid, nice)
    return proc


def lower_session_group(pid: int, nice: int) -> bool:
    """Set the scheduling group of the session of `pid` to `nice`. False where that could not be
    done (logged); a kernel without autogroup scheduling has no such group, and nothing to do."""
    path = PROC / str(pid) / "autogroup"
    if not path.exists():
        return True
    deadline = time.monotonic() + AUTOGROUP_RETRY_FOR_S
    while True:
        try:
            _write(path, str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN or time.monotonic() > deadline:
                log.warning("could not set the CPU priority of process %d's session to nice %d (%s): its nice "
                            "value holds only against its own session", pid, nice, exc.strerror or exc)
                return False
        time.sleep(random.uniform(0.1, 0.2))  # noqa: S311 - the kernel's rate limit, spread out; not a sync


def _write(path: Path, text: str) -> None:
    """One write(2), so that the kernel's refusal (EAGAIN) comes back from it, not from a close."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _others_in_session(pid: int) -> set[int]:
    """The processes in the session of `pid` other than itself and its ancestors."""
    sid = os.getsid(pid)
    ancestors, p = set(), pid
    while (stat := _stat(p)) and stat[0] > 0:
        p = stat[0]
        ancestors.add(p)
    others = set()
    for entry in PROC.iterdir():
        other = int(entry.name) if entry.name.isdigit() else pid
        if other != pid and other not in ancestors and (stat := _stat(other)) and stat[1] == sid:
            others.add(other)
    return others


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) from /proc/<pid>/stat; None once it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])
