"""A duplicate job produces one send; so does the same send handled by two racing workers."""

import threading

import pytest
from confluent_kafka import Producer

from streams.dispatch import idempotency
from streams.dispatch.idempotency import RECORD_GONE, Claim, ProcessedJobs, idempotency_key
from streams.errors import StateLost, StoreUnavailable
from streams.names import RedisKeys
from streams.runtime import Runtime
from streams.send import build_send, encode, validate_request
from tests.harness import committed_lag, email_request, wait_until


def test_duplicate_job_produces_one_send(stack, names, channel_topics, limits, processes, mock_provider):
    """Given one transactional email published three times to its lane, followed by another send,
    When a worker processes the lane,
    Then all four messages are committed and the provider received each of the two sends exactly once."""
    # Given one send published three times (a producer retry, a replay, a copy)
    channel_topics("email")
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    send = build_send(validate_request(email_request()), "acme")
    topic = names.lane("email", "transactional")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for _ in range(3):
        producer.produce(topic, key=b"acme", value=encode(send))
    other = build_send(validate_request(email_request()), "acme")
    producer.produce(topic, key=b"acme", value=encode(other))
    producer.flush(10)

    # When a worker processes the lane
    processes.worker("email", "transactional")
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "transactional"), topic) == 0,
               30, "every message to be committed")

    # And a fourth copy, published once the send was delivered (another request, another round)
    wait_until(lambda: send.send_id in mock_provider.stats(deliveries=True)["deliveries"], 30, "the send's delivery")
    producer.produce(topic, key=b"acme", value=encode(send))
    producer.flush(10)
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "transactional"), topic) == 0,
               30, "the fourth copy to be committed")

    # Then the provider received each send once, and all five messages were consumed; and no request went twice:
    # the mock answers a key it knows from its store without counting a delivery, so a copy that skipped the
    # worker's claim would show only here
    stats = mock_provider.stats(deliveries=True)
    assert len(stats["deliveries"][send.send_id]) == 1
    assert len(stats["deliveries"][other.send_id]) == 1
    assert stats["idempotent_replays"] == 0
    assert stats["duplicate_deliveries"] == 0


def test_same_sends_raced_by_two_workers_are_delivered_once(stack, names, namespace, channel_topics,
                                                           limits, dispatch_env, mock_provider):
    """Given 300 marketing emails from three tenants on two partitions and a provider with 30 ms of latency,
    When two workers in separate consumer groups (a zombie after a rebalance) both process every message at the same
    time,
    Then each of the 300 sends reaches the provider exactly once, only through the batch endpoint."""
    # Given 300 marketing emails that two workers both hold at once (the zombie after a rebalance,
    # modelled as two consumer groups on the same partitions), and a provider with some latency
    channel_topics("email", lane_partitions=2)
    limits.set_provider("resend", 200, 200)
    limits.set_tenant("resend", "*", 10_000, 100)
    mock_provider.configure(latency_ms=30)
    sends = [build_send(validate_request(email_request("marketing")), f"tenant-{i % 3}") for i in range(300)]
    topic = names.lane("email", "marketing")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for s in sends:
        producer.produce(topic, key=s.tenant_id.encode(), value=encode(s))
    producer.flush(10)

    runtime = Runtime.from_env(dispatch_env)
    workers = [runtime.worker("email", "marketing", consumer_overrides={"group.id": f"{namespace}racer-{i}"})
               for i in range(2)]
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, kwargs={"until": stop.is_set}) for w in workers]
    for t in threads:
        t.start()
    try:
        # When both have processed every message
        for i in range(2):
            wait_until(lambda i=i: committed_lag(stack.bootstrap, f"{namespace}racer-{i}", topic) == 0, 60,
                       f"racer {i} to commit everything")
    finally:
        stop.set()
        for t in threads:
            t.join(30)

    # Then every send reached the provider exactly once, only through the batch endpoint
    stats = mock_provider.stats(deliveries=True)
    assert stats["distinct_sends"] == 300
    assert stats["duplicate_deliveries"] == 0
    assert stats["single_email_requests"] == 0 and stats["marketing_single_requests"] == 0


