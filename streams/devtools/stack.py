"""A local stack without Docker: a real single-node Apache Kafka (KRaft) and Redis on loopback.

Kafka's broker jars are resolved from Maven Central into a cache outside the repository
(`$DUAL_RAIL_HOME/kafka/<version>/libs`, laid out like the binary distribution's `libs/`).
Every process started here is recorded by PID and stopped by that PID only.
"""

from __future__ import annotations

import base64
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
READY_TIMEOUT_S = 60.0

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
                 "-t", cluster_id, "-c", str(props)], capture_output=True, text=True)
            if fmt.returncode != 0:
                raise StackError(f"formatting Kafka storage failed:\n{fmt.stdout}{fmt.stderr}")
        self.kafka.log_file.write_text("")
        self.kafka.spawn([
            "java", KAFKA_HEAP, "-Xms256m", "-XX:+UseG1GC",
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
        if proc.pid() is None and proc.pid_file.exists():
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

