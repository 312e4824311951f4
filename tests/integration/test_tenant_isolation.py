"""A tenant that empties its bucket consumes nobody else's quota and does not stall other tenants
whose messages share its partition."""

import time

from tests.harness import sms_request, wait_until

GLOBAL_RPS = 60
A_RATE, A_BURST = 5, 5
B_RATE, B_BURST = 20, 20
B_SENDS = 100
TOLERANCE = 0.8  # B must get at least 80% of its own limit's worth while A floods


def test_flooding_tenant_does_not_starve_a_neighbour_on_the_same_partition(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given one SMS partition where tenant A (5 a second, burst 5) has 400 sends queued ahead of tenant B's 100 (20 a
    second, burst 20), under a global limit of 60 a second,
    When one transactional SMS worker runs the lane,
    Then B's 100 sends reach the provider within 5 s of each other (its own limit allows 4 s) and soon after
    publishing, A never exceeds its own bucket over that window, the provider never answers 429, nothing is delivered
    twice, and A's remaining sends are still owed, not dropped: they keep reaching the provider."""
    # Given one partition shared by tenants A and B, the provider's real limit mirrored globally,
    # and A's bucket far smaller than what A is about to publish
    channel_topics("sms", lane_partitions=1)
    mock_provider.configure(rate=GLOBAL_RPS)
    mock_provider.reset(rate=GLOBAL_RPS)
    limits.set_provider("sms", GLOBAL_RPS, GLOBAL_RPS)
    limits.set_tenant("sms", "tenant-a", A_RATE, A_BURST)
    limits.set_tenant("sms", "tenant-b", B_RATE, B_BURST)
    a_ids = send_client.publish_batch("tenant-a", [sms_request()] * 400)  # ahead of B in the partition
    b_ids = send_client.publish_batch("tenant-b", [sms_request()] * B_SENDS)

    # When one worker runs the lane (with its retrier: what a tenant sends past what its bucket lets go within a
    # second waits its turn on a retry tier)
    processes.worker("sms", "transactional")
    consuming = time.time()  # the worker said it consumes (its start-up, however slow, is not B's wait)
    processes.retrier("sms", "transactional")
    wait_until(lambda: mock_provider.stats()["tenants"].get("tenant-b", {}).get("messages", 0) >= B_SENDS,
               60, "all of B's sends to reach the provider")
    stats = mock_provider.stats(deliveries=True)
    deliveries = stats["deliveries"]

    # Then B got its own limit's worth: its 100 sends took about (100 - burst) / rate seconds
    b_times = sorted(deliveries[i][0] for i in b_ids)
    b_span = b_times[-1] - b_times[0]
    ideal = (B_SENDS - B_BURST) / B_RATE
    assert b_span <= ideal / TOLERANCE, f"B needed {b_span:.1f} s for what its limit allows in {ideal:.1f} s"
    assert b_times[-1] - consuming <= ideal / TOLERANCE + 10  # +10 s: the group's join, the first fetch

    # And A never exceeded its own bucket over that window (rate x window + burst)
    a_in_window = [t for i in a_ids if i in deliveries for t in deliveries[i] if t <= b_times[-1]]
    window = b_times[-1] - min(a_in_window)
    assert len(a_in_window) <= A_RATE * window + A_BURST + 1

    # And the global bucket was never over-debited: the provider never had to say 429
    assert stats["throttled"] == 0
    assert stats["duplicate_deliveries"] == 0
    # A's remaining sends are still owed, not dropped: parked on the retry tier, they keep coming back at its rate
    a_sent = len([i for i in a_ids if i in deliveries])
    assert a_sent < len(a_ids)
    wait_until(lambda: len([i for i in a_ids if i in mock_provider.stats(deliveries=True)["deliveries"]]) >= a_sent + 10,
               30, "more of A's sends, back from the retry tier, to reach the provider")
