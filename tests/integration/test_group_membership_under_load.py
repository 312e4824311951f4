"""Workers joining and leaving a consumer group in the middle of a blast: three marketing and two
transactional workers, then every 10 s one worker added or stopped (SIGTERM and kill -9 in turn).
The groups use the cooperative-sticky assignor: a rebalance moves only the partitions that change
owner, and the other workers keep working through it."""

import signal
import time

import pytest

from tests.harness import committed_lag, email_request, free_port, metric, wait_until

pytestmark = pytest.mark.slow

BLAST = 6_000
OTPS = 300
CHANGES = 6


def test_members_join_and_leave_every_10_s_through_a_blast(stack, names, channel_topics, limits, processes,
                                                          send_client, mock_provider):
    """Given 3 marketing and 2 transactional email workers, a 6,000-email blast its tenant's limit spreads over
    about 100 s, and 300 OTPs trickling in,
    When every 10 s a worker joins or leaves (6 changes: join, SIGTERM, join, kill -9, join, SIGTERM),
    Then the blast is still being delivered after the last change, every send is delivered exactly once (0 lost,
    0 duplicates) and both lanes are committed to their end;
    the test prints the partitions moved by rebalances and the longest gap in deliveries (the longest stall)."""
    channel_topics("email")
    mock_provider.reset(rate=200, latency_ms=20)
    limits.set_provider("resend", 200, 200, reserve=20)
    limits.set_tenant("resend", "*", 100_000, 100)
    limits.set_tenant("resend", "blaster", 60, 100)  # the blast lasts ~100 s: every change (10-60 s) happens during it
    ports: dict[str, int] = {}

    def start(lane: str, n: int) -> None:
        ports[f"{lane}-{n}"] = free_port()
        processes.start(f"worker-{lane}-{n}", "worker", "--channel", "email", "--lane", lane,
                        "--metrics-port", str(ports[f"{lane}-{n}"]), ready="consuming")

    for n in range(3):
        start("marketing", n)
    for n in range(2):
        start("transactional", n)
    processes.retrier("email", "marketing")
    processes.retrier("email", "transactional")
    ids = []
    for _ in range(BLAST // 1000):
        ids += send_client.publish_batch("blaster", [email_request("marketing")] * 1000)
    blast = list(ids)
    next_n, alive, changes = 3, ["marketing-0", "marketing-1", "marketing-2"], []
    started = time.monotonic()
    for change in range(CHANGES):
        ids += send_client.publish_batch("shop", [email_request("transactional")] * (OTPS // CHANGES))
        deadline = started + 10 * (change + 1)
        wait_until(lambda d=deadline: time.monotonic() >= d, 15, "the next change")  # a change every 10 s
        if change % 2 == 0:
            start("marketing", next_n)
            alive.append(f"marketing-{next_n}")
            changes.append(f"join marketing-{next_n}")
            next_n += 1
        else:
            name = alive.pop(0)
            member = next(m for m in processes.members if m.name == f"worker-{name}")
            how = signal.SIGTERM if change % 4 == 1 else signal.SIGKILL
            member.proc.send_signal(how)
            member.proc.wait(60)
            changes.append(f"{how.name} {name}")
    last_change_at = time.time()
    delivered = wait_until(lambda: set(ids) <= set(mock_provider.stats(deliveries=True)["deliveries"]), 180,
                           "every send to be delivered", interval=1.0)
    for lane in ("marketing", "transactional"):
        wait_until(lambda lane=lane: committed_lag(stack.bootstrap, names.group("email", lane),
                                                   names.lane("email", lane)) == 0, 60,
                   f"the {lane} lane to be committed to its end", interval=1.0)
    assert delivered
    stats = mock_provider.stats(deliveries=True)
    lost = set(ids) - set(stats["deliveries"])
    times = sorted(t for s in blast for t in stats["deliveries"].get(s, []))  # while the blast had work waiting
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    moved = sum(metric(p, "dispatch_worker_rebalances_total", kind="assigned") or 0
                for name, p in ports.items() if name in alive or name.startswith("transactional"))
    print(f"changes: {changes}; partitions assigned by rebalances (live workers): {moved:.0f}; "
          f"longest gap between blast deliveries: {max(gaps):.2f} s (blast took {times[-1] - times[0]:.1f} s); delivered {len(set(ids) - lost)} of {len(ids)}")
    assert times[-1] > last_change_at, "the blast was over before the members stopped changing"
    assert not lost, f"{len(lost)} sends lost"
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
