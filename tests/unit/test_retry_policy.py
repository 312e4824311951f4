"""The eval harness of seed 003 as a table: each provider answer -> decision, delay bounds, attempts.

Route and payload never change across retries: decisions carry only a tier and a due time; the
worker re-publishes the original message bytes (see tests/integration for that end to end)."""

from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

import pytest

from streams.errors import ConfigError
from streams.lanes import RETRY_TIERS
from streams.providers.outcome import ProviderResult
from streams.retry.policy import (
    SPREAD_ENDS_BEFORE_MAX_AGE_S,
    DeadLetter,
    Delivered,
    RetryAt,
    cool_down_s,
    decide,
    load_policies,
    load_routing,
    parse_policies,
    parse_retry_after,
    parse_routing,
    wait_in_process,
)

NOW = 1_800_000_000_000
POLICIES = load_policies()
OTP, MARKETING, WEBHOOK = POLICIES["otp"], POLICIES["marketing"], POLICIES["webhook"]


def http_date(seconds_from_now: int) -> str:
    return format_datetime(datetime.fromtimestamp(NOW / 1000 + seconds_from_now, tz=UTC), usegmt=True)


# (policy, attempt, answer, expected kind, tier, min delay s, max delay s)
CASES = [
    ("success", OTP, 1, ProviderResult("delivered", 200), Delivered, None, None, None),
    ("429 with seconds", OTP, 1, ProviderResult("throttled", 429, retry_after="30"), RetryAt, "1m", 48, 72),
    ("429 with an HTTP date", OTP, 1, ProviderResult("throttled", 429, retry_after=http_date(240)), RetryAt, "5m", 240, 360),
    ("429 malformed header", OTP, 1, ProviderResult("throttled", 429, retry_after="soon"), RetryAt, "10s", 8, 12),
    ("429 missing header", OTP, 2, ProviderResult("throttled", 429), RetryAt, "1m", 48, 72),
    ("429 asking for more than the longest tier", MARKETING, 1, ProviderResult("throttled", 429, retry_after="50000"), RetryAt, "12h", 50000, 51840),
    ("quota 429 is parked", MARKETING, 1, ProviderResult("quota", 429, retry_after="1"), RetryAt, "1h", 3600, 3780),
    # the quota resets in 10 h: parked until then, not asked again every hour (before: due in 1 h on the 1h tier),
    # and not until a tier's round figure (the 12h tier holds it: 9.6-14.4 h)
    ("quota 429 is parked as long as asked", MARKETING, 1, ProviderResult("quota", 429, retry_after="36000"), RetryAt,
     "12h", 36000, 36300),
    ("quota 429 just over an hour", MARKETING, 1, ProviderResult("quota", 429, retry_after="3601"), RetryAt,
     "3h", 3601, 3782),
    ("quota 429 for an OTP is too old to park", OTP, 1, ProviderResult("quota", 429), DeadLetter, None, None, None),
    ("timeout after possible acceptance", OTP, 1, ProviderResult("unknown"), RetryAt, "10s", 8, 12),
    ("permanent 4xx", OTP, 1, ProviderResult("rejected", 422), DeadLetter, None, None, None),
    ("5xx", MARKETING, 3, ProviderResult("unavailable", 503), RetryAt, "15m", 720, 1080),
    ("exhausted", OTP, 4, ProviderResult("unavailable", 503), DeadLetter, None, None, None),
]


@pytest.mark.parametrize("name, policy, attempt, result, kind, tier, lo, hi", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999])
def test_eval_harness(name, policy, attempt, result, kind, tier, lo, hi, jitter):
    d = decide(policy, attempt, created_ms=NOW - 1000, result=result, now_ms=NOW, jitter=jitter)
    assert isinstance(d, kind), d
    if kind is RetryAt:
        assert d.tier == tier
        assert lo * 1000 <= d.due_ms - NOW <= hi * 1000