def test_a_worker_whose_lease_was_taken_over_frees_nothing_on_its_definite_failure(redis_client, namespace):
    """Given a batch claimed by worker A, whose lease lapsed (A stopped refreshing it) and which worker B took
    over to re-send it under its key,
    When A's own request then meets a definite failure (a 429, a refused connection) and A releases its claim,
    or meets an unknown answer and drops its lease,
    Then B's claim stands (the sends stay `inflight` under the key, B keeps the lease and the stored body), so
    no other worker can re-batch them under a new key while B's re-send may yet be accepted; and since the
    request was re-sent, even a definite failure of B's copy frees nothing (the provider may hold one)."""
    a = ProcessedJobs(redis_client, namespace, lease_s=0.2)  # A's lease lapses at once
    b = ProcessedJobs(redis_client, namespace, lease_s=60)   # B's lasts the test
    ids = ["s1", "s2", "s3"]
    key = idempotency_key(ids)
    assert a.claim_many([Claim("acme", key, tuple(ids), "worker-a", "/emails/batch", b"the body",
                               account="the-keys-digest")]) == [[]]
    taken = wait_until(lambda: b.take_over("acme", key, "worker-b", ids), 10, "A's lease to lapse", interval=0.05)
    assert (taken.body, taken.account) == (b"the body", "the-keys-digest")  # re-sent under that key only

    a.release("acme", ids, key, "worker-a")
    a.keep_unknown("acme", key, "worker-a", ids)
    assert b.status("acme", ids) == [f"inflight:{key}"] * 3
    assert b.take_over("acme", key, "worker-c", ids) is None  # B's lease is still B's

    b.release("acme", ids, key, "worker-b")
    assert b.status("acme", ids) == [f"inflight:{key}"] * 3


def test_a_late_definite_failure_frees_nothing_once_a_resends_outcome_is_unknown(redis_client, namespace):
    """Given a batch claimed by worker A, taken over by worker B after A's lease lapsed, and B's re-send met an
    unknown outcome (B dropped its lease so that a later attempt re-sends the request),
    When A's own request then meets a definite failure and A releases its claim,
    Then nothing is freed: the provider may hold B's copy, so the sends stay claimed under the key and the
    next attempt takes the request over and re-sends that same body."""
    a = ProcessedJobs(redis_client, namespace, lease_s=0.2)
    b = ProcessedJobs(redis_client, namespace, lease_s=60)
    ids = ["s1", "s2"]
    key = idempotency_key(ids)
    assert a.claim(ids, key, "worker-a", "/emails/batch", b"the body", "acme") == []
    wait_until(lambda: b.take_over("acme", key, "worker-b", ids), 10, "A's lease to lapse", interval=0.05)
    b.keep_unknown("acme", key, "worker-b", ids)

    a.release("acme", ids, key, "worker-a")
    assert b.status("acme", ids) == [f"inflight:{key}"] * 2
    assert b.take_over("acme", key, "worker-c", ids).body == b"the body"


def test_a_worker_whose_lease_merely_lapsed_still_frees_the_sends_of_its_failed_request(redis_client, namespace):
    """Given a batch claimed by worker A whose lease lapsed while A could not refresh it (a Redis outage
    during which A's settlement of a definite failure waited), and nobody took the request over,
    When A settles that failure,
    Then the sends are free again: the provider did not accept the request, and nothing re-sent it."""
    a = ProcessedJobs(redis_client, namespace, lease_s=0.2)
    ids = ["s1", "s2"]
    key = idempotency_key(ids)
    assert a.claim(ids, key, "worker-a", "/emails/batch", b"the body", "acme") == []
    wait_until(lambda: redis_client.get(a.keys.lease("acme", key)) is None, 10, "A's lease to lapse", interval=0.05)

    a.release("acme", ids, key, "worker-a")
    assert a.status("acme", ids) == [None] * 2



