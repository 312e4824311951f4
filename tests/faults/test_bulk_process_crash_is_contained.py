"""The ingest API's bulk process (batches, at a lower CPU priority) dies: single sends never notice,
batches are refused until it is back, nothing is half published, and the transaction it left open
does not hold back the lanes' read-committed consumers until the broker times it out."""

import os
import signal
import stat
import threading
import time
from pathlib import Path

import httpx
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from tests.faults.test_batches_are_atomic_through_a_broker_outage import committed_by_batch
from tests.harness import answers, email_request, free_port, local_client, metric_sum, wait_until

BATCH = 200


def bulk_process_of(api_pid: int) -> int | None:
    """The pid of the API's bulk process (its child started with --bulk-socket), if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == api_pid and b"--bulk-socket" in cmdline and alive(int(entry.name)):
            return int(entry.name)
    return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except OSError:
        return False
    return "Z" not in state.split()[1]


def open_transaction_gap(admin: AdminClient, topic: str, partitions: int) -> int:
    """Records a read-committed consumer cannot read yet: high watermark minus last stable offset."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    latest = {}
    for level in (IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED):
        futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in tps}, isolation_level=level)
        latest[level] = sum(f.result(10).offset for f in futures.values())
    return latest[IsolationLevel.READ_UNCOMMITTED] - latest[IsolationLevel.READ_COMMITTED]


def still_open(admin: AdminClient, topic: str, partitions: int) -> int:
    """With the producer frozen: the records of a transaction that stays open (not one being committed
    by the coordinator, which ends within a second without the producer); 0 when there is none."""
    deadline = time.monotonic() + 1.5
    gap = open_transaction_gap(admin, topic, partitions)
    while gap > 0 and time.monotonic() < deadline:
        gap = open_transaction_gap(admin, topic, partitions)
    return gap