def test_dead_letter_reasons():
    reasons = {decide(OTP, a, NOW, r, NOW, 0.5).reason for a, r in [
        (1, ProviderResult("rejected", 400)), (4, ProviderResult("unavailable")),
        (1, ProviderResult("quota", 429))]}
    assert reasons == {"permanent_error", "retries_exhausted", "quota_exceeded"}
    too_old = decide(OTP, 1, NOW - 595_000, ProviderResult("unavailable"), NOW, 0.5)
    assert too_old == DeadLetter("too_old")


@pytest.mark.parametrize("result", [ProviderResult("throttled", 429, retry_after="6"),
                                    ProviderResult("throttled", 429, retry_after="120"),
                                    ProviderResult("quota", 429)])
def test_a_429_at_the_last_attempt_is_not_the_end_of_the_send(result):
    """The provider never looked at it: a marketing send throttled at its last attempt waits again (before, it was
    dead-lettered `retries_exhausted`, which invites a replay of a send nothing had failed); its max age still
    ends it."""
    d = decide(MARKETING, MARKETING.max_attempts, NOW - 1000, result, NOW, 0.5)
    assert isinstance(d, RetryAt) and d.reason in ("rate_limited", "quota_exceeded")
    late = decide(MARKETING, MARKETING.max_attempts, NOW - MARKETING.max_age_s * 1000 + 1000, result, NOW, 0.5)
    assert isinstance(late, DeadLetter) and late.reason in ("too_old", "quota_exceeded")
    # It waits for what the provider asked (at least the shortest tier), not for the schedule's last tier: an OTP
    # 6 minutes old throttled at its last attempt for 6 s is tried again in about 10 s, not dead-lettered too_old.
    if result.retry_after == "6":
        otp = decide(OTP, OTP.max_attempts, NOW - 370_000, result, NOW, 0.5)
        assert isinstance(otp, RetryAt) and otp.tier == "10s" and 6_000 <= otp.due_ms - NOW <= 12_000
    # A webhook receiver's 429 is the tenant's server failing the delivery: it has its schedule of attempts.
    receiver = decide(WEBHOOK, WEBHOOK.max_attempts, NOW - 1000, result, NOW, 0.5, throttle_is_attempt=True)
    assert receiver == DeadLetter("retries_exhausted")


@pytest.mark.parametrize("throttled_first", [1, 3])
def test_a_send_throttled_by_the_provider_still_gets_every_attempt_for_real_failures(throttled_first):
    """A provider's 429 is no try: a send declined k times, then failing every time, gets max_attempts failures
    before `retries_exhausted` (before, k fewer), each spaced by its schedule's tier for the failures so far. The
    worker carries the count of declined attempts on the retry copy (the `declined` header)."""
    created = now = NOW
    attempt, declined, failures = 1, 0, []
    while True:
        result = (ProviderResult("throttled", 429, retry_after="120") if attempt <= throttled_first
                  else ProviderResult("unavailable", 503))
        decision = decide(MARKETING, attempt, created, result, now, 0.5, declined_before=declined)
        if result.outcome == "unavailable":
            failures.append(now)
        if not isinstance(decision, RetryAt):
            break
        assert decision.declined is (result.outcome == "throttled")
        if result.outcome == "unavailable":
            assert decision.tier == MARKETING.tier_after(len(failures))
        declined += decision.declined
        attempt, now = attempt + 1, decision.due_ms
    assert decision == DeadLetter("retries_exhausted")
    assert len(failures) == MARKETING.max_attempts and attempt == MARKETING.max_attempts + throttled_first


def test_a_provider_that_keeps_declining_is_asked_less_and_less_often():
    """Declined attempts are no tries, but the wait after a 429 still grows with every attempt made: a quota 429
    without a Retry-After parks a marketing send longer each time (not an hour each time for its whole max age)."""
    quota = ProviderResult("quota", 429)
    waits = [decide(MARKETING, attempt, NOW, quota, NOW, 0.5, declined_before=attempt - 1).due_ms - NOW
             for attempt in range(1, MARKETING.max_attempts)]
    assert waits == sorted(waits) and waits[-1] >= 4 * waits[0]


