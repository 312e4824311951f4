"""The Kubernetes manifests in deploy/k8s checked against the code, so they cannot drift: every
container runs a real `streams` invocation, every lane has its worker and retrier, KEDA scales each
worker on its own group's lag with thresholds consistent with the yield policy, settings are ones
the code documents, and every Deployment has a disruption budget and a grace period longer than its
drain. Parses the YAML only: no cluster is contacted."""

import argparse
import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams import config as config_module
from streams import kafka_client
from streams.cli import build_parser, roles
from streams.config import Config
from streams.lanes import CHANNELS, LANES
from streams.providers.registry import load_registry
from streams.topology.spec import load_definitions

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
NAMESPACE = "dual-rail"
IMAGE = "dual-rail-dispatch:latest"
# The HorizontalPodAutoscaler does not scale while the metric is within 10% of its target (the
# default of kube-controller-manager's --horizontal-pod-autoscaler-tolerance).
HPA_TOLERANCE = 0.1


@cache
def documents() -> tuple[dict[str, Any], ...]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append({**doc, "_file": path.name})
    return tuple(docs)


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def deployments() -> dict[str, dict[str, Any]]:
    return of_kind("Deployment")


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container, got {len(containers)}"
    return containers[0]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def parse_cli(args: list[str]) -> argparse.Namespace:
    """Parse `args` with the real `streams` parser; fail the test (never exit) when it refuses them."""
    err = io.StringIO()
    parsed = None
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(err):
        parsed = build_parser().parse_args(args)
    if parsed is None:
        pytest.fail(f"{args} is not a valid `streams` invocation: {err.getvalue().strip()}")
    return parsed


def cli_args(workload: dict[str, Any]) -> argparse.Namespace:
    return parse_cli(container(workload)["args"])


def long_lived_roles() -> set[str]:
    """The subcommands of the process roles (streams/cli/roles.py), registered as the CLI does."""
    sub = argparse.ArgumentParser().add_subparsers()
    for register in roles.COMMANDS:
        register(sub)
    return set(sub.choices)


def config_map() -> dict[str, str]:
    maps = of_kind("ConfigMap")
    assert list(maps) == ["dual-rail-config"], f"expected the one ConfigMap dual-rail-config, got {list(maps)}"
    return maps["dual-rail-config"]["data"]


def deployed_config() -> Config:
    """The configuration the processes get: the ConfigMap parsed by the real Config (the Secret's
    API keys aside)."""
    return Config.from_env(config_map())


def documented_variables() -> set[str]:
    """The variable names streams/config.py's docstring lists, one entry (or two, comma-separated) a line."""
    names: set[str] = set()
    for line in (config_module.__doc__ or "").splitlines():
        m = re.match(r" {4}([A-Z][A-Z0-9_]+(?:, [A-Z][A-Z0-9_]+)*)\s", line)
        if m:
            names.update(m.group(1).split(", "))
    return names


def provider_key_variables() -> set[str]:
    """The variables holding provider API keys or credentials, as the provider registry names them."""
    return {p.keys_env for p in deployed_config().registry.providers.values() if p.keys_env}


def scaled_objects() -> dict[str, dict[str, Any]]:
    """ScaledObjects by the Deployment they scale."""
    by_target: dict[str, dict[str, Any]] = {}
    for name, so in of_kind("ScaledObject").items():
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target not in by_target, \
            f"ScaledObjects {by_target[target]['metadata']['name']} and {name} both scale {target}"
        by_target[target] = so
    return by_target


def kafka_trigger(so: dict[str, Any]) -> dict[str, str]:
    triggers = so["spec"]["triggers"]
    assert len(triggers) == 1 and triggers[0]["type"] == "kafka", \
        f"ScaledObject {so['metadata']['name']}: expected one trigger of type kafka, got {triggers}"
    return triggers[0]["metadata"]


def lane_workers() -> dict[str, argparse.Namespace]:
    return {name: args for name, d in deployments().items() if (args := cli_args(d)).command == "worker"}


