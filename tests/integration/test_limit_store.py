"""Rate limits are operator state: the operator log (real Kafka) first, then Redis (real), written
compare-and-set. These tests interleave two operators' changes of one provider, and follow a rate below
one a second from the operator to the gate, a worker and a rebuild of Redis."""

import itertools

import pytest

from streams.errors import ConfigError
from streams.gate.gate import RedisGate
from streams.gate.limits import LimitChange, LimitStore, parse_rate
from streams.gate.token_bucket import Limit
from streams.names import RedisKeys
from streams.state.guard import restore
from streams.state.log import OperatorLog
from tests.harness import HookedLog, email_request, wait_until


def logged(stack, topic, provider):
    return OperatorLog(stack.bootstrap, topic).snapshot().get(f"limits/{provider}")


def test_a_change_checked_against_limits_another_operator_changed_meanwhile_is_checked_again(
        stack, redis_client, namespace, oplog_topic):
    """Given resend's global burst of 100, and operator A setting a reserve of 90 (valid against 100),
    When operator B lowers the burst to 50 between A's log record and A's Redis write,
    Then A's change is checked again against burst 50 and refused (a reserve must stay below the burst); Redis
    keeps B's burst and no reserve, and so does the operator log's last word (before, A wrote the burst it had
    read, 100, with its reserve: B's change was undone without a word, and the log ended with B's view)."""
    b = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    b.set_provider("resend", 10, 100)
    a = LimitStore(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic,
                                                      lambda *_: b.apply("resend", LimitChange(global_burst=50))))
    with pytest.raises(ConfigError, match="reserve must be between 0 and burst-1"):
        a.apply("resend", LimitChange(reserve=90))
    held = b.show("resend")
    assert (held["global_burst"], held["reserve"]) == (50, 0)
    assert logged(stack, oplog_topic, "resend") == held


def test_two_operators_setting_two_tenants_at_once_both_stay_in_force_and_in_the_log(
        stack, redis_client, namespace, oplog_topic):
    """Given resend's limits, and operator A setting acme's limit,
    When operator B sets globex's limit between A's log record and A's Redis write,
    Then Redis holds both, and so does the operator log's last word (before, A's record, written from what it
    had read, lacked globex's limit and was the log's last word: a Redis rebuild from it lost globex's limit)."""
    b = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    b.set_provider("resend", 10, 100)
    a = LimitStore(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic,
                                                      lambda *_: b.set_tenant("resend", "globex", 2, 4)))
    a.set_tenant("resend", "acme", 5, 10)
    held = b.show("resend")
    assert (held["tenant_rate:acme"], held["tenant_rate:globex"]) == (5, 2)
    assert logged(stack, oplog_topic, "resend") == held


class CountingLog(OperatorLog):
    def __init__(self, bootstrap, topic):
        super().__init__(bootstrap, topic)
        self.puts: list[tuple[str, object]] = []

    def put(self, key, value) -> None:
        super().put(key, value)
        self.puts.append((key, value))


def test_a_change_logs_one_record_and_a_redis_that_lost_its_data_deletes_none(
        stack, redis_client, namespace, oplog_topic):
    """Given resend's limits,
    When an operator sets acme's limit with nobody else changing them, and then Redis loses the limits (flushed)
    just before another change is read back,
    Then the first change wrote one operator-log record (before: two, the same twice), and the second change
    never logs "no limits" (a rebuild of Redis from the log restores the limits, rather than none)."""
    oplog = CountingLog(stack.bootstrap, oplog_topic)
    store = LimitStore(redis_client, namespace, oplog)
    store.set_provider("resend", 10, 100)
    oplog.puts.clear()
    store.set_tenant("resend", "acme", 5, 10)
    assert [k for k, _ in oplog.puts] == ["limits/resend"]

    lost = LimitStore(redis_client, namespace, oplog)
    lost._write = lambda provider, *_: redis_client.delete(lost.keys.limits(provider)) and True
    lost.set_tenant("resend", "globex", 2, 4)
    assert logged(stack, oplog_topic, "resend")["tenant_rate:globex"] == 2  # its own record, not a deletion