def test_a_release_asked_again_after_a_lost_reply_does_not_free_a_newer_claim(redis_client, namespace):
    """Given worker A's release of batch K that ran though its reply was lost, and worker C (the partition's
    new owner) that then claimed the same sends under the same key and whose lease lapsed,
    When A asks its release again,
    Then C's claim stands: the record names its owner, and only that owner releases it."""
    a = ProcessedJobs(redis_client, namespace, lease_s=60)
    c = ProcessedJobs(redis_client, namespace, lease_s=0.2)
    ids = ["s1", "s2"]
    key = idempotency_key(ids)
    assert a.claim(ids, key, "worker-a", "/emails/batch", b"A's body", "acme") == []
    a.release("acme", ids, key, "worker-a")  # ran; A did not hear back
    assert c.claim(ids, key, "worker-c", "/emails/batch", b"C's body", "acme") == []
    wait_until(lambda: redis_client.get(c.keys.lease("acme", key)) is None, 10, "C's lease to lapse", interval=0.05)

    a.release("acme", ids, key, "worker-a")
    assert c.status("acme", ids) == [f"inflight:{key}"] * 2


def test_a_request_whose_record_expired_keeps_its_sends_claimed_and_is_reported_gone(redis_client, namespace):
    """Given a batch claimed by a worker that died before the answer, whose record then expired (it lives inside
    the provider's idempotency window: 23 h of 24, 0.3 s here),
    When another worker meets its sends,
    Then they are still claimed under the key (not free to be sent afresh under another key, which could deliver
    them twice), the take-over reports the record gone instead of re-sending it, gives back the lease it took,
    and leaves no record without an expiry."""
    dead = ProcessedJobs(redis_client, namespace, lease_s=0.2)
    jobs = ProcessedJobs(redis_client, namespace)
    ids = ["s1", "s2"]
    key = idempotency_key(ids)
    assert dead.claim_many([Claim("acme", key, tuple(ids), "worker-a", "/emails/batch", b"the body",
                                  record_ttl_ms=300)]) == [[]]
    wait_until(lambda: not redis_client.exists(jobs.keys.request("acme", key)), 10, "the record to expire",
               interval=0.05)

    assert jobs.status("acme", ids) == [f"inflight:{key}"] * 2
    assert jobs.take_over("acme", key, "worker-b", ids) == RECORD_GONE
    assert redis_client.exists(jobs.keys.lease("acme", key), jobs.keys.request("acme", key)) == 0
    assert redis_client.pttl(jobs.keys.processed("acme", "s1")) > 24 * 3600 * 1000


def test_a_take_over_of_a_request_settled_meanwhile_is_not_reported_gone(redis_client, namespace):
    """Given a worker that read two batches' sends as in flight while their sender was still at work,
    When the first batch is then marked delivered and the second released (a definite failure) before the
    worker takes them over,
    Then neither take-over reports the record gone (which would dead-letter the sends as of unknown outcome):
    both say "read again", and the sends read `delivered` and free."""
    jobs = ProcessedJobs(redis_client, namespace, lease_s=60)
    delivered, released = ["s1", "s2"], ["s3", "s4"]
    for ids in (delivered, released):
        assert jobs.claim(ids, idempotency_key(ids), "worker-a", "/emails/batch", b"body", "acme") == []
    jobs.mark_delivered("acme", delivered, idempotency_key(delivered))
    jobs.release("acme", released, idempotency_key(released), "worker-a")

    assert jobs.take_over("acme", idempotency_key(delivered), "worker-b", delivered) is None
    assert jobs.take_over("acme", idempotency_key(released), "worker-b", released) is None
    assert jobs.status("acme", delivered + released) == ["delivered", "delivered", None, None]