def test_unknown_outcome_without_provider_idempotency_goes_to_reconciliation():
    d = decide(OTP, 1, NOW, ProviderResult("unknown"), NOW, 0.5, provider_idempotent=False)
    assert d == DeadLetter("unknown_outcome")


@pytest.mark.parametrize("result, first_copy_unknown", [
    (ProviderResult("unknown"), False),                   # this attempt's answer was lost
    (ProviderResult("unavailable", 503), True),           # a re-send failed: the first copy's fate is unknown
    (ProviderResult("quota", 429), True),
])
def test_a_send_the_provider_may_hold_is_given_up_on_as_unknown_outcome(result, first_copy_unknown):
    """Given a send whose provider may hold a copy (the last answer unknown, or a re-send of a request whose
    first answer was lost),
    When it is given up on, its attempts used up or its max age reached,
    Then the dead letter says `unknown_outcome` (before: `retries_exhausted` / `too_old` / `quota_exceeded`,
    which the runbook says to replay after fixing the cause: a replay has a new send id, so the provider
    would deliver it a second time)."""
    exhausted = decide(OTP, OTP.max_attempts, NOW, result, NOW, 0.5, first_copy_unknown=first_copy_unknown)
    too_old = decide(OTP, 1, NOW - 595_000, result, NOW, 0.5, first_copy_unknown=first_copy_unknown)
    assert exhausted.reason == too_old.reason == "unknown_outcome"
    assert exhausted.declined == too_old.declined == (result.outcome == "quota")  # its letter counts a 429 declined
    assert decide(OTP, OTP.max_attempts, NOW, ProviderResult("unavailable", 503), NOW, 0.5) == \
        DeadLetter("retries_exhausted")


def test_a_refused_re_send_of_a_request_whose_first_answer_was_lost_is_unknown_outcome():
    """Given a request whose first answer was lost, re-sent under its key,
    When the re-send is refused for good (a 4xx: the provider's key store lost the record),
    Then the send is dead-lettered `unknown_outcome`, not `permanent_error`: the first copy may have been delivered,
    and a replay (a new send id) of a `permanent_error` dead letter goes without a warning. (A 410 stays
    `endpoint_gone`: it disables the endpoint, which the tenant's alert says.)"""
    result = ProviderResult("rejected", 422)
    assert decide(OTP, 2, NOW, result, NOW, 0.5, first_copy_unknown=True) == DeadLetter("unknown_outcome")
    assert decide(OTP, 2, NOW, result, NOW, 0.5) == DeadLetter("permanent_error")
    assert decide(OTP, 2, NOW, ProviderResult("gone", 410), NOW, 0.5, first_copy_unknown=True) == \
        DeadLetter("endpoint_gone")


def test_retry_after_parsing():
    assert parse_retry_after("120", NOW) == 120
    assert parse_retry_after(http_date(30), NOW) == pytest.approx(30)
    assert parse_retry_after(http_date(-30), NOW) == 0
    assert parse_retry_after("tomorrow", NOW) is None and parse_retry_after(None, NOW) is None


@pytest.mark.parametrize("header, wait", [
    ("\u00b2", None),             # a digit to str.isdigit(), not to float(): it raised ValueError
    ("\u0661\u0662", None),        # Arabic-Indic digits, likewise
    ("9" * 310, 86400.0),          # float() of it is inf: the due time overflowed (OverflowError)
    ("9" * 5000, 86400.0),         # past Python's 4,300-digit limit for int()
    ("3.5", None), ("-5", None), (" 12 ", 12.0),
    ("0000000030", 30.0),          # zero-padded: 30 s (it was read as too long a number: a day)
    (http_date(10 * 365 * 86400), 86400.0),
])
def test_no_retry_after_from_outside_can_raise_or_overflow(header, wait):
    """Given a Retry-After a provider or a tenant's receiver sends back (any text it likes),
    When the worker reads it to hold the provider off and to schedule the retry,
    Then nothing raises (before, one such header crashed the worker, and again on every restart), the wait is
    at most a day, and a header that is not a number or a date counts as absent."""
    assert parse_retry_after(header, NOW) == (pytest.approx(wait, abs=1) if wait else None)
    answer = ProviderResult("throttled", 429, retry_after=header)
    assert 0 < cool_down_s(answer, NOW) <= 86400
    decision = decide(WEBHOOK, 1, NOW, answer, NOW, 0.5)
    assert isinstance(decision, (RetryAt, DeadLetter))
    if isinstance(decision, RetryAt):
        assert decision.due_ms - NOW <= 86400 * 1000 * 1.2