def test_a_limit_changed_with_the_cli_after_redis_lost_its_data_keeps_the_providers_other_limits(
        stack, redis_client, namespace, names, oplog_topic, create_topics, dispatch_env):
    """Given resend's global limit and acme's tenant limit set through the operator tools, and then Redis losing its
    data with every role stopped (no state guard has looked yet),
    When an operator raises resend's global limit with `streams limits set`,
    Then acme's limit is still there, in Redis and in the operator log (before: the change was merged with the
    nothing Redis held and logged alone, and acme's limit was gone for good, from the log too)."""
    import subprocess
    import sys

    from streams.state.guard import StateGuard

    create_topics({names.audit: 1})  # where the CLI records its change
    keys, oplog = RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic)
    assert StateGuard(redis_client, keys, oplog, "api").check()  # a deployment: the epoch written
    limits = LimitStore(redis_client, namespace, oplog)
    limits.set_provider("resend", 10, 10)
    limits.set_tenant("resend", "acme", 5, 5)
    lost = list(redis_client.scan_iter(f"{namespace}*"))
    assert redis_client.delete(*lost) == len(lost)

    cli = subprocess.run([sys.executable, "-m", "streams.cli", "limits", "set", "--provider", "resend",
                          "--global-rate", "20", "--global-burst", "20"], env=dispatch_env, capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    shown = limits.show("resend")
    assert (shown["global_rate"], shown["tenant_rate:acme"]) == (20, 5)
    assert logged(stack, oplog_topic, "resend")["tenant_rate:acme"] == 5


def test_a_tenants_own_limit_removed_with_the_cli_holds_it_to_the_default_again(
        stack, redis_client, namespace, names, oplog_topic, create_topics, dispatch_env):
    """Given resend's default tenant limit (2/s, burst 5) and acme's own (1/s, burst 1), set through the operator log,
    When an operator runs `streams limits unset --tenant acme`, then again, then asks to unset '*' and to unset with
    a rate,
    Then acme's own limit is gone from Redis and from the operator log's last record (the gate reads the default for
    acme; before: no way to remove an override short of editing Redis by hand); the second unset changes nothing and
    succeeds; the last two are refused naming why, nothing changed."""
    import subprocess
    import sys

    create_topics({names.audit: 1})  # where the CLI records its change
    limits = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    limits.set_provider("resend", 10, 10)
    limits.set_tenant("resend", "*", 2, 5)
    limits.set_tenant("resend", "acme", 1, 1)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streams.cli", "limits", *args, "--provider", "resend"],
                              env=dispatch_env, capture_output=True, text=True, timeout=60)

    for again in (False, True):
        done = cli("unset", "--tenant", "acme")
        assert done.returncode == 0, done.stderr
        assert "tenant_rate:acme" not in done.stdout and "tenant_rate:* = 2" in done.stdout, done.stdout
        # Asked again (or for a tenant id mistyped): said, not a silent success
        assert ("nothing changed (tenant acme has no limit of its own)" in done.stderr) is again, done.stderr
    assert "tenant_rate:acme" not in limits.show("resend")
    assert RedisGate(redis_client, namespace).tenant_limit("resend", "acme") == Limit(2, 5)
    # Both of a tenant's fields edited by hand into no number: removing them is a change, said as one
    limits.set_tenant("resend", "shop", 1, 1)
    redis_client.hset(RedisKeys(namespace).limits("resend"), mapping={"tenant_rate:shop": "x", "tenant_burst:shop": "y"})
    done = cli("unset", "--tenant", "shop")
    assert done.returncode == 0 and "nothing changed" not in done.stderr, done.stderr
    assert "tenant_rate:shop" not in limits.show("resend")
    assert "tenant_rate:acme" not in logged(stack, oplog_topic, "resend")
    assert logged(stack, oplog_topic, "resend")["tenant_rate:*"] == 2
    refused = cli("unset", "--tenant", "*")
    assert refused.returncode != 0 and "the default limit ('*') can be changed, not removed" in refused.stderr
    refused = cli("unset", "--tenant", "globex", "--rate", "3")
    assert refused.returncode != 0 and "takes --provider and --tenant only, not --rate" in refused.stderr
    assert limits.show("resend")["tenant_rate:*"] == 2
    # An ingest quota without a default: removing a tenant's own would leave it unlimited there. Refused.
    limits.apply("ingest-marketing", LimitChange(global_rate=1000, global_burst=1000, tenant="acme", tenant_rate=1,
                                                 tenant_burst=1))
    with pytest.raises(ConfigError, match=r"tenant 'acme' would have no limit: there is no default \('\*'\)"):
        limits.apply("ingest-marketing", LimitChange(unset_tenant="acme"))
    assert limits.show("ingest-marketing")["tenant_rate:acme"] == 1