def test_a_killed_bulk_process_is_restarted_and_fences_its_open_transaction(
        fault_stack, fault_runtime, fault_topics, fault_processes, names):
    """Given the ingest API (with its bulk process, publish timeout 30 s: a transaction left open would hold the lane
    for 60 s), a client posting batches of 200 marketing emails back to back and another posting single sends at 20/s,
    When the bulk process gets SIGKILL while a batch's transaction is open (it is frozen with SIGSTOP until caught so),
    Then every single send is accepted throughout; batches are refused with 503 and Retry-After until the API process
    has started a new bulk process, then accepted again; the lane's read-committed end catches up with its high
    watermark within 20 s of the kill (the new process fenced the old transaction); every accepted batch is in the
    lane whole and once, no batch half; and when the API process itself is killed, its bulk process goes with it."""
    fault_topics("email")
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    port = free_port()
    api_process = fault_processes.start("api", "api", "--port", str(port), env={"KAFKA_DELIVERY_TIMEOUT_MS": "30000"})
    api = local_client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    bulk_pid = bulk_process_of(api_process.pid)
    assert bulk_pid is not None, "the API started no bulk process"
    expected_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)  # DUAL_RAIL_INGEST_BULK_NICE's default
    assert os.getpriority(os.PRIO_PROCESS, bulk_pid) == expected_nice, "the bulk process does not run at nice 10"
    autogroup = Path(f"/proc/{bulk_pid}/autogroup")  # a session of its own: its group must give up priority too
    assert not autogroup.exists() or autogroup.read_text().split()[-1] == "10", autogroup.read_text()

    answered: dict[str, tuple[int, str | None]] = {}
    singles: list[int] = []
    stop = threading.Event()

    def post_batches() -> None:
        n = 0
        while not stop.is_set():
            batch = f"b{n}"
            body = {"sends": [{**email_request("marketing"), "correlation_id": f"{batch}-{i}"} for i in range(BATCH)]}
            try:
                r = api.post("/v1/sends/batch", json=body)
                answered[batch] = (r.status_code, r.headers.get("retry-after"))
                if r.status_code == 503:
                    stop.wait(0.1)  # pacing: a client would wait Retry-After; this one only avoids spinning
            except httpx.TransportError:
                answered[batch] = (0, None)
            n += 1

    def post_singles() -> None:
        with local_client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"}) as client:
            while not stop.is_set():
                singles.append(client.post("/v1/sends", json=email_request()).status_code)
                stop.wait(0.05)  # pacing: 20 single sends a second

    def accepted_batches() -> int:
        return sum(1 for s, _ in list(answered.values()) if s == 202)

    threads = [threading.Thread(target=post_batches, daemon=True), threading.Thread(target=post_singles, daemon=True)]
    for t in threads:
        t.start()
    admin = AdminClient({"bootstrap.servers": fault_stack.bootstrap})
    lane = names.lane("email", "marketing")
    partitions = len(admin.list_topics(lane, timeout=10).topics[lane].partitions)
    try:
        wait_until(lambda: accepted_batches() >= 3, 60, "batches accepted by the bulk process")
        # Freeze the bulk process until it is caught with a transaction open (records in the lane that
        # read-committed consumers cannot read yet), then kill it there.
        attempts, left_open = 0, 0
        while attempts < 200:
            attempts += 1
            os.kill(bulk_pid, signal.SIGSTOP)
            left_open = still_open(admin, lane, partitions)
            if left_open > 0:
                break
            os.kill(bulk_pid, signal.SIGCONT)
            accepted = accepted_batches()
            wait_until(lambda n=accepted: accepted_batches() > n, 60, "the next batch accepted")
        os.kill(bulk_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda old=bulk_pid: (bulk_process_of(api_process.pid) or old) != old, 30,
                   "the API to start a new bulk process")
        bulk_pid = bulk_process_of(api_process.pid)
        assert left_open > 0, f"in {attempts} tries, no batch's transaction was caught open: the test tested nothing"
        wait_until(lambda: open_transaction_gap(admin, lane, partitions) == 0, 30,
                   "the lane's read-committed end to catch up")
        caught_up_s = time.monotonic() - killed_at
        accepted = accepted_batches()
        wait_until(lambda: accepted_batches() >= accepted + 3, 60, "batches accepted after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(60)

    counts = committed_by_batch(fault_stack.bootstrap, lane)
    refused_while_down = [(s, ra) for s, ra in answered.values() if s == 503]
    print(f"caught with a transaction open at try {attempts}; records left uncommitted by the kill {left_open}; read-committed end caught up "
          f"{caught_up_s:.1f} s after it; batches {len(answered)}: "
          f"{sum(1 for s, _ in answered.values() if s == 202)} accepted, {len(refused_while_down)} refused (503); "
          f"single sends {len(singles)}, answers {sorted(set(singles))}")
    assert set(singles) == {202}, f"single sends were refused while the bulk process was down: {set(singles)}"
    assert caught_up_s < 20, f"the open transaction held the lane {caught_up_s:.1f} s: it was not fenced"
    # The batch in flight when the bulk process died is answered 503 (it may have been published), at least.
    assert refused_while_down, "no batch was refused while the bulk process was down"
    assert all(ra == "1" for _, ra in refused_while_down), "a 503 without Retry-After"
    for batch, (status, _) in answered.items():
        if status == 202:
            assert counts.get(batch) == BATCH, f"accepted batch {batch} has {counts.get(batch, 0)} of {BATCH}"
        else:
            assert counts.get(batch, 0) in (0, BATCH), f"batch {batch} (answered {status}) is half published"

    socket_dir = socket_dir_of(bulk_pid)
    assert socket_dir.is_dir()
    api_process.kill()
    wait_until(lambda: not alive(bulk_pid), 15,
               "the bulk process to stop with its API process")
    wait_until(lambda: not socket_dir.exists(), 15, "the bulk process to remove its socket's directory")


def socket_dir_of(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--bulk-socket") + 1].decode()).parent


def _api_with_its_bulk_process(fault_runtime, fault_topics, fault_processes):
    """The ingest API (email topics, tenant shop's client) and the pid of the bulk process it started."""
    fault_topics("email")
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    port = free_port()
    api_process = fault_processes.start("api", "api", "--port", str(port))
    api = local_client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    bulk = bulk_process_of(api_process.pid)
    assert bulk is not None, "the API started no bulk process"
    return api_process, api, bulk


def test_a_hung_bulk_process_is_killed_and_started_again(fault_runtime, fault_topics, fault_processes):
    """Given the ingest API with its bulk process,
    When the bulk process hangs (SIGSTOP: it holds its socket but never answers) while a batch is waiting for it,
    Then the API process kills it after missed probes and starts a new one (counted in
    dispatch_ingest_bulk_process_restarts_total), the waiting batch is answered 503 `"outcome": "unknown"` (it may
    or may not have been published), single sends are accepted throughout, and the same batch retried with the same
    Idempotency-Key (once its lease lets it) is accepted, a further retry replaying that answer."""
    api_process, api, hung = _api_with_its_bulk_process(fault_runtime, fault_topics, fault_processes)
    batch = {"sends": [email_request("marketing") for _ in range(5)]}
    assert api.post("/v1/sends/batch", json=batch).status_code == 202  # the bulk process serves batches

    os.kill(hung, signal.SIGSTOP)
    hung_at = time.monotonic()
    waiting = api.post("/v1/sends/batch", json=batch, headers={"Idempotency-Key": "hung-1"})
    answered_s = time.monotonic() - hung_at
    singles = [api.post("/v1/sends", json=email_request()).status_code for _ in range(5)]
    wait_until(lambda: (bulk_process_of(api_process.pid) or hung) != hung, 60, "a new bulk process")
    replaced_s = time.monotonic() - hung_at
    wait_until(lambda: not alive(hung), 10, "the hung bulk process to be gone")
    retried = api.post("/v1/sends/batch", json=batch, headers={"Idempotency-Key": "hung-1"})
    while retried.status_code in (409, 503):  # the key's lease, or the new process starting: as a client would
        time.sleep(float(retried.headers.get("retry-after", "1")))  # pacing a retrying client
        retried = api.post("/v1/sends/batch", json=batch, headers={"Idempotency-Key": "hung-1"})
    restarts = metric_sum(api.get("/metrics/").text, "dispatch_ingest_bulk_process_restarts_total")
    print(f"hung bulk process: the waiting batch answered {waiting.status_code} after {answered_s:.1f} s, "
          f"a new bulk process {replaced_s:.1f} s after the hang; retry answered {retried.status_code}; "
          f"restarts counted {restarts:g}")
    assert waiting.status_code == 503 and "may or may not" in waiting.text, waiting.text
    assert waiting.json()["outcome"] == "unknown", waiting.text  # as the API's own answers mark it
    assert set(singles) == {202}, f"single sends were refused while the bulk process hung: {singles}"
    assert restarts == 1
    assert retried.status_code == 202 and retried.json()["accepted"] == 5, retried.text
    replayed = api.post("/v1/sends/batch", json=batch, headers={"Idempotency-Key": "hung-1"})
    assert replayed.headers.get("idempotent-replayed") == "true" and replayed.json() == retried.json()



def test_the_bulk_process_leaves_its_socket_directory_to_the_live_api_process(
        fault_runtime, fault_topics, fault_processes):
    """Given the ingest API with its bulk process, whose socket lives in a directory of /tmp that only its user may
    enter (named in `ps`),
    When the bulk process exits on its own (SIGTERM: its own clean-up runs) while the API process lives (frozen, so
    that nothing re-creates anything meanwhile),
    Then the directory is still there, ours and 0700 (before: removed, and made again by the API process with
    `exist_ok` a moment later: another local user who made it first would have had the API hand every batch, with
    its tenant's key, to a socket of theirs); the API starts a new bulk process in it, which serves batches."""
    api_process, api, first = _api_with_its_bulk_process(fault_runtime, fault_topics, fault_processes)
    socket_dir = socket_dir_of(first)

    os.kill(api_process.pid, signal.SIGSTOP)
    try:
        os.kill(first, signal.SIGTERM)
        wait_until(lambda: not alive(first), 30, "the bulk process to exit")
        assert socket_dir.is_dir(), "the bulk process removed its socket's directory while the API process lived"
        st = socket_dir.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode)) == (os.getuid(), 0o700, True)
    finally:
        os.kill(api_process.pid, signal.SIGCONT)
    wait_until(lambda: (bulk_process_of(api_process.pid) or first) != first, 60, "a new bulk process")
    batch = {"sends": [email_request("marketing") for _ in range(5)]}
    answer = wait_until(lambda: (r := api.post("/v1/sends/batch", json=batch)).status_code == 202 and r, 60,
                        "a batch served by the new bulk process")
    assert answer.json()["accepted"] == 5
    assert socket_dir_of(bulk_process_of(api_process.pid)) == socket_dir