@pytest.mark.parametrize("text, message", [
    ('[policy.x]\nmax_attempts = 0\nmax_age = "1h"\nschedule = ["10s"]', "field 'max_attempts' must be an integer >= 1"),
    ('[policy.x]\nmax_attempts = 2\nmax_age = "1 hour"\nschedule = ["10s"]', "field 'max_age' must look like"),
    ('[policy.x]\nmax_attempts = 2\nmax_age = "1h"\nschedule = ["2m"]', "unknown tier '2m'"),
    ('[policy.x]\nmax_attempts = 2\nmax_age = "1h"\nschedule = ["10s"]\nretries = 3', "unknown field(s) ['retries']"),
])
def test_invalid_policy_file_names_the_policy_and_field(text, message):
    with pytest.raises(ConfigError, match=r"policies.toml: policy 'x': .*" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        parse_policies(text, "policies.toml")


@pytest.mark.parametrize("result, cool, in_process", [
    (ProviderResult("throttled", 429, retry_after="2"), 2.0, True),
    (ProviderResult("throttled", 429, retry_after="soon"), 1.0, True),    # unusable header: default
    (ProviderResult("throttled", 429), 1.0, True),
    (ProviderResult("throttled", 429, retry_after="30"), 30.0, False),    # long: through a tier
    (ProviderResult("quota", 429, retry_after="2"), 2.0, False),          # quota: parked, never hot
    (ProviderResult("unavailable", 503), None, False),
    (ProviderResult("delivered", 200), None, False),
])
def test_cool_down_and_in_process_wait(result, cool, in_process):
    assert cool_down_s(result, NOW) == cool
    assert wait_in_process(result, NOW) is in_process


@pytest.mark.parametrize("policy", sorted(POLICIES.values(), key=lambda p: p.name), ids=lambda p: p.name)
@pytest.mark.parametrize("jitter", [0.0, 0.999])
def test_an_always_failing_send_gets_every_attempt_of_every_shipped_policy(policy, jitter):
    """Attempt times of a send that fails every time: exactly max_attempts attempts, each spaced by its
    tier's delay +-20%, and the last one ends `retries_exhausted`, never `too_old` first."""
    created = now = NOW
    times = [now]
    decision = decide(policy, 1, created, ProviderResult("unavailable", 503), now, jitter)
    while isinstance(decision, RetryAt):
        gap_s = (decision.due_ms - now) / 1000
        expected = RETRY_TIERS[policy.tier_after(len(times))]
        assert 0.8 * expected <= gap_s <= 1.2 * expected, (len(times), gap_s)
        now = decision.due_ms
        times.append(now)
        decision = decide(policy, len(times), created, ProviderResult("unavailable", 503), now, jitter)
    assert decision == DeadLetter("retries_exhausted")
    assert len(times) == policy.max_attempts
    assert (times[-1] - created) / 1000 <= policy.max_age_s


def test_a_policy_whose_max_age_cannot_cover_its_schedule_is_refused():
    text = '[policy.tight]\nmax_attempts = 9\nmax_age = "1d"\nschedule = ["10s", "1m", "5m", "15m", "1h", "3h", "6h", "12h"]'
    with pytest.raises(ConfigError, match=r"policy 'tight': field 'max_age' \(1d\) is shorter than the worst case"):
        parse_policies(text, "policies.toml")


@pytest.mark.parametrize("max_age", ["0s", "30s"])
def test_a_policy_whose_max_age_ends_sends_before_their_first_attempt_is_refused(max_age):
    """Given a policy of one attempt whose max age is under a minute (its schedule never used),
    When the policies are read,
    Then it is refused, saying so (before: "0s" passed, and every send of it was dead-lettered too_old unsent)."""
    text = f'[policy.hasty]\nmax_attempts = 1\nmax_age = "{max_age}"\nschedule = ["10s"]'
    with pytest.raises(ConfigError, match=rf"policy 'hasty': field 'max_age' \({max_age}\) must be at least '1m'"):
        parse_policies(text, "policies.toml")


def test_routing_gives_otp_templates_the_otp_policy():
    routing = load_routing()
    assert routing.policy_for("email", "transactional", "otp") == "otp"
    assert routing.policy_for("sms", "transactional", "password-reset") == "otp"
    assert routing.policy_for("email", "transactional", "receipt") == "transactional"
    assert routing.policy_for("email", "marketing", "spring-sale") == "marketing"
    assert routing.policy_for("webhook", "transactional", "otp") == "webhook"


def test_routing_to_an_unknown_policy_is_refused():
    text = ('[policy.a]\nmax_attempts = 1\nmax_age = "1m"\nschedule = ["10s"]\n'
            '[routing]\ncategories = { transactional = "a", product = "a", marketing = "b" }\n')
    with pytest.raises(ConfigError, match=r"\[routing\]: field 'categories.marketing': unknown policy 'b'"):
        parse_routing(text, "policies.toml", parse_policies(text, "policies.toml"))


def test_a_retry_copy_due_later_than_the_lanes_keep_payloads_is_held_for_the_longest_tier_not_for_ever():
    """A due time the retrier cannot use means now; one later than the lanes keep payloads (7 days: not
    written by a worker, e.g. 10^16 ms or a 400-digit number) is held for the longest tier (12 h), so its
    partition's committed offset is not pinned for ever and no float conversion overflows. A slow
    tenant's parked message due in 3 days keeps its due time."""
    from streams.retry.retrier import due_time

    now_ms = 1_800_000_000_000.0
    assert due_time({"due_at_ms": b"1800000010000"}, "t[0]@1", now_ms) == 1_800_000_010_000
    assert due_time({}, "t[0]@1", now_ms) == 0 and due_time({"due_at_ms": b"2x"}, "t[0]@1", now_ms) == 0
    for far in (b"10000000000000000", b"9" * 400):
        assert due_time({"due_at_ms": far}, "t[0]@1", now_ms) == now_ms + 12 * 3600 * 1000
    in_three_days = int(now_ms + 3 * 24 * 3600 * 1000)
    assert due_time({"due_at_ms": str(in_three_days).encode()}, "t[0]@1", now_ms) == in_three_days


def test_a_copy_due_too_far_ahead_read_again_later_keeps_the_due_time_of_its_first_read():
    """Given a copy due 30 days ahead (not written by a worker), written an hour before it is first read,
    When it is read again 6 h later (a retrier restarted, or its partition moved),
    Then it is due at the same moment, 12 h after it was written (before: 12 h after each read, so a retrier
    restarted or rebalanced more often than every 12 h never released it, its partition's offset stayed pinned,
    and retention deleted it after 7 days with no dead letter); a record timestamp ahead of the clock counts
    from now."""
    from streams.retry.retrier import due_time

    written_ms = 1_800_000_000_000.0
    far = str(int(written_ms + 30 * 24 * 3600 * 1000)).encode()
    first = due_time({"due_at_ms": far}, "t[0]@1", written_ms + 3_600_000, written_ms)
    again = due_time({"due_at_ms": far}, "t[0]@1", written_ms + 6 * 3_600_000, written_ms)
    assert first == again == written_ms + 12 * 3600 * 1000
    assert due_time({"due_at_ms": far}, "t[0]@1", written_ms, written_ms + 3_600_000) == written_ms + 12 * 3600 * 1000


@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999])
def test_a_quota_reset_within_the_max_age_is_never_pushed_past_it_by_the_spread(jitter):
    """A send 58 minutes into the transactional policy's 2 hours, answered a quota 429 resetting in an hour: due at
    the reset, within its max age, whatever the jitter (before: dead-lettered `quota_exceeded` at a high jitter)."""
    policy = POLICIES["transactional"]
    created = NOW - 58 * 60_000
    d = decide(policy, 1, created, ProviderResult("quota", 429, retry_after="3600"), NOW, jitter)
    assert isinstance(d, RetryAt) and NOW + 3_600_000 <= d.due_ms <= created + policy.max_age_s * 1000, d