def test_a_tenant_ingest_quota_without_its_global_limit_is_refused_not_left_unenforced(redis_client, namespace):
    """Given no limits for the ingest-transactional quota,
    When an operator sets the default tenant quota alone, then the global limit and the tenant quota in one change,
    Then the first is refused saying the global limit is missing and nothing is written (before: accepted, and never
    enforced: ingest reads a quota whose bucket has no global limit as a quota nobody set); the second is taken."""
    store = LimitStore(redis_client, namespace)
    with pytest.raises(ConfigError, match="'ingest-transactional' has no global limit"):
        store.apply("ingest-transactional", LimitChange(tenant="*", tenant_rate=1, tenant_burst=1))
    assert store.show("ingest-transactional") == {}
    _, done, _ = store.apply("ingest-transactional", LimitChange(global_rate=10_000, global_burst=10_000, tenant="*",
                                                              tenant_rate=1, tenant_burst=1))
    assert (done["global_rate"], done["tenant_rate:*"]) == (10_000, 1)


def test_a_limit_for_a_name_no_tenant_can_have_is_refused(redis_client, namespace):
    """Given resend's limits,
    When an operator sets a limit for "bad tenant" (a space: no tenant id has one),
    Then it is refused saying why, and nothing is written (before: stored, and no send was ever held to it)."""
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 10, 10)
    with pytest.raises(ConfigError, match="'bad tenant' is not a tenant id"):
        store.set_tenant("resend", "bad tenant", 1, 1)
    assert "tenant_rate:bad tenant" not in store.show("resend")


def test_a_limit_edited_by_hand_into_no_number_is_refused_naming_it_and_holds_only_what_it_limits(
        stack, redis_client, namespace, oplog_topic):
    """Given resend's limits with a default tenant limit, and tenant `acme`'s own burst edited by hand to "ten",
    When a worker's gate reads acme's limit and globex's, and the provider's pacing,
    Then acme's is refused naming the provider, the field and the value (a ConfigError: the worker holds acme's queue
    as it holds a tenant without limits; before: a ValueError, which stopped the worker and every tenant of its
    lane); globex's default is read as before, and so is the pacing (another tenant's field is not read at all).
    A change that leaves the field as it is (the global rate) is refused naming it too; the one that sets acme's
    limit again mends it (in Redis and in the operator log), and acme's limit is read again; a reserve edited by hand
    is not set back to 0 by a change of the global limit (refused, naming it); a tenant named `corporate` keeps a
    whole burst."""
    store = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    store.set_provider("resend", 10, 10)
    store.set_tenant("resend", "*", 2, 5)
    store.set_tenant("resend", "acme", 1, 1)
    redis_client.hset(RedisKeys(namespace).limits("resend"), "tenant_burst:acme", "ten")
    gate = RedisGate(redis_client, namespace)
    with pytest.raises(ConfigError, match=r"the limits of provider 'resend': field 'tenant_burst:acme' holds b'ten', "
                                          r"not an integer"):
        gate.tenant_limit("resend", "acme")
    assert gate.tenant_limit("resend", "globex") == Limit(2, 5)
    assert gate.pacing("resend").concurrency is None
    with pytest.raises(ConfigError, match="field 'tenant_burst:acme'"):
        store.show("resend")
    with pytest.raises(ConfigError, match="field 'tenant_burst:acme'.*a change that sets it again mends it"):
        store.set_provider("resend", 20, 20)
    store.set_tenant("resend", "acme", 3, 3)
    assert gate.tenant_limit("resend", "acme") == Limit(3, 3)
    assert store.show("resend")["global_rate"] == 10
    assert logged(stack, oplog_topic, "resend")["tenant_burst:acme"] == 3
    redis_client.hset(RedisKeys(namespace).limits("resend"), "reserve", "two")
    with pytest.raises(ConfigError, match="field 'reserve' holds b'two'"):
        store.apply("resend", LimitChange(global_rate=20, global_burst=20))  # it wrote reserve 0 without a word
    store.apply("resend", LimitChange(global_rate=20, global_burst=20, reserve=2))
    assert (store.show("resend")["global_rate"], store.show("resend")["reserve"]) == (20, 2)
    redis_client.hset(RedisKeys(namespace).limits("resend"), "tenant_burst:corporate", "1.5")
    with pytest.raises(ConfigError, match="field 'tenant_burst:corporate' holds b'1.5', not an integer"):
        gate.tenant_limit("resend", "corporate")


