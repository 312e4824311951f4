"""The provider answers 429 to everything for 20 s during a blast and a stream of OTPs: nothing is
dropped, every send is delivered once after it recovers, and the cool-down is shared, so the number
of 429s is bounded by the requests in flight when the storm began, not by the number of messages."""

import threading
import time

from streams.retry.dlq import read_all
from tests.harness import committed_lag, email_request, sms_request, wait_until

STORM_S = 20
BLAST = 2_000
OTP_RATE, OTP_SECONDS = 4, 25
CONCURRENCY = 8
WORKERS = 2


def test_twenty_second_429_storm_loses_nothing_and_duplicates_nothing(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given marketing and transactional email workers (8 requests in flight each) with their retriers, and a provider
    that answers 429 to every request for 20 s,
    When a 2,000-email marketing blast is published as the storm starts and transactional OTPs keep arriving at 4 a
    second for 25 s,
    Then every send is delivered exactly once after the storm, both lanes are fully committed, nothing is
    dead-lettered, no marketing email goes through the single-email endpoint, and the shared cool-down keeps the 429s
    to at most 32 (the requests in flight), not one per message."""
    channel_topics("email")
    mock_provider.reset(rate=50)
    limits.set_provider("resend", 50, 50, reserve=5)
    limits.set_tenant("resend", "*", 100_000, 100)
    processes.worker("email", "marketing", "--concurrency", str(CONCURRENCY))
    processes.worker("email", "transactional", "--concurrency", str(CONCURRENCY))
    for lane in ("transactional", "marketing"):
        processes.retrier("email", lane)

    # Given a storm of 429s that starts with the blast
    mock_provider.configure(throttle_all_for_s=STORM_S)
    blast_ids = []
    for _ in range(BLAST // 500):
        blast_ids += send_client.publish_batch("blaster", [email_request("marketing")] * 500)
    otp_ids: list[str] = []

    def otp_stream():  # OTPs keep arriving through the storm and after it
        for _ in range(OTP_RATE * OTP_SECONDS):
            otp_ids.append(send_client.publish("shop", email_request("transactional")))
            time.sleep(1 / OTP_RATE)  # pacing a producer, not synchronizing the test

    t = threading.Thread(target=otp_stream)
    t.start()
    t.join()

    # Then every send is delivered once the storm has passed
    wanted = set(blast_ids) | set(otp_ids)
    wait_until(lambda: wanted <= set(mock_provider.stats(deliveries=True)["deliveries"]), 180,
               "every send to be delivered after the storm", interval=1.0)
    for lane in ("marketing", "transactional"):
        wait_until(lambda lane=lane: committed_lag(stack.bootstrap, names.group("email", lane),
                                                   names.lane("email", lane)) == 0, 30, f"{lane} committed")
    stats = mock_provider.stats()
    assert stats["duplicate_deliveries"] == 0
    assert stats["idempotent_replays"] == 0  # a 429 took nothing: nothing was sent twice, answered from the store
    assert read_all(stack.bootstrap, names.dlq, timeout_s=5) == []  # nothing dead-lettered, nothing dropped
    assert stats["throttled"] >= 1  # the storm happened
    # The shared cool-down: only requests already in flight saw a 429 (plus the cool-down's
    # edges), not one per message of a 2,000-message blast.
    assert stats["throttled"] <= WORKERS * CONCURRENCY * 2, stats["throttled"]
    assert stats["marketing_single_requests"] == 0


def test_short_429s_are_waited_out_in_the_worker(stack, names, channel_topics, limits, processes, send_client,
                                                 mock_provider):
    """Given an SMS provider that really allows 2 requests a second while the operator set the global bucket to 50, one
    transactional SMS worker and no retrier running,
    When a batch of 30 SMS sends waits on the lane as the worker starts (its first poll reads them all, and its first
    round sends 8 at once, however busy the machine: a worker started first may meet them in pieces, slowly enough on
    a loaded machine to stay under 2 a second),
    Then the provider's 429s (Retry-After: 1) are waited out inside the worker: some requests are throttled, yet every
    send is delivered exactly once and nothing is put on the 10 s retry tier."""
    # Given an operator set the global bucket above the provider's real limit (2 req/s)
    channel_topics("sms")
    mock_provider.reset(rate=2)
    limits.set_provider("sms", 50, 50)
    limits.set_tenant("sms", "*", 1000, 1000)
    ids = send_client.publish_batch("shop", [{**sms_request()}] * 30)
    processes.worker("sms", "transactional")  # and no retrier runs: nothing may rely on a tier

    # Then the 429s (Retry-After: 1) are waited out behind the shared cool-down: all delivered once
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("sms", "transactional"),
                                     names.lane("sms", "transactional")) == 0, 90, "every send to be delivered")
    stats = mock_provider.stats(deliveries=True)
    assert stats["throttled"] > 0
    assert set(ids) <= set(stats["deliveries"]) and stats["duplicate_deliveries"] == 0
    assert read_all(stack.bootstrap, names.retry("sms", "transactional", "10s"), timeout_s=2) == []
