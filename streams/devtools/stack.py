"""A local stack without Docker: a real single-node Apache Kafka (KRaft) and Redis on loopback,
and, on request, a three-node KRaft cluster and a three-master Redis Cluster beside them.

Kafka's broker jars are resolved from Maven Central into a cache outside the repository
(`$DUAL_RAIL_HOME/kafka/<version>/libs`, laid out like the binary distribution's `libs/`).
Every process started here is recorded by PID and stopped by that PID only.

The clusters (`streams dev up --brokers 3`, `--redis-cluster`; docs/cluster.md) keep their layout
(node count, ports) in `$DUAL_RAIL_HOME/run/*-cluster.json`, so that `status`, `down`,
`kill-node` and `start-node` find every node without being told the ports again.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..config import StackConfig
from ..errors import StackError

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.25.3"
SLF4J_VERSION = "2.0.17"
KAFKA_HEAP = "-Xmx768m"
# The JVM settings Kafka's own start scripts give a broker (KAFKA_JVM_PERFORMANCE_OPTS in
# kafka-run-class.sh): G1 aims at 20 ms pauses instead of its default 200 ms. Under a blast the
# broker's young collections were more frequent and shorter (longest 38-44 ms against 44-70 ms).
KAFKA_JVM_PERFORMANCE = ["-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
                         "-XX:+ExplicitGCInvokesConcurrent", "-XX:MaxInlineLevel=15", "-Djava.awt.headless=true"]
READY_TIMEOUT_S = 60.0
# The local clusters: ports below the kernel's ephemeral range (32768-60999), clear of the
# single-node defaults (Kafka 19092-19093, Redis 16379). Kafka node n (1..3) listens on
# base + 2(n-1) (clients) and the next port (controller); Redis Cluster node n on base + n - 1,
# and on that port + 10000 for the cluster bus.
CLUSTER_KAFKA_PORT = 29092
CLUSTER_REDIS_PORT = 17001
CLUSTER_HEAP = "-Xmx512m"
CLUSTER_READY_TIMEOUT_S = 120.0

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>local.dual-rail</groupId><artifactId>kafka-dist</artifactId><version>1</version>
<packaging>pom</packaging><dependencies>
<dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{kafka}</version></dependency>
<dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>{log4j}</version></dependency>
<dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>{log4j}</version></dependency>
<dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>{slf4j}</version></dependency>
</dependencies></project>
"""

_LOG4J2 = """Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: INFO
      AppenderRef:
        - ref: STDOUT
"""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    address: str
    state: str  # "running (pid N)", "external", "stopped"


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


