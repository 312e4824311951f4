"""A role that gives up CPU priority gives it up against every process on the host, including
processes in other sessions (with autogroup scheduling, nice alone held only within a session)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
        autogroup = Path(f"/proc/{proc.pid}/autogroup")
        if not autogroup.exists():
            pytest.skip("this kernel has no autogroup scheduling: nice alone holds machine-wide")
        assert autogroup.read_text().split()[-1] == "10", autogroup.read_text()
    finally:
        proc.kill()
        proc.wait()