# ---------------------------------------------------------------------------------------------- the objects


def test_every_document_is_a_named_object_in_the_namespace():
    """Given every YAML document under deploy/k8s,
    When each is read,
    Then each has an apiVersion, a kind and a name, no kind and name is declared twice, the Namespace is
    declared, and every other object lives in it."""
    assert documents(), f"no manifests found in {K8S}"
    for doc in documents():
        where = f"{doc['_file']}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), where
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{where}: not in namespace {NAMESPACE}"
    assert NAMESPACE in of_kind("Namespace"), f"the Namespace {NAMESPACE} is not declared"
    seen = [(d["kind"], d["metadata"]["name"]) for d in documents()]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    assert not twice, f"declared more than once: {twice}"


def test_every_long_lived_role_has_a_deployment_and_every_lane_its_worker_and_retrier():
    """Given the process roles the CLI registers (streams.cli.roles.COMMANDS) and the channels and lanes,
    When the Deployments' commands are read,
    Then every role runs in some Deployment, and each channel and lane has exactly one worker and one
    retrier Deployment."""
    running = [cli_args(d) for d in deployments().values()]
    missing = long_lived_roles() - {a.command for a in running}
    assert not missing, f"process roles without a Deployment: {sorted(missing)}"
    for role in ("worker", "retrier"):
        lanes = sorted((a.channel, a.lane) for a in running if a.command == role)
        expected = sorted((c, lane) for c in CHANNELS for lane in LANES)
        assert lanes == expected, f"{role} Deployments cover {lanes}, expected each of {expected} once"


def cpu_millis(workload: dict[str, Any]) -> float:
    cpu = str(container(workload)["resources"]["requests"]["cpu"])
    return float(cpu[:-1]) if cpu.endswith("m") else float(cpu) * 1000


@pytest.mark.parametrize("role", ["worker", "retrier"])
def test_marketing_copies_weigh_as_little_as_nice_10_against_transactional_ones(role):
    """Given a channel's transactional and marketing Deployments of a role,
    When their CPU requests (their cgroups' CPU weight, which is what a container's share comes from: nice 10
    weighs only against the container's own processes) are compared,
    Then a marketing copy asks at most 110/1024 of a transactional one (nice 10's weight against nice 0), as
    docker-compose's cpu_shares do (before: the same, so a blast's CPU use delayed OTPs on a shared node)."""
    for channel in CHANNELS:
        transactional = deployments()[f"{role}-{channel}-transactional"]
        marketing = deployments()[f"{role}-{channel}-marketing"]
        assert cpu_millis(marketing) <= cpu_millis(transactional) * 110 / 1024, (channel, role)


def setup_commands() -> list[list[str]]:
    """The `streams ...` commands the README's setup runs in pods (`kubectl ... exec ... -- streams ...`)."""
    text = (K8S / "README.md").read_text()
    found = re.finditer(r"^kubectl [^\n]*? -- streams (.*)$", text, flags=re.M)
    return [shlex.split(m.group(1), comments=True) for m in found]


def test_the_setup_sets_limits_for_every_provider_and_its_commands_are_real():
    """Given the README's setup commands,
    When they are parsed by the real `streams` parser, and the providers they set limits for are listed,
    Then every one parses, and every provider of providers.toml gets a global and a `*` tenant limit (before:
    resend only, so the SMS and webhook workers held every send, waiting for limits nobody had set)."""
    parser = build_parser()
    commands = setup_commands()
    assert len(commands) >= 5, commands
    for argv in commands:
        parser.parse_args(argv)
    limits = [parser.parse_args(argv) for argv in commands if argv[:2] == ["limits", "set"]]
    global_set = {a.provider for a in limits if a.global_rate is not None}
    tenant_set = {a.provider for a in limits if a.tenant == "*" and a.rate is not None}
    providers = {spec.name for channel in CHANNELS for spec in load_registry().for_channel(channel)}
    assert global_set == tenant_set == providers