def test_a_claim_that_finds_no_epoch_leaves_nothing_claimed_and_says_the_data_was_lost(redis_client, namespace):
    """Given a worker's processed_jobs that reads the Redis epoch with every claim,
    When it claims a request while Redis holds the epoch, and again after the epoch (with all data) is gone,
    Then the first claim stands; the second raises StateLost and leaves no claim, lease or record behind (the
    data it would have trusted was lost), and a claim that met a busy send is answered as before."""
    jobs = ProcessedJobs(redis_client, namespace, lease_s=60, epoch_required=True)
    keys = RedisKeys(namespace)
    redis_client.set(keys.epoch, "e1")
    assert jobs.claim(["s1"], "send-s1", "worker-a", "/emails", b"first", "acme") == []

    redis_client.delete(keys.epoch, keys.processed("acme", "s1"), keys.lease("acme", "send-s1"),
                        keys.request("acme", "send-s1"))
    with pytest.raises(StateLost):
        jobs.claim_many([Claim("acme", "send-s2", ("s2",), "worker-a", "/emails", b"second"),
                         Claim("acme", "send-s1", ("s1",), "worker-a", "/emails", b"again")])
    assert jobs.status("acme", ["s1", "s2"]) == [None, None]
    assert not redis_client.exists(keys.lease("acme", "send-s2"), keys.request("acme", "send-s2"),
                                   keys.lease("acme", "send-s1"), keys.request("acme", "send-s1"))

    redis_client.set(keys.epoch, "e2")
    assert jobs.claim(["s1"], "send-s1", "worker-a", "/emails", b"third", "acme") == []
    assert jobs.claim(["s1", "s3"], "batch-x", "worker-b", "/emails/batch", b"fourth", "acme") == [0]


def test_a_claim_that_finds_no_epoch_writes_nothing_so_no_failed_release_can_leave_it_behind(redis_client, namespace,
                                                                                           monkeypatch):
    """Given a worker's processed_jobs that reads the Redis epoch with every claim, and a Redis without its epoch
    (its data lost), where releasing claims would fail (Redis going away again),
    When the worker claims two requests in one round,
    Then StateLost is raised and neither request's sends, lease or record were written: the script that claims
    reads the epoch first, so nothing needs releasing (claiming, then releasing on a missing epoch, left these
    claims behind for 7 days, to be dead-lettered unknown_outcome at a provider without idempotency keys)."""
    jobs = ProcessedJobs(redis_client, namespace, lease_s=60, epoch_required=True)
    keys = RedisKeys(namespace)

    def release_fails(claims) -> None:
        if claims:
            raise StoreUnavailable("releasing claims: connection refused")

    monkeypatch.setattr(jobs, "release_unsent", release_fails)
    with pytest.raises(StateLost):
        jobs.claim_many([Claim("acme", "send-s1", ("s1",), "worker-a", "/emails", b"one"),
                         Claim("acme", "batch-x", ("s2", "s3"), "worker-a", "/emails/batch", b"two")])
    assert jobs.status("acme", ["s1", "s2", "s3"]) == [None, None, None]
    assert not redis_client.exists(keys.lease("acme", "send-s1"), keys.request("acme", "send-s1"),
                                   keys.lease("acme", "batch-x"), keys.request("acme", "batch-x"))


