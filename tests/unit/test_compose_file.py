"""docker-compose.yml checked against the code (no Docker engine here runs it): the whole fleet is there, marketing
copies weigh as little as nice 10, and every provider gets its limits, with commands the real parser takes."""

import shlex
from pathlib import Path

import yaml

from streams.cli import build_parser
from streams.lanes import CHANNELS, LANES
from streams.providers.registry import load_registry

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_every_lane_has_its_worker_and_retrier_and_marketing_weighs_as_nice_10():
    """Given the compose file,
    When its services are read,
    Then every channel's two lanes have a worker and a retrier running that lane (before: SMS had none, nor
    webhook marketing, though the README says it starts the whole fleet), and the marketing ones have
    cpu_shares 110 (nice 10's weight: inside a container nice weighs only against the container's own)."""
    found = services()
    for channel in CHANNELS:
        for lane in LANES:
            for role in ("worker", "retrier"):
                service = found[f"{role}-{channel}-{lane}"]
                assert service["command"][:5] == [role, "--channel", channel, "--lane", lane], service
                assert service.get("cpu_shares") == (110 if lane == "marketing" else None), (role, channel, lane)


def test_every_provider_gets_its_limits_with_commands_the_parser_takes():
    """Given the compose file's one-shot `limits` service,
    When its commands are parsed by the real `streams` parser,
    Then each parses, and every provider of providers.toml gets a global and a `*` tenant limit (before: no
    limits at all, so no worker sent anything)."""
    [script] = services()["limits"]["command"]
    parser = build_parser()
    limits = [parser.parse_args(shlex.split(c.strip())[1:]) for c in script.split("&&")]
    providers = {spec.name for channel in CHANNELS for spec in load_registry().for_channel(channel)}
    assert {a.provider for a in limits if a.global_rate is not None} == providers
    assert {a.provider for a in limits if a.tenant == "*" and a.rate is not None} == providers


def test_prometheus_scrapes_every_service_that_serves_metrics():
    """Given the compose file and the Prometheus configuration it mounts,
    When the services that serve /metrics (`--metrics-port`) are set against the scrape targets,
    Then every one is scraped at its port (before: the SMS lanes and webhook marketing, added to the fleet later,
    were not, so their workers and retriers showed nothing on the dashboard and raised no alert)."""
    config = yaml.safe_load((COMPOSE.parent / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for group in job.get("static_configs", []) for t in group["targets"]}
    # every copy of a scaled role, found by DNS
    targets |= {f"{name}:{sd['port']}" for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])
                for name in sd["names"]}
    serving = {f"{name}:{s['command'][s['command'].index('--metrics-port') + 1]}"
               for name, s in services().items() if "--metrics-port" in (s.get("command") or [])}
    assert serving and serving <= targets, sorted(serving - targets)


def test_every_long_running_role_is_restarted_and_redis_keeps_an_append_only_file():
    """Given the compose file,
    When its services are read,
    Then every long-running one (not the one-shot topics and limits jobs) restarts when it exits (a role re-raises
    a broker error and exits: it stayed down) and is given 90 s to stop (a worker drains what is in flight first:
    Docker's default 10 s killed it midway), and Redis runs with an append-only file written every second and no
    eviction, as the README requires (a restored snapshot keeps its epoch, so a rollback of delivered marks would
    go unseen: sends sent again)."""
    for name, service in services().items():
        if name not in ("topics", "limits", "kafka", "redis", "prometheus", "grafana"):
            assert service.get("restart") == "unless-stopped", name
            assert service.get("stop_grace_period") == "90s", name
    command = services()["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes" and "everysec" in command and "noeviction" in command
