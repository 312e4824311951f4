"""The runbook (docs/runbook.md) and the alert rules stay in step: every alert links to its own
section, no section outlives its alert, every `streams ...` command it names is a real one, and its
retry policy table says what streams/retry/policies.toml says."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from streams.cli import build_parser
from streams.retry.policy import JITTER, load_policies, load_routing

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "runbook.md"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
RUNBOOK_URL = "https://github.com/dual-rail/dispatch/blob/main/docs/runbook.md#"
PARTS = ("**What it means.**", "**How to confirm.**", "**What to do.**", "**What not to do.**")
# Placeholders a command may use, and a value the parser accepts for each; any other <...> becomes "x".
PLACEHOLDERS = {"<channel>": "email", "<lane>": "transactional", "<provider>": "resend", "<tier>": "1m",
                "<port>": "9100", "<limit>": "10", "<unix_ms>": "1700000000000"}
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_WORST_UNIT_S = {"min": 60, "h": 3600}


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def without_code_blocks(text: str) -> str:
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)


def sections(text: str) -> dict[str, str]:
    """`## ` heading -> the text up to the next one (headings inside code blocks do not count)."""
    found: dict[str, str] = {}
    current: str | None = None
    body: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            if current is not None:
                found[current] = "\n".join(body)
            current, body = line[3:].strip(), []
        elif current is not None:
            body.append(line)
    if current is not None:
        found[current] = "\n".join(body)
    return found


def alert_rules() -> dict[str, dict]:
    """Alert name -> its annotations."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r.get("annotations", {}) for g in groups for r in g["rules"] if "alert" in r}


def runbook_commands(text: str) -> list[str]:
    """Every `streams ...` command written in a code block line or an inline code span."""
    commands = []
    for block in re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M):
        for line in block.splitlines():
            m = re.match(r"\s*(?:\$\s+)?(?:\.venv/bin/)?(streams\s.*)$", line)
            if m:
                commands.append(m.group(1))
    for span in re.findall(r"`([^`]+)`", without_code_blocks(text)):
        m = re.match(r"(?:\.venv/bin/)?(streams\s.*)$", span.strip(), flags=re.S)
        if m:
            commands.append(m.group(1))
    return commands


def argv_of(command: str) -> list[str]:
    filled = re.sub(r"<[^>]+>", lambda m: PLACEHOLDERS.get(m.group(0), "x"), command)
    words = shlex.split(filled, comments=True)
    assert words[0] == "streams", command
    return words[1:]


def retry_table(text: str) -> dict[str, dict[str, str]]:
    """The `Retry policies` section's table: policy name -> {column header: cell}."""
    rows = [line.strip().strip("|").split("|") for line in sections(text)["Retry policies"].splitlines()
            if line.strip().startswith("|")]
    header = [c.strip() for c in rows[0]]
    table = {}
    for row in rows[1:]:
        cells = [c.strip() for c in row]
        if set("".join(cells)) <= {"-", ":", " "}:
            continue  # the separator row
        record = dict(zip(header, cells, strict=True))
        table[record["policy"].strip("`")] = record
    return table


def test_every_alert_links_to_its_own_runbook_section():
    """Given the alert rules in deploy/prometheus/alerts.yml and the runbook's `## ` sections,
    When each rule's runbook_url annotation is read,
    Then it points at the runbook on main, at the anchor of the section named after that alert, and that
    section says what the alert means, how to confirm it, what to do and what not to do."""
    alerts = alert_rules()
    assert alerts, "no alert rules found: the parser is broken"
    found = sections(RUNBOOK.read_text())
    anchors = {github_anchor(h): h for h in found}
    for name, annotations in alerts.items():
        url = annotations.get("runbook_url", "")
        assert url.startswith(RUNBOOK_URL), f"{name}: runbook_url {url!r} does not point at docs/runbook.md"
        anchor = url.removeprefix(RUNBOOK_URL)
        assert anchor in anchors, f"{name}: #{anchor} is not a `## ` section of docs/runbook.md"
        assert anchors[anchor] == name, f"{name}: #{anchor} is the section {anchors[anchor]!r}, not the alert's own"
        missing = [p for p in PARTS if p not in found[name]]
        assert not missing, f"section {name} lacks {missing}"