def test_every_process_creates_its_topics_replicated():
    """Given the ConfigMap every process reads (the topics Job, and the endpoint-health role, which creates its
    own changelog topic from its own environment),
    When the topic definitions are loaded as those processes load them,
    Then every topic has 3 replicas and min.insync.replicas 2 (before: the profile was left to the topics Job, so
    every topic had one copy as written, and the changelog one for good)."""
    config = deployed_config()
    topics = load_definitions(namespace=config.namespace, profile=config.topic_profile)
    assert {(t.replication_factor, t.config.get("min.insync.replicas")) for t in topics.values()} == {(3, "2")}


@pytest.mark.parametrize("kind, name", [(d["kind"], d["metadata"]["name"]) for d in documents()
                                        if d["kind"] in ("Deployment", "Job")])
def test_every_container_runs_a_valid_streams_invocation(kind, name):
    """Given a Deployment or Job,
    When its container's command and args are parsed by the real `streams` parser,
    Then they parse (the parser does not exit), the image is the project's, and a Deployment runs a
    long-lived process role."""
    workload = of_kind(kind)[name]
    c = container(workload)
    assert c["image"] == IMAGE, f"{kind} {name}: image {c['image']!r}, expected {IMAGE!r}"
    assert c.get("command", ["streams"]) == ["streams"], f"{kind} {name}: command {c['command']}, expected ['streams']"
    args = cli_args(workload)
    if kind == "Deployment":
        assert args.command in long_lived_roles(), f"Deployment {name} runs `streams {args.command}`, not a process role"


def test_worker_and_retrier_deployments_name_a_real_channel_and_lane():
    """Given the worker and retrier Deployments,
    When their --channel and --lane are read,
    Then both exist, and the Deployment's name and labels say the same channel and lane."""
    for name, d in deployments().items():
        args = cli_args(d)
        if args.command not in ("worker", "retrier"):
            continue
        assert args.channel in CHANNELS and args.lane in LANES, f"{name}: unknown lane {args.channel}.{args.lane}"
        assert name == f"{args.command}-{args.channel}-{args.lane}", \
            f"Deployment {name} runs {args.command} --channel {args.channel} --lane {args.lane}"
        for labels in (d["metadata"]["labels"], pod_labels(d)):
            assert (labels.get("dual-rail/channel"), labels.get("dual-rail/lane")) == (args.channel, args.lane), \
                f"{name}: labels {labels} disagree with --channel {args.channel} --lane {args.lane}"


def test_endpoint_health_data_dir_is_a_mounted_volume():
    """Given the endpoint-health Deployment,
    When its --data-dir is read,
    Then it is where a volume is mounted (faust's working directory is not the image's filesystem)."""
    for name, d in deployments().items():
        args = cli_args(d)
        if args.command == "endpoint-health":
            mounts = {m["mountPath"] for m in container(d).get("volumeMounts", [])}
            assert args.data_dir in mounts, f"{name}: --data-dir {args.data_dir} is not one of the mounts {mounts}"