@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999])
@pytest.mark.parametrize("policy, asked_s", [("otp", 301), ("transactional", 3700)])
def test_a_throttled_ask_that_fits_the_max_age_is_waited_though_its_tier_would_not(policy, asked_s, jitter):
    """A new send answered a throttled 429 asking for 301 s (an OTP: 10 min max age) or 3,700 s (transactional: 2 h),
    whose tier (the ask rounded up: 15 min, 3 h) would come past its max age: due after the ask, within the max
    age, whatever the jitter (before: dead-lettered `too_old` at once, though the provider's ask fitted)."""
    chosen = POLICIES[policy]
    d = decide(chosen, 1, NOW, ProviderResult("throttled", 429, retry_after=str(asked_s)), NOW, jitter)
    assert isinstance(d, RetryAt) and NOW + asked_s * 1000 <= d.due_ms <= NOW + chosen.max_age_s * 1000, d
    assert d.reason == "rate_limited"
    late = decide(chosen, 1, NOW, ProviderResult("throttled", 429, retry_after=str(chosen.max_age_s + 1)), NOW, jitter)
    assert late == DeadLetter("too_old", declined=True)  # the letter counts this attempt as declined


@pytest.mark.parametrize("policy, asked_s", [("otp", 580), ("transactional", 7_100)])
def test_a_throttled_ask_near_the_max_age_is_spread_no_closer_to_it_than_the_copys_release_takes(policy, asked_s):
    """A new send answered a throttled 429 asking for 580 s (an OTP: 10 min max age) or 7,100 s (transactional: 2 h),
    at the highest jitter: due after the ask and at least SPREAD_ENDS_BEFORE_MAX_AGE_S before the max age (before:
    due 20 ms before it, and the copy, read a moment after its due time, was dead-lettered `too_old`)."""
    chosen = POLICIES[policy]
    d = decide(chosen, 1, NOW, ProviderResult("throttled", 429, retry_after=str(asked_s)), NOW, 0.999)
    assert isinstance(d, RetryAt) and NOW + asked_s * 1000 <= d.due_ms, d
    assert d.due_ms <= NOW + (chosen.max_age_s - SPREAD_ENDS_BEFORE_MAX_AGE_S) * 1000, d