class _Process:
    """A process of ours: its PID file, its log, and a marker in its command line."""

    def __init__(self, run_dir: Path, name: str, marker: str):
        self.run_dir = run_dir
        self.name = name
        self.marker = marker
        self.pid_file = run_dir / f"{name}.pid"
        self.log_file = run_dir / f"{name}.log"

    def pid(self) -> int | None:
        """The recorded PID if that process is alive and still the one we started."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            return None
        # A recycled PID belongs to someone else: never signal it.
        return pid if self.marker in cmdline else None

    def exited(self) -> bool:
        """The process we last spawned is gone. Right after the fork its command line is still ours
        (Python's), not the marker's: that is a process starting, not one that exited."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return False
        _reap(pid)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return True
        return state == "Z"

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def stop(self, timeout: float = 20.0) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pid() is not None:
            _reap(pid)
            time.sleep(0.1)
        if self.pid() is not None:
            os.kill(pid, signal.SIGKILL)
            while self.pid() is not None:
                _reap(pid)
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True

    def signal(self, sig: signal.Signals) -> int | None:
        """Send `sig` to the process if it is ours and alive; its PID, or None."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, sig)
        return pid


def _stop_all(procs: list[_Process], timeout: float = 30.0) -> list[str]:
    """SIGTERM to every process at once, then wait; SIGKILL whatever is left at the deadline.
    (Cluster nodes are stopped together: one by one, the last ones would wait for a quorum
    that has already gone.)"""
    stopped = [p for p in procs if p.signal(signal.SIGTERM) is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.pid() is not None for p in stopped):
        for p in stopped:
            _reap_any(p)
        time.sleep(0.1)
    for p in stopped:
        if p.pid() is not None:
            p.signal(signal.SIGKILL)
    for p in stopped:
        while p.pid() is not None:
            _reap_any(p)
            time.sleep(0.05)
    for p in procs:
        p.pid_file.unlink(missing_ok=True)
    return [p.name for p in stopped]


def _reap_any(proc: _Process) -> None:
    try:
        pid = int(proc.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return
    _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class LocalStack:
    """Start, stop and report the local Kafka and Redis."""

    def __init__(self, settings: StackConfig | None = None):
        self.settings = settings or StackConfig.from_env()
        home = self.settings.home
        self.kafka_home = home / "kafka" / KAFKA_VERSION
        self.run_dir = home / "run"
        self.kafka_data = home / "data" / "kafka"
        self.redis_data = home / "data" / "redis"
        self.kafka = _Process(self.run_dir, "kafka", f"dual-rail-kafka={self.kafka_data}")
        self.redis = _Process(self.run_dir, "redis", f":{self.settings.redis_port}")

    # ---------------------------------------------------------------- Kafka
    def kafka_libs(self) -> Path:
        """Resolve the broker jars through Maven once; later calls reuse the cache."""
        libs = self.kafka_home / "libs"
        done = self.kafka_home / ".resolved"
        if done.exists():
            return libs
        for tool in ("java", "mvn"):
            if shutil.which(tool) is None:
                raise StackError(f"`{tool}` was not found on PATH: the local Kafka needs a JDK 17+ and Maven")
        self.kafka_home.mkdir(parents=True, exist_ok=True)
        (self.kafka_home / "pom.xml").write_text(
            _POM.format(kafka=KAFKA_VERSION, log4j=LOG4J_VERSION, slf4j=SLF4J_VERSION))
        shutil.rmtree(libs, ignore_errors=True)
        proc = subprocess.run(
            ["mvn", "-q", "-B", "dependency:copy-dependencies", f"-DoutputDirectory={libs}",
             "-DincludeScope=runtime"],
            cwd=self.kafka_home, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"Maven could not resolve Kafka {KAFKA_VERSION}:\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        done.write_text(KAFKA_VERSION)
        return libs

    def _kafka_properties(self) -> Path:
        port = self.settings.kafka_port
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{port + 1}",
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{port + 1}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.kafka_data),
            # One broker: internal topics cannot have more replicas than brokers.
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # Tests create many short-lived groups; do not wait 3 s before the first rebalance.
            "group.initial.rebalance.delay.ms": "0",
            # Topics are declared in topics/ and applied; a typo must not create a topic.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
        }
        path = self.run_dir / "kafka-server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.run_dir / "log4j2.yaml").write_text(_LOG4J2)
        return path

    def start_kafka(self, timeout: float = READY_TIMEOUT_S) -> str:
        bootstrap = self.settings.bootstrap
        if self.settings.kafka_bootstrap:
            return bootstrap
        if self.kafka.pid() is not None:
            _wait_kafka_ready(bootstrap, timeout, self.kafka)
            return bootstrap
        for port in (self.settings.kafka_port, self.settings.kafka_port + 1):
            if _port_open(port):
                raise StackError(
                    f"port {port} is taken by another process; free it or set DUAL_RAIL_KAFKA_PORT "
                    f"(or KAFKA_BOOTSTRAP_SERVERS to use that broker)")
        libs = self.kafka_libs()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        props = self._kafka_properties()
        classpath = f"{libs}/*"
        if not (self.kafka_data / "meta.properties").exists():
            self.kafka_data.mkdir(parents=True, exist_ok=True)
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            fmt = subprocess.run(
                ["java", "-cp", classpath, "kafka.tools.StorageTool", "format", "--standalone",
                 f"--cluster-id={cluster_id}", "-c", str(props)], capture_output=True, text=True)
            if fmt.returncode != 0:
                raise StackError(f"formatting Kafka storage failed:\n{fmt.stdout}{fmt.stderr}")
        self.kafka.log_file.write_text("")
        self.kafka.spawn([
            "java", KAFKA_HEAP, "-Xms256m", *KAFKA_JVM_PERFORMANCE,
            f"-Ddual-rail-kafka={self.kafka_data}",
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.yaml'}",
            "-cp", classpath, "kafka.Kafka", str(props),
        ])
        _wait_kafka_ready(bootstrap, timeout, self.kafka)
        return bootstrap

    # ---------------------------------------------------------------- Redis
    def start_redis(self, timeout: float = 15.0, install: bool = True) -> str:
        url = self.settings.redis
        if self.settings.redis_url:
            return url
        if self.redis.pid() is not None:
            _wait_redis_ready(url, timeout, self.redis)
            return url
        if _port_open(self.settings.redis_port):
            raise StackError(
                f"port {self.settings.redis_port} is taken by another process; free it or set "
                f"DUAL_RAIL_REDIS_PORT (or REDIS_URL to use that server)")
        binary = shutil.which("redis-server") or _install_redis(install)
        self.redis_data.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redis.log_file.write_text("")
        self.redis.spawn([
            binary, "--bind", "127.0.0.1", "--port", str(self.settings.redis_port),
            # Durable like production must be: the append-only file, fsynced every second, and no
            # eviction (an evicted delivery mark or claim would let a send go out twice).
            "--dir", str(self.redis_data), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--protected-mode", "yes",
        ])
        _wait_redis_ready(url, timeout, self.redis)
        return url

    # ---------------------------------------------------------------- whole stack
    def up(self) -> dict[str, str]:
        redis_url = self.start_redis()
        bootstrap = self.start_kafka()
        return {"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "REDIS_URL": redis_url}

    def down(self, wipe: bool = False) -> list[str]:
        stopped = [p.name for p in (self.kafka, self.redis) if p.stop()]
        if wipe:
            shutil.rmtree(self.kafka_data, ignore_errors=True)
            shutil.rmtree(self.redis_data, ignore_errors=True)
        return stopped

    def status(self) -> list[ServiceStatus]:
        out = []
        for proc, external, address in (
            (self.kafka, self.settings.kafka_bootstrap, self.settings.bootstrap),
            (self.redis, self.settings.redis_url, self.settings.redis),
        ):
            pid = proc.pid()
            state = "external" if external else (f"running (pid {pid})" if pid else "stopped")
            out.append(ServiceStatus(proc.name, address, state))
        return out


def _install_redis(allowed: bool) -> str:
    if allowed and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=False, env=env,
                       capture_output=True)
        found = shutil.which("redis-server")
        if found:
            return found
    raise StackError("`redis-server` was not found and could not be installed: "
                     "install Debian's redis-server package, or set REDIS_URL")


def _wait_kafka_ready(bootstrap: str, timeout: float, proc: _Process) -> None:
    from confluent_kafka.admin import AdminClient

    from ..kafka_client import client_config

    admin = AdminClient(client_config(bootstrap, quiet=True))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.exited():
            raise StackError(f"the Kafka broker exited during start-up; last log lines:\n{_tail(proc.log_file)}")
        try:
            md = admin.list_topics(timeout=1.0)
            if md.brokers:
                return
        except Exception:  # noqa: BLE001 - not ready yet; the deadline bounds the loop
            pass
        time.sleep(0.25)
    raise StackError(f"the Kafka broker at {bootstrap} did not become ready within {timeout:.0f} s; "
                     f"last log lines:\n{_tail(proc.log_file)}")


def _wait_redis_ready(url: str, timeout: float, proc: _Process) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise StackError(f"Redis at {url} did not answer PING within {timeout:.0f} s; "
                     f"last log lines:\n{_tail(proc.log_file)}")



# ------------------------------------------------------------------------------------------ clusters
def _load_layout(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise StackError(f"{path} is not valid JSON: delete it (and the cluster's data) or run "
                         "`streams dev down --wipe`") from None


def _check_free(ports: list[int]) -> None:
    for port in ports:
        if _port_open(port):
            raise StackError(f"port {port} is taken by another process; free it or choose another base port "
                             f"(see docs/cluster.md)")


@dataclass(frozen=True)
class KafkaNode:
    """One combined controller+broker process of the local KRaft cluster."""

    node_id: int
    port: int             # PLAINTEXT, for clients and replication
    controller_port: int  # CONTROLLER, for the Raft quorum
    data: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Quorum:
    """The KRaft metadata quorum as the active controller describes it."""

    leader_id: int
    leader_epoch: int
    high_watermark: int
    voters: dict[int, int]      # node id -> log end offset
    observers: dict[int, int]


class KafkaCluster:
    """A local Kafka cluster in KRaft mode: `brokers` combined controller+broker processes (same jars
    as the single-node stack), each with its own ports and data directory, the controller quorum
    made of all of them (a static voter set: `controller.quorum.voters`)."""

    LAYOUT = "kafka-cluster.json"

    def __init__(self, settings: StackConfig | None = None, brokers: int | None = None,
                 base_port: int | None = None):
        self.settings = settings or StackConfig.from_env()
        home = self.settings.home
        self.run_dir = home / "run"
        self.data_dir = home / "data" / "cluster"
        self.layout_file = self.run_dir / self.LAYOUT
        layout = _load_layout(self.layout_file)
        if layout is not None:
            for key, wanted in (("brokers", brokers), ("base_port", base_port)):
                if wanted is not None and wanted != layout[key]:
                    raise StackError(
                        f"a {layout['brokers']}-node Kafka cluster with base port {layout['base_port']} already "
                        f"exists in {home}; stop and wipe it first (`streams dev down --wipe`)")
            self.brokers, self.base_port, self.cluster_id = layout["brokers"], layout["base_port"], layout["cluster_id"]
        else:
            self.brokers = brokers or 3
            self.base_port = base_port or CLUSTER_KAFKA_PORT
            self.cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if self.brokers < 3:
            raise StackError(f"a local Kafka cluster needs at least 3 nodes (got {self.brokers}); "
                             "one broker is `streams dev up` without --brokers")
        self.nodes = [KafkaNode(n, self.base_port + 2 * (n - 1), self.base_port + 2 * (n - 1) + 1,
                                self.data_dir / f"kafka-{n}") for n in range(1, self.brokers + 1)]
        # The trailing space ends the marker: node 1's must not match node 10's command line.
        self.procs = {n.node_id: _Process(self.run_dir, f"kafka-{n.node_id}", f"-Ddual-rail-kafka={n.data} ")
                      for n in self.nodes}

    @classmethod
    def existing(cls, settings: StackConfig | None = None) -> KafkaCluster | None:
        """The cluster this home has (running or not), if `up --brokers N` ever created one."""
        settings = settings or StackConfig.from_env()
        return cls(settings) if (settings.home / "run" / cls.LAYOUT).exists() else None

    @property
    def bootstrap(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def node(self, node_id: int) -> KafkaNode:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise StackError(f"no Kafka node {node_id}: the cluster has nodes 1 to {self.brokers}")

    def _properties(self, node: KafkaNode) -> Path:
        rf, isr = str(min(3, self.brokers)), str(min(2, self.brokers))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes),
            "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.data),
            # Internal topics replicated like the cluster profile's topics (3 copies, 2 in sync).
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            "default.replication.factor": rf,
            # min.insync.replicas stays at the broker default (1): topics get theirs from their
            # profile, and topics created with one replica (the dev profile) must stay writable.
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            # A dead broker is fenced (its partitions, group coordinators included, get new leaders)
            # after this: kept well under the consumers' 10 s session timeout, so losing a broker
            # does not also expire every group member's session (a rebalance on top of the failover).
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "1000",
        }
        path = self.run_dir / f"kafka-{node.node_id}.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _format(self, classpath: str, nodes: list[KafkaNode]) -> None:
        """Format the storage of nodes that have none, all with the cluster's id (in parallel)."""
        pending = []
        for node in nodes:
            if (node.data / "meta.properties").exists():
                continue
            node.data.mkdir(parents=True, exist_ok=True)
            pending.append((node, subprocess.Popen(
                ["java", "-cp", classpath, "kafka.tools.StorageTool", "format", f"--cluster-id={self.cluster_id}",
                 "-c", str(self._properties(node))],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for node, proc in pending:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise StackError(f"formatting Kafka node {node.node_id}'s storage failed:\n{out}")

    def _spawn(self, node: KafkaNode, classpath: str) -> None:
        proc = self.procs[node.node_id]
        props = self._properties(node)
        proc.log_file.write_text("")
        proc.spawn([
            "java", CLUSTER_HEAP, "-Xms128m", *KAFKA_JVM_PERFORMANCE,
            f"-Ddual-rail-kafka={node.data}",
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.yaml'}",
            "-cp", classpath, "kafka.Kafka", str(props),
        ])

    def start(self, timeout: float = CLUSTER_READY_TIMEOUT_S) -> str:
        """Start every node that is not running (all at once: a node waits for a quorum) and wait
        until the metadata lists every broker."""
        down = [n for n in self.nodes if self.procs[n.node_id].pid() is None]
        if down:
            _check_free([p for n in down for p in (n.port, n.controller_port)])
            classpath = f"{LocalStack(self.settings).kafka_libs()}/*"
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.layout_file.write_text(json.dumps(
                {"brokers": self.brokers, "base_port": self.base_port, "cluster_id": self.cluster_id}))
            (self.run_dir / "log4j2.yaml").write_text(_LOG4J2)
            self._format(classpath, down)
            for node in down:
                self._spawn(node, classpath)
        self.wait_brokers({n.node_id for n in self.nodes}, timeout)
        return self.bootstrap

    def start_node(self, node_id: int, timeout: float = CLUSTER_READY_TIMEOUT_S) -> None:
        """Start one node again (after `stop_node`) and wait until it is a registered broker."""
        node = self.node(node_id)
        if self.procs[node_id].pid() is None:
            _check_free([node.port, node.controller_port])
            self._spawn(node, f"{LocalStack(self.settings).kafka_libs()}/*")
        self.wait_brokers({node_id}, timeout)

    def stop_node(self, node_id: int, sig: signal.Signals = signal.SIGTERM, timeout: float = 60.0) -> bool:
        """Stop one node: SIGTERM (a controlled shutdown; SIGKILL if it has not exited by `timeout`)
        or SIGKILL (a crash). False when it was not running."""
        self.node(node_id)
        return _stop_node_process(self.procs[node_id], sig, timeout)

    def stop(self) -> list[str]:
        return _stop_all(list(self.procs.values()))

    def wipe(self) -> None:
        for node in self.nodes:
            shutil.rmtree(node.data, ignore_errors=True)
        self.layout_file.unlink(missing_ok=True)

    def status(self) -> list[ServiceStatus]:
        out = []
        for node in self.nodes:
            pid = self.procs[node.node_id].pid()
            out.append(ServiceStatus(f"kafka-{node.node_id}", node.address,
                                     f"running (pid {pid})" if pid else "stopped"))
        return out

    def wait_brokers(self, expected: set[int], timeout: float) -> None:
        """Until each node of `expected` serves requests itself (a KRaft broker does once it has
        caught up with the metadata log and the controller has unfenced it). A node that exits
        meanwhile fails fast, with its last log lines. (The cluster's metadata is not enough: a
        broker killed a moment ago is listed until its session times out.)"""
        from ..topology.admin import broker_serves

        deadline = time.monotonic() + timeout
        waiting = set(expected)
        while time.monotonic() < deadline:
            for node_id in sorted(waiting):
                proc = self.procs[node_id]
                if proc.pid() is None:
                    raise StackError(f"Kafka node {node_id} is not running (it exited during start-up?); "
                                     f"last log lines:\n{_tail(proc.log_file)}")
                if broker_serves(self.node(node_id).address) == node_id:
                    waiting.discard(node_id)
            if not waiting:
                return
            time.sleep(0.25)
        raise StackError(f"Kafka nodes {sorted(waiting)} did not serve as brokers within {timeout:.0f} s; "
                         f"see {self.run_dir}/kafka-N.log")

    def quorum(self, timeout: float = 10.0) -> Quorum:
        """The metadata quorum (leader, voters, observers), as the active controller reports it."""
        from ..topology.admin import describe_quorum

        leader, epoch, hw, voters, observers = describe_quorum(self.bootstrap, timeout)
        return Quorum(leader, epoch, hw, voters, observers)


@dataclass(frozen=True)
class RedisNode:
    index: int
    port: int
    data: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class LocalRedisCluster:
    """A local Redis Cluster of `masters` masters and no replicas, from Debian's redis-server: one
    process per node with `cluster-enabled yes`, durable like the single Redis (append-only file,
    fsync every second, no eviction), formed once with `redis-cli --cluster create`."""

    LAYOUT = "redis-cluster.json"
    NODE_TIMEOUT_MS = 5000  # how long a node may be unreachable before the others mark it failed

    def __init__(self, settings: StackConfig | None = None, masters: int | None = None, base_port: int | None = None):
        self.settings = settings or StackConfig.from_env()
        home = self.settings.home
        self.run_dir = home / "run"
        self.layout_file = self.run_dir / self.LAYOUT
        layout = _load_layout(self.layout_file)
        if layout is not None:
            for key, wanted in (("masters", masters), ("base_port", base_port)):
                if wanted is not None and wanted != layout[key]:
                    raise StackError(
                        f"a {layout['masters']}-master Redis Cluster with base port {layout['base_port']} "
                        f"already exists in {home}; stop and wipe it first (`streams dev down --wipe`)")
            self.masters, self.base_port = layout["masters"], layout["base_port"]
        else:
            self.masters = masters or 3
            self.base_port = base_port or CLUSTER_REDIS_PORT
        if self.masters < 3:
            raise StackError(f"Redis Cluster needs at least 3 masters (got {self.masters})")
        self.nodes = [RedisNode(i, self.base_port + i - 1, home / "data" / "cluster" / f"redis-{i}")
                      for i in range(1, self.masters + 1)]
        self.procs = {n.index: _Process(self.run_dir, f"redis-cluster-{n.index}", f"127.0.0.1:{n.port}")
                      for n in self.nodes}

    @classmethod
    def existing(cls, settings: StackConfig | None = None) -> LocalRedisCluster | None:
        settings = settings or StackConfig.from_env()
        return cls(settings) if (settings.home / "run" / cls.LAYOUT).exists() else None

    @property
    def url(self) -> str:
        """The REDIS_URL of this cluster (every node a startup node)."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def node(self, index: int) -> RedisNode:
        for n in self.nodes:
            if n.index == index:
                return n
        raise StackError(f"no Redis Cluster node {index}: the cluster has nodes 1 to {self.masters}")

    def _spawn(self, node: RedisNode, binary: str) -> None:
        node.data.mkdir(parents=True, exist_ok=True)
        proc = self.procs[node.index]
        proc.log_file.write_text("")
        proc.spawn([
            binary, "--bind", "127.0.0.1", "--port", str(node.port),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS),
            # Durable like the single Redis (README: Redis in production).
            "--dir", str(node.data), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no", "--protected-mode", "yes",
        ])

    def start(self, timeout: float = 60.0, install: bool = True) -> str:
        down = [n for n in self.nodes if self.procs[n.index].pid() is None]
        if down:
            _check_free([p for n in down for p in (n.port, n.port + 10000)])
            binary = shutil.which("redis-server") or _install_redis(install)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.layout_file.write_text(json.dumps({"masters": self.masters, "base_port": self.base_port}))
            for node in down:
                self._spawn(node, binary)
        for node in self.nodes:
            _wait_redis_ready(f"redis://{node.address}/0", 15.0, self.procs[node.index])
        if all(self._info(n).get("cluster_known_nodes") == "1" for n in self.nodes):
            self._create()
        self.wait_ok(timeout)
        return self.url

    def _create(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise StackError("`redis-cli` was not found on PATH (Debian package redis-tools): it forms the cluster")
        proc = subprocess.run([cli, "--cluster", "create", *(n.address for n in self.nodes),
                               "--cluster-replicas", "0", "--cluster-yes"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise StackError(f"`redis-cli --cluster create` failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def _info(self, node: RedisNode) -> dict[str, str]:
        """CLUSTER INFO of one node ({} when it does not answer)."""
        import redis

        try:
            raw = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2,
                              socket_connect_timeout=1).execute_command("CLUSTER INFO")
        except redis.RedisError:
            return {}
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items()}
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def wait_ok(self, timeout: float = 60.0, nodes: list[int] | None = None) -> None:
        """Until every (running) node says `cluster_state:ok` with every slot assigned."""
        watched = [self.node(i) for i in nodes] if nodes else self.nodes
        deadline = time.monotonic() + timeout
        infos: dict[int, dict[str, str]] = {}
        while time.monotonic() < deadline:
            infos = {n.index: self._info(n) for n in watched}
            if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_assigned") == "16384"
                   and i.get("cluster_known_nodes") == str(self.masters) for i in infos.values()):
                return
            time.sleep(0.2)
        states = {i: (info.get("cluster_state"), info.get("cluster_known_nodes")) for i, info in infos.items()}
        raise StackError(f"the Redis Cluster is not ok after {timeout:.0f} s (node: (state, known nodes)) "
                         f"{states}; logs in {self.run_dir}/redis-cluster-N.log")

    def start_node(self, index: int, timeout: float = 60.0) -> None:
        """Start one node again: it rejoins with its nodes.conf and its append-only file."""
        node = self.node(index)
        if self.procs[index].pid() is None:
            _check_free([node.port, node.port + 10000])
            self._spawn(node, shutil.which("redis-server") or _install_redis(True))
        _wait_redis_ready(f"redis://{node.address}/0", 15.0, self.procs[index])
        self.wait_ok(timeout)

    def stop_node(self, index: int, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> bool:
        self.node(index)
        return _stop_node_process(self.procs[index], sig, timeout)

    def stop(self) -> list[str]:
        return _stop_all(list(self.procs.values()))

    def wipe(self) -> None:
        for node in self.nodes:
            shutil.rmtree(node.data, ignore_errors=True)
        self.layout_file.unlink(missing_ok=True)

    def status(self) -> list[ServiceStatus]:
        out = []
        for node in self.nodes:
            pid = self.procs[node.index].pid()
            out.append(ServiceStatus(f"redis-cluster-{node.index}", node.address,
                                     f"running (pid {pid})" if pid else "stopped"))
        return out


def _stop_node_process(proc: _Process, sig: signal.Signals, timeout: float) -> bool:
    """Signal one cluster node and wait until it has exited (SIGKILL once `timeout` passes). False
    when it was not running."""
    pid = proc.signal(sig)
    if pid is None:
        return False
    deadline = time.monotonic() + timeout
    while proc.pid() is not None:
        _reap(pid)
        if time.monotonic() > deadline:
            proc.signal(signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.05)
    proc.pid_file.unlink(missing_ok=True)
    return True


def cluster_stacks(settings: StackConfig | None = None) -> list[KafkaCluster | LocalRedisCluster]:
    """The clusters this home has created (running or not)."""
    found: list[KafkaCluster | LocalRedisCluster | None] = [KafkaCluster.existing(settings),
                                                           LocalRedisCluster.existing(settings)]
    return [c for c in found if c is not None]


# `streams dev kill-node --signal`: TERM is a clean shutdown, KILL a crash.
SIGNALS: dict[str, signal.Signals] = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}