def test_a_tenant_limited_to_30_a_minute_gets_one_send_every_two_seconds(redis_client, namespace):
    """Given resend's limits,
    When an operator limits acme to 30 a minute with a burst of 1 (before: refused, a rate had to be a whole number
    a second, so the slowest limit was 60 a minute),
    Then the limit reads back as 0.5 a second, and the gate (Lua, real Redis) admits one send, then tells the next to
    wait 2 s; a bucket emptied a second ago holds half a token, and its next send is due a second later."""
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 10, 10)
    store.apply("resend", LimitChange(tenant="acme", tenant_rate=parse_rate("30/min"), tenant_burst=1))
    assert store.show("resend")["tenant_rate:acme"] == 0.5
    gate = RedisGate(redis_client, namespace)
    assert gate.tenant_limit("resend", "acme") == Limit(0.5, 1)

    assert gate.acquire("resend", "acme", 1).allowed
    denied = gate.acquire("resend", "acme", 1)
    assert (denied.allowed, denied.short) == (False, "tenant")
    assert 1.5 <= denied.wait_s <= 2.0  # less by the time between the two calls (a loaded machine: up to 0.5 s)

    seconds, micros = redis_client.time()
    emptied_ms = seconds * 1000 + micros // 1000 - 1000
    redis_client.hset(RedisKeys(namespace).tenant_bucket("resend", "acme"), mapping={"mt": 0, "ts": emptied_ms})
    denied = gate.acquire("resend", "acme", 1)
    assert not denied.allowed and 0.5 <= denied.wait_s <= 1.0


def test_a_rate_below_one_a_second_comes_back_when_redis_is_rebuilt_from_the_operator_log(
        stack, redis_client, namespace, oplog_topic):
    """Given acme limited to 30 a minute (written to the operator log, then Redis),
    When Redis loses the limits and they are restored from the log's snapshot,
    Then acme's limit is 0.5 a second again (before: the restore skipped every limit that was not an integer, so
    acme fell back to the default limit, or to none)."""
    store = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    store.set_provider("resend", 10, 10)
    store.set_tenant("resend", "acme", parse_rate("30/min"), 1)
    keys = RedisKeys(namespace)
    redis_client.delete(keys.limits("resend"))

    restore(redis_client, keys, OperatorLog(stack.bootstrap, oplog_topic).snapshot())
    assert store.tenant("resend", "acme") == Limit(0.5, 1)


