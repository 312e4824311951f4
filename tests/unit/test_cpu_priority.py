"""A role that gives up CPU priority gives it up against every process on the host, including
processes in other sessions (with autogroup scheduling, nice alone held only within a session)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from streams import cpu_priority
from streams.cpu_priority import lower_session_group
from streams.devtools.fleet import _spawn

BUSY_LOOP = textwrap.dedent("""
    import os, sys, time
    os.sched_setaffinity(0, {%d})
    if sys.argv[1] == "lower":
        from streams.cpu_priority import lower_own_priority
        lower_own_priority(10)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 2.0:
        pass
    print(time.process_time() - cpu0, flush=True)
""")


def _cpu_seconds_side_by_side() -> tuple[float, float]:
    """Two busy loops on one core for 2 s, each in a session of its own (as the fleet, the bulk
    process and service managers start roles); the second lowers its priority by 10."""
    core = max(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP % core, which], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
             for which in ("keep", "lower")]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        kept, lowered = (float(p.stdout.readline()) for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return kept, lowered


def test_a_lowered_role_yields_the_cpu_to_a_process_of_another_session():
    kept, lowered = _cpu_seconds_side_by_side()
    # nice 10 weighs 110 against nice 0's 1024: about a tenth. At equal weight (nice held only
    # inside the session) both got about a second each.
    assert lowered < 0.35 * kept, f"the lowered loop had {lowered:.2f} s of CPU against {kept:.2f} s"


def test_a_niced_fleet_member_runs_with_its_session_group_niced_too(tmp_path: Path):
    proc = _spawn(["sleep", "30"], dict(os.environ), tmp_path / "sleep.log", nice=10)
    try:
        autogroup = Path(f"/proc/{proc.pid}/autogroup")  # none on a kernel without autogroup: nothing to set
        assert not autogroup.exists() or autogroup.read_text().split()[-1] == "10", autogroup.read_text()
    finally:
        proc.kill()
        proc.wait()


SHARED_SESSION = textwrap.dedent("""
    import os
    from streams.cpu_priority import lower_own_priority
    lower_own_priority(10)
    group = open("/proc/self/autogroup").read().split()[-1] if os.path.exists("/proc/self/autogroup") else "none"
    print(os.getpriority(os.PRIO_PROCESS, 0), group, flush=True)
""")


def test_a_role_sharing_its_session_with_another_leaves_the_session_group_alone():
    """`streams worker --lane transactional & exec streams worker --lane marketing`: lowering the
    marketing role's session group would lower the OTP worker with it."""
    role = subprocess.Popen(["sh", "-c", f'sleep 60 >/dev/null 2>&1 & exec {sys.executable} -c "$0"', SHARED_SESSION],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = role.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(role.pid, signal.SIGKILL)  # the sleep, still in the role's process group
    untouched = "0" if Path("/proc/self/autogroup").exists() else "none"  # a kernel without autogroup has none
    assert out.split() == ["10", untouched], err


def _refusals(monkeypatch, tmp_path: Path, errors: list[int]) -> list[str]:
    """A /proc whose autogroup file answers each write with the next of `errors` (0: accepted)."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "autogroup").write_text("/autogroup-1 nice 0\n")
    monkeypatch.setattr(cpu_priority, "PROC", tmp_path)
    written: list[str] = []

    def write(path: Path, text: str) -> None:
        code = errors.pop(0) if errors else errno.EAGAIN
        if code:
            raise OSError(code, os.strerror(code))
        written.append(text)

    monkeypatch.setattr(cpu_priority, "_write", write)
    return written


def test_the_kernels_rate_limit_is_waited_out(monkeypatch, tmp_path: Path):
    written = _refusals(monkeypatch, tmp_path, [errno.EAGAIN, errno.EAGAIN, 0])
    assert lower_session_group(4242, 10) is True
    assert written == ["10"]


def test_a_change_the_kernel_keeps_refusing_is_given_up_and_logged(monkeypatch, tmp_path: Path, caplog):
    monkeypatch.setattr(cpu_priority, "AUTOGROUP_RETRY_FOR_S", 0.3)
    written = _refusals(monkeypatch, tmp_path, [])
    with caplog.at_level(logging.WARNING, "streams.cpu_priority"):
        assert lower_session_group(4242, 10) is False
    assert written == []
    assert "process 4242's session to nice 10" in caplog.text


def test_a_refused_permission_is_logged_at_once_not_raised(monkeypatch, tmp_path: Path, caplog):
    written = _refusals(monkeypatch, tmp_path, [errno.EPERM, 0])
    with caplog.at_level(logging.WARNING, "streams.cpu_priority"):
        assert lower_session_group(4242, 10) is False
    assert written == [] and "Operation not permitted" in caplog.text


def test_without_autogroup_scheduling_there_is_nothing_to_set(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(cpu_priority, "PROC", tmp_path)  # no /proc/<pid>/autogroup
    assert lower_session_group(4242, 10) is True
