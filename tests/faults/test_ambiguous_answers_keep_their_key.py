"""An answer after which the provider may have accepted the request (a 502 from its gateway) is an
unknown outcome: the same body goes again under the same idempotency key, so the provider answers
from its store; the claims are never released and re-batched under a new key (which would send
the blast twice)."""

import subprocess
import sys

from streams.outcomes import events_of
from tests.harness import (
    committed_lag,
    count_records,
    email_request,
    read_committed,
    report_outcome,
    retry_policies,
    wait_until,
)

BLAST = 300
POLICIES = retry_policies(("otp", "transactional", "marketing", "webhook"), 4, "10m")


def test_a_502_after_acceptance_is_retried_under_the_same_key_and_delivers_once(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names, tmp_path):
    """Given a 300-email marketing blast in batches of 100 and a provider whose gateway answers 502 to every
    new request after accepting it,
    When the worker and the retrier work through the blast (retrying after 10 s),
    Then every request is sent again byte for byte under its own key and answered from the provider's store
    (3 idempotent replays for 3 batches), no send is delivered twice, and the lane is committed."""
    ids = _blast_answered_502(fault_runtime, fault_topics, fault_processes, mock_provider, tmp_path)

    wait_until(lambda: mock_provider.stats()["idempotent_replays"] >= BLAST // 100, 60,
               "each batch to be sent again under its key", interval=0.5)
    stats = _settled_each_once("502 after acceptance", ids, fault_stack, fault_processes, mock_provider, names)
    assert stats["faults_502_after_accept"] == BLAST // 100
    assert stats["idempotent_replays"] == BLAST // 100 and stats["idempotency_conflicts"] == 0


def test_a_resend_refused_before_the_provider_reads_its_key_keeps_the_sends_on_that_key(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names, tmp_path):
    """Given a 300-email marketing blast whose three batches the provider accepted but answered 502,
    When each batch is sent again under its key and the provider refuses those re-sends before it reads
    the key (401: its checks come before its idempotency store, as a 429's do), and then recovers,
    Then the sends stay claimed under their first keys (never freed and re-batched under new ones): the
    re-sends are answered from the provider's store, no email is delivered twice, and the lane is
    committed."""
    fault_processes.env["PROVIDER_AUTH_HOLD_S"] = "2"
    ids = _blast_answered_502(fault_runtime, fault_topics, fault_processes, mock_provider, tmp_path)

    wait_until(lambda: mock_provider.stats()["faults_502_after_accept"] == BLAST // 100, 60,
               "every batch to be accepted and answered 502", interval=0.2)
    mock_provider.configure(fault_502_after_accept_ratio=0.0, fault_401_ratio=1.0)  # before the 10 s retry
    wait_until(lambda: mock_provider.stats()["faults_401"] >= BLAST // 100, 60,
               "the re-sends to be refused", interval=0.2)
    mock_provider.configure(fault_401_ratio=0.0)
    wait_until(lambda: mock_provider.stats()["idempotent_replays"] >= BLAST // 100, 60,
               "each batch to be answered from the provider's store", interval=0.5)
    stats = _settled_each_once("re-send refused after a 502", ids, fault_stack, fault_processes, mock_provider, names)
    assert stats["idempotency_conflicts"] == 0


def _settled_each_once(scenario: str, ids: list[str], fault_stack, fault_processes, mock_provider, names) -> dict:
    """The mock provider's stats once the lane is committed, every send delivered and none twice."""
    wait_until(lambda: committed_lag(fault_stack.bootstrap, names.group("email", "marketing"),
                                     names.lane("email", "marketing")) == 0, 60, "the blast to be settled",
               interval=0.5)
    stats = mock_provider.stats(deliveries=True)
    report_outcome(scenario, ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"])
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    return stats


def _blast_answered_502(fault_runtime, fault_topics, fault_processes, mock_provider, tmp_path) -> list[str]:
    """A marketing blast of BLAST emails (batches of 100, retried after 10 s) to a provider whose gateway
    answers 502 to every new request after accepting it; the lane's worker, retrier and lag monitor run."""
    policies = tmp_path / "policies.toml"
    policies.write_text(POLICIES)
    fault_processes.env["DUAL_RAIL_RETRY_POLICIES"] = str(policies)
    fault_topics("email", lane_partitions=1)
    mock_provider.reset(rate=100, fault_502_after_accept_ratio=1.0)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 1000, 100)
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    fault_processes.worker("email", "marketing")
    fault_processes.retrier("email", "marketing")
    return fault_runtime.send_client().publish_batch("blaster", [email_request("marketing")] * BLAST)


def test_batches_kept_for_a_resend_are_left_to_reconciliation_when_redis_loses_their_bodies(
        fault_stack, fault_env, fault_runtime, fault_topics, fault_processes, mock_provider, names, tmp_path):
    """Given a 300-email marketing blast whose three batches the provider accepted (delivered) but answered 502,
    each kept claimed to be re-sent byte for byte under its key,
    When Redis loses its data (the kept bodies with it) before the retries are due, and an operator runs
    `streams state recover`,
    Then no email is delivered a second time: the outcome events said each send was kept by a batch request, so
    recovery marks them `reconcile` and each retry copy is dead-lettered `unknown_outcome` for an operator to check
    (before: recovery left them free, and the retries went out as new batches under new keys, 300 duplicates)."""
    ids = _blast_answered_502(fault_runtime, fault_topics, fault_processes, mock_provider, tmp_path)
    wait_until(lambda: sum(1 for record in read_committed(fault_stack.bootstrap, names.outcomes)
                           for event in events_of(record) if event.get("kept")) == BLAST, 60,
               "every send's outcome event to say its batch is kept", interval=0.5)
    mock_provider.configure(fault_502_after_accept_ratio=0.0)

    fault_stack.lose_redis_data()
    out = subprocess.run([sys.executable, "-m", "streams.cli", "state", "recover"], env=fault_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    wait_until(lambda: count_records(fault_stack.bootstrap, names.dlq) == BLAST, 90,
               "every retry copy to be dead-lettered", interval=1.0)
    _settled_each_once("kept batches, Redis data lost", ids, fault_stack, fault_processes, mock_provider, names)
    reasons = {event["reason"] for record in read_committed(fault_stack.bootstrap, names.outcomes)
               for event in events_of(record) if event["status"] == "dead_lettered"}
    assert reasons == {"unknown_outcome"}