def test_a_webhook_workers_claims_expire_with_their_request_and_a_providers_outlive_it(dispatch_env, redis_client,
                                                                                     namespace):
    """Given an email worker and a webhook worker as the runtime builds them,
    When each claims a send,
    Then the email's claim outlives its stored request (24 h, the provider's idempotency window: a send met
    after it is left to reconciliation, never sent again), while the webhook delivery's claim expires with its
    request (receivers deduplicate by webhook-id with no window: the delivery is simply sent again)."""
    redis_client.set(RedisKeys(namespace).epoch, "e1")  # every claim reads it
    runtime = Runtime.from_env(dispatch_env)
    ttls = {}
    try:
        for channel, lane in (("email", "marketing"), ("webhook", "transactional")):
            worker = runtime.worker(channel, lane)
            jobs = worker.dispatcher.jobs
            assert jobs.claim([f"s-{channel}"], f"send-s-{channel}", "w", "/x", b"body", "acme") == []
            ttls[channel] = (redis_client.pttl(jobs.keys.processed("acme", f"s-{channel}")),
                             redis_client.pttl(jobs.keys.request("acme", f"send-s-{channel}")))
            worker.consumer.close()
    finally:
        runtime.close()
    day_ms = 24 * 3600 * 1000
    (email_claim, email_record), (hook_claim, hook_record) = ttls["email"], ttls["webhook"]
    assert email_record <= day_ms < email_claim
    assert hook_claim <= day_ms and hook_record <= day_ms



def test_a_webhook_deliverys_tried_mark_outlives_every_copy_of_it_not_its_claims_day(redis_client, namespace):
    """Given a webhook lane's processed jobs (claims kept a day: receivers deduplicate by webhook-id),
    When a delivery's attempt fails and is marked tried (by the release of its request, and once its retry copy is
    acknowledged), or is skipped for good (a disabled endpoint: tried before its next attempt),
    Then its mark lives longer than the webhook policy's max age, so a copy read again up to then (a retrier
    restarted re-releases what waited behind a copy parked near its max age) is stale, not sent (before: the mark
    lapsed after a day, and a copy read again on the second day was delivered: a skipped event sent after all)."""
    from streams.retry.policy import load_policies

    jobs = ProcessedJobs(redis_client, namespace, claim_ttl_ms=idempotency.RECORD_TTL_MS)  # as a webhook lane's
    key = idempotency_key(["d1"])
    assert jobs.claim(["d1"], key, "worker-a", "/hooks", b"body", "acme") == []
    jobs.release("acme", ["d1"], key, "worker-a", earlier={"d1": 1})
    jobs.mark_tried_many([("acme", "d2", 4)])
    max_age_ms = load_policies()["webhook"].max_age_s * 1000
    for delivery in ("d1", "d2"):
        assert redis_client.pttl(RedisKeys(namespace).processed("acme", delivery)) > max_age_ms


def test_a_failed_attempt_is_marked_once_its_copy_is_durable_and_never_over_a_later_state(redis_client, namespace):
    """Given a batch of two sends claimed by worker A and released after a definite failure,
    When A marks them tried (s1 on its attempt 1, s2 on its attempt 3) once their retry copies are acknowledged,
    Then each is `tried:<its attempt>` (kept 7 days) and free to claim: the next attempt's request
    claims both; a mark never lowers an attempt, nor replaces a claim (a later attempt's, or one kept after an
    unknown outcome) or a delivered send."""
    jobs = ProcessedJobs(redis_client, namespace)
    ids = ["s1", "s2"]
    key = idempotency_key(ids)
    assert jobs.claim(ids, key, "worker-a", "/emails/batch", b"body", "acme") == []
    jobs.release("acme", ids, key, "worker-a")
    jobs.mark_tried_many([("acme", "s1", 1), ("acme", "s2", 3), ("acme", "s2", 2)])
    assert jobs.status("acme", ids) == ["tried:1", "tried:3"]
    assert redis_client.pttl(RedisKeys(namespace).processed("acme", "s2")) > idempotency.RECORD_TTL_MS
    jobs.mark_tried_many([("acme", "s2", 2)])
    assert jobs.status("acme", ids) == ["tried:1", "tried:3"]
    again = idempotency_key(ids) + "-2"
    next_attempts = {"s1": 2, "s2": 4}
    assert jobs.claim_many([Claim("acme", again, tuple(ids), "worker-b", "/emails/batch", b"body", "",
                                  next_attempts)]) == [[]]
    jobs.mark_tried_many([("acme", "s1", 5)])  # a late mark meets the later attempt's claim
    assert jobs.status("acme", ids) == [f"inflight:{again}"] * 2
    jobs.mark_delivered("acme", ids, again)
    jobs.mark_tried_many([("acme", "s1", 9), ("acme", "s2", 9)])
    assert jobs.status("acme", ids) == ["delivered", "delivered"]