# ---------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("name", sorted(deployments()))
def test_metrics_port_probe_and_scrape_annotations_agree_with_the_cli(name):
    """Given a Deployment,
    When its --metrics-port (or, for the API, its HTTP --port, which serves /metrics) is read,
    Then it is not 0, the container declares it under the probe's port name, the readiness probe reads
    the metrics path there, and the Prometheus annotations scrape that port and path."""
    d = deployments()[name]
    args = cli_args(d)
    if hasattr(args, "metrics_port"):
        port, port_name, path = args.metrics_port, "metrics", "/metrics"
    else:
        assert args.command == "api", f"{name}: `streams {args.command}` has no --metrics-port"
        # the API mounts the metrics app at /metrics, whose own path is /metrics/ (/metrics redirects there)
        port, port_name, path = args.port, "http", "/metrics/"
        assert args.host == "0.0.0.0", f"{name}: --host {args.host} is unreachable from outside the pod"
    assert port, f"{name}: /metrics is off (--metrics-port 0 or missing)"
    declared = {p["name"]: p["containerPort"] for p in container(d).get("ports", [])}
    assert declared.get(port_name) == port, f"{name}: containerPort {port_name} is {declared.get(port_name)}, the CLI serves {port}"
    probe = container(d).get("readinessProbe", {}).get("httpGet", {})
    assert (probe.get("path"), probe.get("port")) == (path, port_name), \
        f"{name}: readinessProbe {probe}, expected httpGet {path} on port {port_name}"
    annotations = d["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true", f"{name}: not scraped"
    assert annotations.get("prometheus.io/port") == str(port), f"{name}: scraped on {annotations.get('prometheus.io/port')}, serves {port}"
    assert annotations.get("prometheus.io/path") == path, f"{name}: scrape path {annotations.get('prometheus.io/path')}, expected {path}"


def test_metrics_listen_on_the_pod_address():
    """Given the ConfigMap,
    When it is parsed by the real Config,
    Then /metrics binds to every address (the default, loopback, would fail every probe and scrape)."""
    addr = deployed_config().metrics_addr
    assert addr == "0.0.0.0", f"METRICS_ADDR is {addr}: probes and Prometheus cannot reach /metrics there"


# ---------------------------------------------------------------------------------------------- settings


def test_config_map_sets_only_documented_variables_and_parses():
    """Given the ConfigMap,
    When its keys are compared with the variables streams/config.py documents and it is parsed by Config,
    Then every key is documented, it parses without error, and it holds no provider API keys."""
    documented = documented_variables()
    assert {"KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "METRICS_ADDR", "RESEND_API_KEYS"} <= documented, \
        f"could not read the variables from streams/config.py's docstring: {sorted(documented)}"
    undocumented = set(config_map()) - documented
    assert not undocumented, f"ConfigMap variables streams/config.py does not document: {sorted(undocumented)}"
    assert all(isinstance(v, str) for v in config_map().values()), "ConfigMap values must be strings"
    deployed_config()  # raises ConfigError naming the variable
    keys = provider_key_variables() & set(config_map())
    assert not keys, f"provider API keys belong in the Secret, not the ConfigMap: {sorted(keys)}"
    assert "WEBHOOK_SECRET_KEYS" not in config_map(), "the keys that seal webhook secrets belong in a Secret"


@pytest.mark.parametrize("kind, name", [(d["kind"], d["metadata"]["name"]) for d in documents()
                                        if d["kind"] in ("Deployment", "Job")])
def test_containers_take_settings_from_the_config_map_and_keys_from_the_secret(kind, name):
    """Given a Deployment or Job,
    When its environment is read,
    Then it loads the ConfigMap, every variable it sets is documented, a provider's keys come from a
    Secret (never an inline value), and a worker gets the keys of each of its channel's providers (the
    first provider's required, with its base URL in the ConfigMap; a fallback's optional)."""
    c = container(of_kind(kind)[name])
    refs = [s["configMapRef"]["name"] for s in c.get("envFrom", []) if "configMapRef" in s]
    assert refs == ["dual-rail-config"], f"{kind} {name}: envFrom {c.get('envFrom')}, expected the ConfigMap dual-rail-config"
    env = {e["name"]: e for e in c.get("env", [])}
    undocumented = set(env) - documented_variables()
    assert not undocumented, f"{kind} {name}: variables streams/config.py does not document: {sorted(undocumented)}"
    for var in set(env) & provider_key_variables():
        ref = env[var].get("valueFrom", {}).get("secretKeyRef", {})
        assert "value" not in env[var] and ref.get("key") == var, f"{kind} {name}: {var} must come from a Secret, got {env[var]}"
    args = cli_args(of_kind(kind)[name])
    if args.command == "api" or (args.command == "worker" and args.channel == "webhook"):
        # they seal and open webhook signing secrets: the keys come from a Secret, and are required
        ref = env.get("WEBHOOK_SECRET_KEYS", {}).get("valueFrom", {}).get("secretKeyRef", {})
        assert ref.get("key") == "WEBHOOK_SECRET_KEYS" and not ref.get("optional"), \
            f"{kind} {name}: WEBHOOK_SECRET_KEYS must come from a Secret, got {env.get('WEBHOOK_SECRET_KEYS')}"
    if args.command != "worker":
        return
    registry = deployed_config().registry
    for spec in registry.for_channel(args.channel):
        if spec.auth == "none":
            continue
        assert spec.keys_env in env, f"{kind} {name}: the {args.channel} worker gets no {spec.keys_env} ({spec.name})"
        if spec == registry.primary(args.channel):
            # the channel's first provider takes every send: its keys and base URL must be there
            assert not env[spec.keys_env]["valueFrom"]["secretKeyRef"].get("optional"), \
                f"{kind} {name}: {spec.keys_env} is optional, but {spec.name} is the {args.channel} channel's first provider"
            assert config_map().get(spec.base_url_env), \
                f"the {args.channel} workers need {spec.base_url_env} ({spec.name}) in the ConfigMap"


# ---------------------------------------------------------------------------------------------- scaling


def test_each_lane_worker_scales_on_its_own_group_lag():
    """Given the KEDA ScaledObjects and the lane worker Deployments,
    When each ScaledObject's kafka trigger is compared with the worker it scales,
    Then every worker has one, it watches that worker's consumer group on its lane topic, on the
    configured brokers and with the workers' offset reset policy, and the replica range fits the
    topic's partitions (KEDA owns the replica count: the Deployment sets none)."""
    cfg = deployed_config()
    names = cfg.names
    topics = load_definitions(namespace=cfg.namespace)
    by_target = scaled_objects()
    workers = lane_workers()
    assert set(by_target) == set(workers), \
        f"ScaledObjects scale {sorted(by_target)}, the lane workers are {sorted(workers)}"
    consumer_conf: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kafka_client, "Consumer", lambda conf: consumer_conf.update(conf))
        kafka_client.lane_consumer(cfg.bootstrap, "g")
    for name, args in workers.items():
        so, trigger = by_target[name], kafka_trigger(by_target[name])
        group, topic = names.group(args.channel, args.lane), names.lane(args.channel, args.lane)
        assert trigger.get("consumerGroup") == group, f"{name}: KEDA watches group {trigger.get('consumerGroup')}, the worker's is {group}"
        assert trigger.get("topic") == topic, f"{name}: KEDA watches topic {trigger.get('topic')}, the worker's is {topic}"
        assert trigger.get("bootstrapServers") == cfg.bootstrap, \
            f"{name}: KEDA reads {trigger.get('bootstrapServers')}, the workers KAFKA_BOOTSTRAP_SERVERS={cfg.bootstrap}"
        assert trigger.get("offsetResetPolicy") == consumer_conf["auto.offset.reset"], \
            f"{name}: offsetResetPolicy {trigger.get('offsetResetPolicy')}, the workers reset to {consumer_conf['auto.offset.reset']}"
        partitions = topics[topic].partitions
        low, high = so["spec"].get("minReplicaCount"), so["spec"].get("maxReplicaCount")
        assert isinstance(low, int) and isinstance(high, int) and 1 <= low <= high <= partitions, \
            f"{name}: replicas {low}..{high}, expected 1 <= min <= max <= {partitions} partitions of the lane topic"
        assert "replicas" not in deployments()[name]["spec"], f"{name}: sets replicas, which KEDA owns"


def test_transactional_lanes_scale_out_before_marketing_has_to_yield():
    """Given the yield threshold the workers get (YIELD_PAUSE_ABOVE from the ConfigMap, else the default
    of 100 messages) and the lane workers' lag thresholds,
    When a channel's transactional lag grows from nothing,
    Then its transactional workers scale out (past the autoscaler's tolerance, from their minimum)
    before the lag reaches the yield threshold, and marketing scales on a larger threshold."""
    pause_above = deployed_config().yield_policy.pause_above  # the ConfigMap's, else Config's default
    by_target = scaled_objects()
    thresholds: dict[tuple[str, str], int] = {}
    for name, args in lane_workers().items():
        raw = kafka_trigger(by_target[name]).get("lagThreshold")
        assert isinstance(raw, str) and raw.isdigit(), f"{name}: lagThreshold {raw!r} must be a quoted integer"
        thresholds[(args.channel, args.lane)] = int(raw)
        if args.lane == "transactional":
            low = by_target[name]["spec"]["minReplicaCount"]
            assert int(raw) < pause_above, f"{name}: lagThreshold {raw} is not below YIELD_PAUSE_ABOVE={pause_above}"
            first_scale_out = low * int(raw) * (1 + HPA_TOLERANCE)
            assert first_scale_out < pause_above, \
                f"{name}: from {low} replicas it scales out above a lag of {first_scale_out:g}, " \
                f"not before marketing yields at {pause_above}"
    for channel in CHANNELS:
        assert thresholds[(channel, "marketing")] > thresholds[(channel, "transactional")], \
            f"{channel}: marketing scales on a smaller lag than transactional"


# ---------------------------------------------------------------------------------------------- disruptions


def test_deployment_selectors_select_their_own_pods_only():
    """Given the Deployments,
    When each selector is matched against every Deployment's pod labels,
    Then it selects its own pods and no other Deployment's."""
    for name, d in deployments().items():
        selector = d["spec"]["selector"]["matchLabels"]
        chosen = [other for other, o in deployments().items() if selects(selector, pod_labels(o))]
        assert chosen == [name], f"Deployment {name}: selector {selector} selects the pods of {chosen}"


@pytest.mark.parametrize("name", sorted(deployments()))
def test_every_deployment_has_its_own_disruption_budget_and_a_grace_period_longer_than_the_drain(name):
    """Given a Deployment,
    When the PodDisruptionBudgets are matched against its pods,
    Then exactly one selects them (a pod under two cannot be evicted), it selects no other
    Deployment's pods and lets one pod go at a time (a pod not ready always), and the pod's grace period is longer than
    KAFKA_DELIVERY_TIMEOUT_MS (so SIGKILL does not cut the drain short)."""
    d = deployments()[name]
    budgets = [b for b in of_kind("PodDisruptionBudget").values()
               if selects(b["spec"]["selector"]["matchLabels"], pod_labels(d))]
    assert len(budgets) == 1, f"Deployment {name}: {len(budgets)} PodDisruptionBudgets select its pods, expected 1"
    budget = budgets[0]
    others = [o for o, od in deployments().items() if o != name and selects(budget["spec"]["selector"]["matchLabels"], pod_labels(od))]
    assert not others, f"PodDisruptionBudget {budget['metadata']['name']} also selects {others}"
    assert budget["spec"].get("maxUnavailable") == 1, f"PodDisruptionBudget {budget['metadata']['name']}: {budget['spec']}"
    # A crash-looping pod (every copy failing) can be evicted: else a node drain waits on a budget never met.
    assert budget["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow", budget["metadata"]["name"]
    grace = pod_spec(d).get("terminationGracePeriodSeconds", 30)
    drain_bound = deployed_config().delivery_timeout_ms / 1000
    assert grace > drain_bound, f"Deployment {name}: terminationGracePeriodSeconds {grace} is not above {drain_bound:g} s"


def test_api_service_routes_to_the_api_pods():
    """Given the API Service,
    When its selector and target port are resolved,
    Then it selects exactly the API Deployment's pods, on a port its container declares."""
    services = of_kind("Service")
    assert list(services) == ["api"], f"expected the one Service api, got {list(services)}"
    svc = services["api"]
    chosen = [n for n, d in deployments().items() if selects(svc["spec"]["selector"], pod_labels(d))]
    assert chosen == ["api"], f"Service api selects the pods of {chosen}"
    declared = {p["name"] for p in container(deployments()["api"])["ports"]}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in declared, f"Service api targets {port['targetPort']}, the container declares {declared}"