def test_a_worker_sends_a_tenant_limited_to_30_a_minute_one_email_every_two_seconds_and_others_at_once(
        channel_topics, limits, processes, send_client, mock_provider):
    """Given tenant slow limited to 30 emails a minute (burst 1) and every other tenant to 100 a second,
    When slow and fast each publish 3 marketing emails and one marketing worker runs,
    Then the provider receives slow's emails about 2 s apart (never less than 1.9 s: the gate's wait, read from a
    fractional rate) and fast's all within a second of the first, each email once."""
    channel_topics("email")
    mock_provider.reset(rate=100)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    limits.set_tenant("resend", "slow", parse_rate("30/min"), 1)
    slow = send_client.publish_batch("slow", [email_request("marketing")] * 3)
    fast = send_client.publish_batch("fast", [email_request("marketing")] * 3)

    processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["distinct_sends"] == 6, 60, "all 6 emails to be delivered")

    stats = mock_provider.stats(deliveries=True)
    assert stats["duplicate_deliveries"] == 0
    slow_at = sorted(t for i in slow for t in stats["deliveries"][i])
    fast_at = sorted(t for i in fast for t in stats["deliveries"][i])
    gaps = [b - a for a, b in itertools.pairwise(slow_at)]
    assert all(1.9 <= gap <= 4.0 for gap in gaps), gaps
    assert fast_at[-1] - fast_at[0] <= 1.0, fast_at


def test_a_rate_lowered_to_one_a_day_holds_the_bucket_that_long_and_a_stored_fraction_takes_changes(
        redis_client, namespace):
    """Given acme at 100 a second (burst 100) whose bucket the gate just emptied,
    When an operator lowers acme to one a day and acme asks again, then another change is made with the fraction
    stored,
    Then the denial waits a day and keeps the empty bucket for as long as it needs to refill at the new rate (before:
    it expired a minute after the last admission and came back full, 100 sends at once); the later change is taken
    (the compare-and-set reads the stored fraction as it was written)."""
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 1000, 1000)
    store.set_tenant("resend", "acme", 100, 100)
    gate = RedisGate(redis_client, namespace)
    assert gate.acquire("resend", "acme", 100).allowed
    store.set_tenant("resend", "acme", parse_rate("1/day"), 100)

    denied = gate.acquire("resend", "acme", 1)
    assert (denied.allowed, denied.short) == (False, "tenant") and 86_300 <= denied.wait_s <= 86_400
    assert redis_client.pttl(RedisKeys(namespace).tenant_bucket("resend", "acme")) >= 100 * 86_400_000

    store.set_tenant("resend", "globex", 1 / 3, 1)  # a fraction with no short decimal form
    held = store.show("resend")
    assert (held["tenant_rate:acme"], held["tenant_rate:globex"]) == (1 / 86_400, 1 / 3)


@pytest.mark.parametrize("change", ["own", "global"])
def test_a_bucket_left_idle_after_its_rate_was_lowered_lives_until_it_would_refill_at_the_new_rate(
        redis_client, namespace, change):
    """Given acme's and globex's buckets and the provider's global bucket just emptied at 10 a second, each set to
    expire when it would be full again at that rate (about 70 s),
    When an operator lowers acme's own rate, or the provider's global rate, to one a day, and nobody asks the gate
    anything afterwards,
    Then the bucket that change governs lives at least as long as a refill from empty takes at the new rate
    (before: it expired at its old time and came back full, a day's quota given back in a minute); the others
    keep their expiry."""
    keys = RedisKeys(namespace)
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 10, 100)
    store.set_tenant("resend", "acme", 10, 100)
    store.set_tenant("resend", "globex", 10, 100)
    gate = RedisGate(redis_client, namespace)
    assert gate.acquire("resend", "acme", 50).allowed and gate.acquire("resend", "globex", 50).allowed
    buckets = {"acme": keys.tenant_bucket("resend", "acme"), "globex": keys.tenant_bucket("resend", "globex"),
               "global": keys.global_bucket("resend")}
    assert all(redis_client.pttl(b) <= 71_000 for b in buckets.values())

    day = parse_rate("1/day")
    if change == "own":
        store.set_tenant("resend", "acme", day, 100)
    else:
        store.set_provider("resend", day, 100)
    stretched = {"own": "acme", "global": "global"}[change]
    for name, bucket in buckets.items():
        ttl = redis_client.pttl(bucket)
        assert (ttl >= 100 * 86_400_000) if name == stretched else (0 < ttl <= 71_000), (name, ttl)


