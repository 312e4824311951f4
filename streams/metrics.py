"""Every Prometheus metric the project exports, defined once. Durations are in seconds."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# A send may reach its provider hours late (a marketing lane yielding, retry tiers up to 12 h) and as late as
# its max age (2 days): past the last bucket, a percentile would read as that bucket.
_END_TO_END = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 12 * 3600,
               2 * 86_400)

SENDS = Counter("dispatch_sends_total", "Sends reaching a terminal or retry outcome",
                ["channel", "lane", "outcome"])
PROVIDER_REQUESTS = Counter("dispatch_provider_requests_total", "Provider HTTP requests by result",
                            ["provider", "outcome"])
PROVIDER_LATENCY = Histogram("dispatch_provider_request_seconds", "Provider request latency",
                             ["provider"], buckets=_LATENCY)
TOKEN_REFRESHES = Counter("dispatch_provider_token_refreshes_total", "Tokens fetched from a provider's token "
                          "endpoint", ["provider"])
PROVIDER_AUTH_FAILURES = Counter("dispatch_provider_auth_failures_total", "Requests a provider refused as "
                                 "unauthenticated even with a fresh token or key (a 401 after the one refresh)",
                                 ["provider"])
REBALANCES = Counter("dispatch_worker_rebalances_total", "Partitions a worker was assigned, had revoked or lost in "
                     "rebalances (cooperative: only the moving partitions)", ["channel", "lane", "kind"])
PACING = Gauge("dispatch_provider_pacing", "A provider's pacing as this worker applies it: concurrency (requests "
               "in flight: the operator's pacing or providers.toml's, at most the worker's own --concurrency) and "
               "pause_ms (between waves)", ["provider", "setting"])
FALLBACKS = Counter("dispatch_provider_fallbacks_total", "Sends handed to the channel's next provider, by the "
                    "provider that rejected them and why", ["channel", "from_provider", "to_provider", "reason"])
PROVIDER_429 = Counter("dispatch_provider_429_total", "Provider 429 answers by kind", ["provider", "kind"])
END_TO_END = Histogram("dispatch_end_to_end_seconds", "Accepted at ingest -> accepted by the provider",
                       ["channel", "lane"], buckets=_END_TO_END)
COOL_DOWN_UNTIL = Gauge("dispatch_provider_cool_down_until_timestamp_seconds", "Unix time at which the "
                        "provider-wide cool-down (a 429's Retry-After, which holds every worker) ends, as this "
                        "process last learned it (from a 429 it got, or the gate); 0 once the gate admits again",
                        ["provider"])
GATE_DENIALS = Counter("dispatch_gate_denials_total", "Gate denials by the bucket that was short",
                       ["provider", "lane", "bucket"])
GATE_WAIT = Histogram("dispatch_gate_wait_seconds", "Waits the gate asked for", ["provider", "lane"],
                      buckets=_LATENCY)
RETRIES = Counter("dispatch_retries_total", "Sends handed to a retry tier", ["channel", "lane", "tier"])
RETRIES_REPUBLISHED = Counter("dispatch_retries_republished_total",
                              "Retry messages re-published to their lane when due", ["channel", "lane", "tier"])
DLQ = Counter("dispatch_dead_letters_total", "Sends dead-lettered by reason", ["channel", "lane", "reason"])
DUPLICATES = Counter("dispatch_duplicates_skipped_total", "Jobs skipped because their send was delivered",
                     ["channel", "lane"])
STALE_COPIES = Counter("dispatch_stale_copies_skipped_total", "Copies of a send met for an attempt already made "
                       "and failed (a message read again after a crash or a rebalance): skipped, so a send never "
                       "runs two retry chains", ["channel", "lane"])
BUFFERED = Gauge("dispatch_worker_buffered_messages", "Messages held in a worker's tenant queues",
                 ["channel", "lane"])
LANE_LAG_MESSAGES = Gauge("dispatch_lane_lag_messages", "Messages not yet committed by the lane's group",
                          ["channel", "lane"])
LANE_LAG_SECONDS = Gauge("dispatch_lane_lag_seconds", "Age of the oldest unconsumed message in the lane",
                         ["channel", "lane"])
LAG_MONITOR_LAST_PUBLISH = Gauge("dispatch_lag_monitor_last_publish_timestamp_seconds",
                                 "Unix time at which the lag monitor took its last acknowledged reading of the "
                                 "channel's transactional lag", ["channel"])
LAG_READING_AGE = Gauge("dispatch_lag_reading_age_seconds", "Age of the lag reading a marketing worker acts on",
                        ["channel"])
LAG_READING_STALE = Gauge("dispatch_lag_reading_stale", "1 while the monitor's readings are stale (older than "
                          "YIELD_STALE_AFTER_S): the worker goes by its own reads of the lag", ["channel"])
PAUSED_PARTITIONS = Gauge("dispatch_worker_paused_partitions", "Assigned partitions a worker holds paused",
                          ["channel", "lane"])
ASSIGNED_PARTITIONS = Gauge("dispatch_worker_assigned_partitions", "Partitions assigned to a worker",
                            ["channel", "lane"])
INGESTED = Counter("dispatch_ingest_sends_total", "Sends accepted by the ingest API", ["channel", "lane"])
INGEST_ACCEPTED_REQUESTS = Counter("dispatch_ingest_accepted_requests_total", "Requests whose sends the ingest API "
                                   "published (a batch counts once), to compare with the requests it refused")
INGEST_TRANSACTION_SECONDS = Histogram("dispatch_ingest_transaction_seconds", "Time to publish a multi-record "
                                       "request in one producer transaction", buckets=_LATENCY)
INGEST_IN_FLIGHT = Gauge("dispatch_ingest_in_flight_requests", "Ingest requests being published right now")
INGEST_REJECTED = Counter("dispatch_ingest_rejected_total", "Ingest requests refused, by HTTP status", ["status"])
INGEST_BULK_RESTARTS = Counter("dispatch_ingest_bulk_process_restarts_total", "Times the ingest API started its "
                               "bulk process again after it exited")
OUTCOMES_RECORDED = Counter("dispatch_outcomes_recorded_total", "Outcome events applied to the status store",
                            ["status"])
OUTCOMES_SKIPPED = Counter("dispatch_outcomes_skipped_total", "Outcome records or events the outcome recorder (or "
                           "state recover) could not use (not JSON, a field of the wrong type) and skipped")
PAUSED = Gauge("dispatch_lane_paused", "1 while a worker keeps its partitions paused", ["channel", "lane", "reason"])

PRODUCE_RETRIES = Counter("dispatch_produce_retries_total", "Records produced again after the broker did not "
                          "acknowledge them", ["writer"])
PRODUCE_PENDING = Gauge("dispatch_produce_pending_records", "Records a writer holds until the broker acknowledges "
                        "them", ["writer"])
PRODUCE_FAILING = Gauge("dispatch_produce_failing_seconds", "How long ago the oldest record a writer still "
                        "produces again first failed (the broker did not acknowledge it; 0: none)", ["writer"])
DEPENDENCY_DOWN = Gauge("dispatch_dependency_down", "1 while a role holds its work because a dependency fails",
                        ["role", "dependency"])
ROLE_RUNNING = Gauge("dispatch_role_running", "1 while this process runs the role (worker.email.transactional, "
                     "retrier.sms.marketing, lag-monitor, api, api-bulk, outcome-recorder, endpoint-health); "
                     "a role whose every copy stopped answering scrapes raises DispatchRoleGone", ["role"])
REDIS_STATE_LOST = Gauge("dispatch_redis_state_lost", "1 while Redis has lost its data and dispatch holds until "
                         "an operator recovers it (`streams state recover`)")
RETRY_HELD = Gauge("dispatch_retry_held_messages", "Retry messages a retrier holds until their due time, and those it "
                   "released that the lane has not acknowledged yet",
                   ["channel", "lane", "tier"])
RETRY_OVERDUE = Gauge("dispatch_retry_overdue_seconds", "How long past its due time the most overdue held retry "
                      "message is, counted from when this retrier read it if it was due before (a working retrier "
                      "keeps this near 0)", ["channel", "lane", "tier"])
SPILLED = Counter("dispatch_spilled_total", "Messages of a tenant over its share of a worker's buffer, parked on a "
                  "retry tier until their turn (not an attempt)", ["channel", "lane"])
BACKPRESSURE_PAUSES = Counter("dispatch_backpressure_pauses_total", "Times a worker paused every partition because "
                              "its buffer was full", ["channel", "lane"])
RETRY_TIER_WAITING = Gauge("dispatch_retry_tier_waiting_messages", "Retry messages not yet released, as the lag "
                           "monitor measures them", ["channel", "lane", "tier"])
RETRY_TIER_OVERDUE = Gauge("dispatch_retry_tier_overdue_seconds", "How far past its due time the lowest unreleased "
                           "retry message of a partition is (the most overdue of the tier's partitions), as the lag "
                           "monitor measures it", ["channel", "lane", "tier"])
RETRY_TIER_UNREADABLE = Gauge("dispatch_retry_tier_unreadable_seconds", "How long the lag monitor has been unable "
                              "to read a retry tier (its overdue and waiting figures are then not exported; 0: read)",
                              ["channel", "lane", "tier"])
# Labelled by the app's group so that only the lag monitor, which sets it, exports it: unlabelled, every process
# importing this module exported 0, and the alert's `min` over them could never exceed its threshold.
ENDPOINT_HEALTH_BEHIND = Gauge("dispatch_endpoint_health_behind_seconds", "Age of the oldest webhook attempt the "
                               "endpoint-health app has not applied, as the lag monitor measures it (0: none waits; "
                               "NaN: its group could not be read)", ["group"])
OUTCOME_RECORDER_BEHIND = Gauge("dispatch_outcome_recorder_behind_seconds", "Age of the oldest outcome "
                                "(notif.outcomes) the outcome recorder has not applied to the sends' statuses, as "
                                "the lag monitor measures it (0: none waits; NaN: its group could not be read)",
                                ["group"])
FOLLOWER_UNREADABLE = Gauge("dispatch_follower_unreadable_seconds", "How long the lag monitor has been unable to "
                            "read a follower's progress (the endpoint-health app's, the outcome recorder's: its "
                            "behind figure is NaN meanwhile; 0: read)", ["group"])
STATE_RECORDS_UNREADABLE = Counter("dispatch_state_records_unreadable_total", "Records of the operator log, the "
                                   "audit log or notif.endpoint.state a reader could not read and skipped (the key "
                                   "keeps what it held), by topic", ["topic"])
AUDIT_RECORDS_UNCONFIRMED = Counter("dispatch_audit_records_unconfirmed_total", "Operator changes applied through "
                                    "the API whose audit record the broker did not confirm (missing from the trail, "
                                    "or written unconfirmed), by kind (limits, apikey, replay, endpoint, senders, "
                                    "cooldown)", ["kind"])
# ---- webhook endpoint health (the endpoint-health app, except skipped deliveries)
ENDPOINTS_BY_STATE = Gauge("webhook_endpoints", "Webhook endpoints by state, as this endpoint-health copy sees "
                           "the whole fleet (every copy reports all endpoints: aggregate with max)", ["state"])
CONSECUTIVE_FAILURES = Histogram("webhook_endpoint_consecutive_failures", "An endpoint's consecutive failed "
                                 "attempts, observed at each failed attempt",
                                 buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 50))
DEGRADATIONS = Counter("webhook_endpoint_degradations_total", "Endpoints that became degraded (10 consecutive "
                       "failures)")
HEALTH_ALERTS = Counter("webhook_endpoint_alerts_total", "Endpoint alert emails by kind (dropped, gone, stopped) and "
                        "result (sent; suppressed by the 24 h window; no_members; over_budget: the tenant's alerts of "
                        "that kind an hour)", ["kind", "result"])
HEALTH_EVENTS = Counter("webhook_endpoint_health_events_total", "Attempt events the endpoint-health app applied, "
                        "by kind (attempt, reactivated, replayed: already applied before a restart, malformed, "
                        "deleted: a deleted endpoint's row removed, of_deleted: an attempt of a deleted endpoint "
                        "ignored)",
                        ["kind"])
HEALTH_REREADS = Counter("webhook_endpoint_health_rereads_total", "Times the endpoint-health app read a partition "
                         "again after faust dropped records it had fetched (in a rebalance): an attempts partition "
                         "from its committed offset (no progress past it at two checks while the agent was idle), "
                         "or a changelog partition whose recovery applied nothing at two checks though all was "
                         "fetched; a record read twice changes nothing", ["topic"])
SECRETS_UNREADABLE = Counter("webhook_secret_unreadable_total", "Webhook attempts not sent: the endpoint's signing "
                             "secret is sealed under a key WEBHOOK_SECRET_KEYS does not list (or was altered)")
WEBHOOK_EGRESS_UNAVAILABLE = Counter("webhook_egress_unavailable_total", "Webhook attempts that could not reach their "
                                     "receiver while receivers of several tenants could not be reached and none "
                                     "answered: our way out (name servers, egress proxy, network) taken for down, the "
                                     "attempt not counted against its endpoint")
SKIPPED_DELIVERIES = Counter("webhook_deliveries_skipped_total", "Webhook deliveries never attempted, by reason "
                             "(endpoint_degraded, backlog_shed, endpoint_disabled, endpoint_deleted) and where "
                             "(ingest, worker)", ["reason", "where"])


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serve /metrics on `port` (0: not at all) at `addr` (METRICS_ADDR, default loopback)."""
    if port:
        start_http_server(port, addr=addr)


def announce(role: str) -> None:
    """Say on /metrics which role this process runs (dispatch_role_running), so that a role with no copy left
    is seen as gone rather than as quiet."""
    ROLE_RUNNING.labels(role).set(1)