def test_a_release_keeps_the_mark_of_the_attempt_before(redis_client, namespace):
    """Given a send marked tried:1, claimed for its attempt 2,
    When attempt 2 fails and is released naming attempt 1 as the one before,
    Then the send is tried:1 again (free for attempt 2's retry copy, a copy of attempt 1 still stale), not
    free; a send on its first attempt is released free."""
    jobs = ProcessedJobs(redis_client, namespace)
    jobs.mark_tried_many([("acme", "s1", 1)])
    assert jobs.claim_many([Claim("acme", "batch-x", ("s1", "s2"), "w", "/emails/batch", b"b", "",
                                  {"s1": 2})]) == [[]]
    jobs.release("acme", ["s1", "s2"], "batch-x", "w", earlier={"s1": 1, "s2": 0})
    assert jobs.status("acme", ["s1", "s2"]) == ["tried:1", None]


def test_claims_never_sent_go_back_to_what_they_were_and_leave_another_workers_claim_alone(redis_client, namespace):
    """Given s1 marked tried:2, claimed with s2 (its first attempt) in batch K for s1's attempt 3 by worker A, and
    batch L claimed by worker B,
    When A releases the claims it never sent (K, and L as if its own claim of L had been made: a claim whose
    answer was lost is released without knowing whether it was),
    Then s1 is tried:2 again and s2 free, K's lease and record are gone, and B's claim of L stands."""
    jobs = ProcessedJobs(redis_client, namespace)
    keys = RedisKeys(namespace)
    jobs.mark_tried_many([("acme", "s1", 2)])
    k = Claim("acme", idempotency_key(["s1", "s2"]), ("s1", "s2"), "worker-a", "/emails/batch", b"k", "", {"s1": 3})
    l_of_b = Claim("acme", idempotency_key(["s3"]), ("s3",), "worker-b", "/emails", b"l")
    assert jobs.claim_many([k, l_of_b]) == [[], []]
    jobs.release_unsent([k, Claim("acme", l_of_b.key, ("s3",), "worker-a", "/emails", b"l")])
    assert jobs.status("acme", ["s1", "s2", "s3"]) == ["tried:2", None, f"inflight:{l_of_b.key}"]
    assert not redis_client.exists(keys.lease("acme", k.key), keys.request("acme", k.key))


def test_a_request_remembers_the_attempt_it_carries_each_send_on(redis_client, namespace):
    """Given a batch claimed for s1's attempt 3 and s2's first attempt (only attempts above the first are stored),
    When its sender dies and another worker takes it over, and after its re-send fails the copies carrying s2 on to
    attempt 2 are acknowledged (noted, never lowered: a late note of attempt 2 for s1 changes nothing),
    Then each take-over reads the live attempts (s1: 3, then s1: 3 and s2: 2), from which a copy behind them is
    stale; a note for a request whose record is gone writes nothing."""
    jobs = ProcessedJobs(redis_client, namespace)
    key = idempotency_key(["s1", "s2"])
    [busy] = jobs.claim_many([Claim("acme", key, ("s1", "s2"), "worker-a", "/emails/batch", b"body", "", {"s1": 3})])
    assert busy == []
    redis_client.delete(RedisKeys(namespace).lease("acme", key))  # its sender died: the lease lapsed
    stored = jobs.take_over("acme", key, "worker-b", ["s1", "s2"])
    assert stored is not None and stored != RECORD_GONE and stored.attempts == {"s1": 3}
    jobs.note_attempts([("acme", key, "s2", 2), ("acme", key, "s1", 2)])
    redis_client.delete(RedisKeys(namespace).lease("acme", key))
    again = jobs.take_over("acme", key, "worker-c", ["s1", "s2"])
    assert again is not None and again != RECORD_GONE and again.attempts == {"s1": 3, "s2": 2}
    jobs.note_attempts([("acme", "gone-request", "s3", 4)])
    assert not redis_client.exists(RedisKeys(namespace).request("acme", "gone-request"))