def test_a_5xx_that_asks_to_wait_is_retried_no_sooner_than_it_asked():
    """Given a provider in maintenance answering 503 with Retry-After 600 (an idempotent one: retried under the
    same key),
    When a transactional send's first attempt is settled,
    Then its next attempt is due no sooner than 10 minutes from now, on a tier at least that long (before: the
    ask was ignored, and the send spent its attempts on the 10s/1m/5m tiers against the provider in maintenance,
    then was dead-lettered `unknown_outcome`)."""
    d = decide(POLICIES["transactional"], 1, NOW, ProviderResult("unknown", 503, retry_after="600"), NOW, 0.0,
               provider_idempotent=True)
    assert isinstance(d, RetryAt) and d.due_ms >= NOW + 600_000 and d.tier in ("15m", "1h"), d
    assert d.reason == "unknown_outcome"
    # An ask past the send's max age (an OTP's 10 minutes) is advice the schedule does without: the maintenance may
    # end sooner, and the send is not given up at once
    otp = decide(POLICIES["otp"], 1, NOW, ProviderResult("unknown", 503, retry_after="3600"), NOW, 0.0,
                 provider_idempotent=True)
    assert isinstance(otp, RetryAt) and otp.due_ms < NOW + 600_000, otp


@pytest.mark.parametrize("outcome", ["unknown", "unavailable"])
@pytest.mark.parametrize("jitter", [0.0, 0.999])
@pytest.mark.parametrize("policy, asked_s", [("otp", 60), ("otp", 301), ("otp", 550), ("transactional", 3700)])
def test_a_5xx_ask_that_fits_the_max_age_is_waited_though_its_tier_would_not(policy, asked_s, jitter, outcome):
    """A new send answered a 503 (an unknown outcome at an idempotent provider, or one not acted on) asking for
    301 s (an OTP: 10 min max age), whose tier rounded up (15 min) would come past its max age: due after the ask,
    within the max age (before: dead-lettered at once, though the ask fitted)."""
    chosen = POLICIES[policy]
    d = decide(chosen, 1, NOW, ProviderResult(outcome, 503, retry_after=str(asked_s)), NOW, jitter,
               provider_idempotent=True)
    assert isinstance(d, RetryAt) and NOW + asked_s * 1000 <= d.due_ms <= NOW + chosen.max_age_s * 1000, d


