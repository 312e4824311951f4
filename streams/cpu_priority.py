"""A lower CPU priority that holds against every process on the host, not only the caller's session.

`nice` alone is not enough where the kernel schedules by session (autogroup scheduling,
CONFIG_SCHED_AUTOGROUP, on by default in many distributions' kernels): each session is then a
scheduling group of its own, weighted like any other, and a thread's nice value weighs only against
the threads of its own session. A role that runs in a session of its own (the fleet and the ingest
API's bulk process start every process that way, and so do service managers) at nice 10 took as
much CPU as the broker beside it: two busy loops pinned to one core, in two sessions, one at nice 19,
got 50% each. A session leader therefore also sets its session's group to its nice value
(`/proc/<pid>/autogroup`). Inside a container (a cgroup CPU controller) autogroup does not apply:
nice weighs against the container's own processes, and the container's CPU weight (Kubernetes
CPU requests) sets its share of the host.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

# An unprivileged process may change an autogroup's nice value once per 100 ms, machine-wide.
_AUTOGROUP_RETRY_S = 0.1
_AUTOGROUP_ATTEMPTS = 5


def lower_own_priority(increment: int) -> int:
    """Add `increment` to this process's nice value and, if it leads its session, set the session's
    group to the same value. Returns the new nice value."""
    value = os.nice(increment)
    if os.getsid(0) == os.getpid():
        lower_session_group(os.getpid(), value)
    return value


def lower_session_group(pid: int, nice: int) -> bool:
    """Set the scheduling group of the session `pid` leads to `nice`. False where that could not
    be done (logged); a kernel without autogroup scheduling has no such group, and nothing to do."""
    path = Path(f"/proc/{pid}/autogroup")
    if not path.exists():
        return True
    for _ in range(_AUTOGROUP_ATTEMPTS):
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:  # another change within the last 100 ms (unprivileged callers)
            time.sleep(_AUTOGROUP_RETRY_S)  # the kernel's rate limit, not a synchronization
        except OSError as exc:
            log.warning("could not set the CPU priority of process %d's session to nice %d (%s): its nice value "
                        "holds only against its own session", pid, nice, exc)
            return False
    log.warning("could not set the CPU priority of process %d's session to nice %d: the kernel kept refusing "
                "(one change per 100 ms); its nice value holds only against its own session", pid, nice)
    return False