def test_an_unknown_outcome_whose_record_a_failover_lost_leaves_its_sends_to_reconciliation(redis_client, namespace):
    """Given a batch of five claimed by a worker whose request's outcome turns out unknown, its record and lease
    lost meanwhile (a failover that dropped the last writes took the claims of two sends with them, one read free,
    one back at `tried:1`; a third still shows the claim, as when the record expired), a fourth delivered by
    another request and a fifth claimed anew by one,
    When the worker keeps the request for a re-send,
    Then the three its claim no longer guards are marked `reconcile` (dead-lettered `unknown_outcome` when their
    retries come, never sent again: before, the retries went out in new batches under new keys, a second delivery
    of what the provider took), the delivered one and the one claimed anew are left as they are, and it says
    three; so is a single send's (its fresh request could be drawn into a batch under another key)."""
    jobs = ProcessedJobs(redis_client, namespace)
    ids = ["s1", "s2", "s3", "s4", "s5"]
    key = idempotency_key(ids)
    assert jobs.claim(ids, key, "worker-a", "/emails/batch", b"the body", "acme") == []
    keys = jobs.keys
    redis_client.delete(keys.request("acme", key), keys.lease("acme", key), keys.processed("acme", "s1"))
    redis_client.set(keys.processed("acme", "s2"), "tried:1")
    redis_client.set(keys.processed("acme", "s4"), "delivered")
    redis_client.set(keys.processed("acme", "s5"), "inflight:send-s5")

    assert jobs.keep_unknown("acme", key, "worker-a", ids) == 3

    assert jobs.status("acme", ids) == ["reconcile"] * 3 + ["delivered", "inflight:send-s5"]
    assert redis_client.ttl(keys.processed("acme", "s1")) > 6 * 24 * 3600
    assert jobs.claim(["s6"], "send-s6", "worker-a", "/emails", b"one", "acme") == []
    redis_client.delete(keys.request("acme", "send-s6"), keys.processed("acme", "s6"))
    assert jobs.keep_unknown("acme", "send-s6", "worker-a", ["s6"]) == 1
    assert jobs.status("acme", ["s6"]) == ["reconcile"]


def test_a_claim_meeting_a_tried_mark_of_its_own_attempt_claims_nothing(redis_client, namespace):
    """Given s1 marked `tried:2` (attempt 2 failed, its carrier acknowledged) after a worker read it free, that
    worker holding another copy of s1 for attempt 2 (read again after a rebalance),
    When it claims s1 for attempt 2 with s2, and then a copy of s1 for attempt 3 is claimed,
    Then the first claims nothing and names s1 busy (its copy is stale: sent, it would start a second chain of
    attempts, each with its own dead letter), and the second is claimed."""
    jobs = ProcessedJobs(redis_client, namespace)
    jobs.mark_tried_many([("acme", "s1", 2)])
    stale = Claim("acme", idempotency_key(["s1", "s2"]), ("s2", "s1"), "w", "/emails/batch", b"b", "", {"s1": 2})
    live = Claim("acme", idempotency_key(["s1"]), ("s1",), "w", "/emails", b"a", "", {"s1": 3})

    assert jobs.claim_many([stale]) == [[1]]
    assert jobs.status("acme", ["s1", "s2"]) == ["tried:2", None]
    assert jobs.claim_many([live]) == [[]]