def test_limits_stored_with_a_refill_of_millions_of_years_still_admit(redis_client, namespace):
    """Given limits written straight to Redis (as an older version could, or by hand) with a burst of 2 billion at one
    a day: a bucket expiry of 1.7e20 ms, which Redis reads as no integer,
    When acme asks the gate,
    Then it is admitted and its bucket expires (capped), where before the gate failed for the whole round (every
    tenant in it held) after debiting both buckets."""
    keys = RedisKeys(namespace)
    redis_client.hset(keys.limits("resend"), mapping={"global_rate": 1000, "global_burst": 1000, "reserve": 0,
                                                      "tenant_rate:acme": 1 / 86_400,
                                                      "tenant_burst:acme": 2_000_000_000})
    assert RedisGate(redis_client, namespace).acquire("resend", "acme", 1).allowed
    assert redis_client.pttl(keys.tenant_bucket("resend", "acme")) > 0


@pytest.mark.parametrize("field, value", [("tenant_rate:acme", "-1"), ("tenant_rate:acme", "0"),
                                          ("tenant_burst:acme", "0"), ("global_rate", "-0.5"),
                                          ("global_rate", "inf")])
def test_a_limit_edited_by_hand_to_zero_or_below_is_refused_not_taken_as_no_limit(redis_client, namespace, field,
                                                                                    value):
    """Given resend's limits, and one of them edited by hand (past `streams limits set`) to 0 or below,
    When a worker's gate reads acme's limit, and asks for a send of acme's,
    Then both are refused naming the limit (a ConfigError: the worker holds acme's queue), never admitted (before: a
    negative rate set a negative expiry on the bucket, deleted at each admission and found full at the next: acme
    unlimited; a rate of 0 answered a wait Redis cannot hold; a burst of 0 admitted every send for nothing)."""
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 10, 10)
    store.set_tenant("resend", "acme", 1, 1)
    redis_client.hset(RedisKeys(namespace).limits("resend"), field, value)
    gate = RedisGate(redis_client, namespace)
    if field != "global_rate":
        with pytest.raises(ConfigError, match=f"field '{field}' holds b'{value}', not "):
            gate.tenant_limit("resend", "acme")
    for _ in range(3):
        with pytest.raises(ConfigError, match="'resend'.*a rate not above 0 or a burst below 1"):
            gate.acquire("resend", "acme", 1)


def test_a_bucket_stamped_after_redis_clock_is_stamped_now_when_denied(redis_client, namespace):
    """Given acme's empty bucket stamped a minute after Redis's clock (the clock stepped back, or a failover to a
    server behind it),
    When a send of acme's is denied,
    Then the bucket keeps its tokens (none) and is stamped with Redis's time, so it refills from now (before: it kept
    the stamp to come and refilled nothing for that minute)."""
    store = LimitStore(redis_client, namespace)
    store.set_provider("resend", 10, 10)
    store.set_tenant("resend", "acme", 10, 1)
    bucket = RedisKeys(namespace).tenant_bucket("resend", "acme")
    seconds, micros = redis_client.time()
    before_ms = seconds * 1000 + micros // 1000
    redis_client.hset(bucket, mapping={"mt": 0, "ts": before_ms + 60_000})

    denied = RedisGate(redis_client, namespace).acquire("resend", "acme", 1)

    seconds, micros = redis_client.time()
    assert (denied.allowed, denied.short) == (False, "tenant") and denied.wait_s <= 0.1
    assert float(redis_client.hget(bucket, "mt")) == 0
    assert before_ms <= int(redis_client.hget(bucket, "ts")) <= seconds * 1000 + micros // 1000