def test_a_throttled_ask_that_fits_is_waited_though_the_schedules_next_tier_would_not():
    """An OTP at its third attempt, 5.5 minutes old (4.5 left), answered a throttled 429 asking for 30 s, whose
    schedule's next tier would come past its max age: due after the ask, within the max age (before: dead-lettered
    `too_old`)."""
    created = NOW - 330_000
    for jitter in (0.0, 0.5, 0.999):
        d = decide(OTP, 3, created, ProviderResult("throttled", 429, retry_after="30"), NOW, jitter)
        assert isinstance(d, RetryAt) and NOW + 30_000 <= d.due_ms <= created + OTP.max_age_s * 1000, d


@pytest.mark.parametrize("retry_after", [None, "0", "soon"])
def test_a_throttled_429_without_a_usable_ask_near_the_max_age_waits_the_default_cool_down(retry_after):
    """An OTP 9.5 minutes old (30 s left) answered a throttled 429 with no usable Retry-After: due a cool-down (1 s)
    from now at least, as the provider is held off (before: due at once, straight back at the busy provider); one
    with half a second left is `too_old`."""
    answer = ProviderResult("throttled", 429, retry_after=retry_after)
    for jitter in (0.0, 0.999):
        d = decide(OTP, 1, NOW - 570_000, answer, NOW, jitter)
        assert isinstance(d, RetryAt) and NOW + 1_000 <= d.due_ms <= NOW + 30_000, d
    assert decide(OTP, 1, NOW - 599_500, answer, NOW, 0.0) == DeadLetter("too_old", declined=True)


def test_a_policy_whose_max_age_outlives_the_retry_tiers_retention_is_refused_when_a_role_loads_it(tmp_path):
    """Given a policies file whose `marketing` policy may wait 14 days (the retry tiers keep a copy 7 days), and the
    packaged file,
    When a role loads its policies (the worker, the API),
    Then the first is refused naming the policy, its max age and the topic's retention (before: accepted, and a
    copy parked on a monthly quota's Retry-After was deleted by retention before its release: lost, no dead
    letter, its status `retrying` for good); the packaged policies load."""
    from streams.config import Config
    from streams.runtime import Runtime

    packaged = Path(__file__).resolve().parents[2] / "streams" / "retry" / "policies.toml"
    (tmp_path / "policies.toml").write_text(packaged.read_text().replace(
        'max_attempts = 8\nmax_age = "2d"', 'max_attempts = 8\nmax_age = "14d"'))
    env = {"KAFKA_BOOTSTRAP_SERVERS": "unused:9092", "REDIS_URL": "redis://unused:6379/0"}
    with pytest.raises(ConfigError, match=r"retry policy 'marketing': field 'max_age' \(336 h\) leaves less than "
                                          r"a day of notif\.\w+\.\w+\.retry\.\w+'s retention \(168 h\)"):
        Runtime(Config.from_env({**env, "DUAL_RAIL_RETRY_POLICIES": str(tmp_path / "policies.toml")})).policies()
    assert set(Runtime(Config.from_env(env)).policies()) >= {"otp", "transactional", "marketing", "webhook"}