def test_the_runbooks_own_links_resolve():
    """Given the runbook's links to its own sections ([text](#anchor)),
    When each anchor is looked up among its headings,
    Then every one exists (a renamed section leaves no dead link)."""
    text = without_code_blocks(RUNBOOK.read_text())
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "no links found: the parser is broken"
    assert not sorted(set(links) - anchors), f"links to missing sections: {sorted(set(links) - anchors)}"


def test_no_runbook_section_outlives_its_alert():
    """Given the runbook's `## ` sections,
    When a section is named like an alert (one CamelCase word),
    Then an alert rule of that name exists (a renamed or removed alert leaves no stale section)."""
    alerts = set(alert_rules())
    named_like_alerts = [h for h in sections(RUNBOOK.read_text()) if re.fullmatch(r"[A-Z][A-Za-z0-9]+", h)]
    assert named_like_alerts, "no alert sections found: the parser is broken"
    stale = sorted(set(named_like_alerts) - alerts)
    assert not stale, f"runbook sections without an alert rule: {stale}"


def test_every_streams_command_in_the_runbook_is_real():
    """Given every `streams ...` command the runbook writes in a code block or an inline code span,
    When the real `streams` argument parser parses it (placeholders such as <send_id> filled in),
    Then none is refused: a command, subcommand, option or choice that does not exist fails the test."""
    commands = runbook_commands(RUNBOOK.read_text())
    assert len(commands) >= 10, f"only {len(commands)} commands found: the parser is broken"
    parser = build_parser()
    refused = []
    for command in commands:
        try:
            parser.parse_args(argv_of(command))
        except SystemExit:
            refused.append(command)
    assert not refused, f"not real `streams` commands: {refused}"


@pytest.mark.parametrize("command", ["streams dlq replay-all", "streams state reset", "streams limits set",
                                     "streams endpoints reactivate <endpoint_id>", "streams workers --lane x"])
def test_the_command_check_refuses_commands_that_do_not_exist(command):
    """Given a command that does not exist or lacks a required option,
    When the check parses it,
    Then the parser refuses it, so a runbook naming it would fail."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv_of(command))


def test_retry_policy_table_matches_policies_toml():
    """Given the runbook's retry policy table and the packaged policies (load_policies, load_routing),
    When each row is compared with its policy,
    Then every policy has exactly one row, and its attempts, tiers, jitter, max age, worst case and the
    sends routed to it are the file's."""
    policies = load_policies()
    table = retry_table(RUNBOOK.read_text())
    assert set(table) == set(policies), f"table {sorted(table)} != policies {sorted(policies)}"
    for name, policy in policies.items():
        row = table[name]
        assert int(row["attempts"]) == policy.max_attempts, name
        age = re.fullmatch(r"(\d+)([smhd])", row["max age"])
        assert age and int(age.group(1)) * _UNIT_S[age.group(2)] == policy.max_age_s, name
        assert [t.strip() for t in row["retry tiers"].split(",")] == list(policy.schedule), name
        assert row["jitter"] == f"±{round(JITTER * 100)}%", name
        worst = re.fullmatch(r"([\d.]+) (min|h)", row["worst case to the last attempt"])
        assert worst and float(worst.group(1)) == round(policy.worst_case_s() / _WORST_UNIT_S[worst.group(2)], 1)
    routing = load_routing()
    for pattern, policy_name in routing.templates:
        assert f"`{pattern}`" in table[policy_name]["used by"], f"template {pattern} -> {policy_name}"
    for key, policy_name in {**routing.categories, **routing.channels}.items():
        assert f"`{key}`" in table[policy_name]["used by"], f"{key} -> {policy_name}"
