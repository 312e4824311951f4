"""What operators read and write is whole or refused: the audit trail never answers part of itself as all of it,
and a limit the gate could not hold exactly is refused by the CLI as by the API."""

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.cli import main
from streams.cli import operator as operator_cli
from streams.cli.operator import _clear_cool_down
from streams.errors import BrokerUnavailable, ConfigError, StoreUnavailable, StoreWriteUnknown
from streams.gate.limits import MAX_LIMIT, AppliedLimits, check_provider, check_tenant, parse_rate
from streams.providers.registry import load_registry
from streams.state import audit as audit_module


class StalledConsumer:
    """The audit partition holds 5 records, and its leader answers none of them (stalled after the watermarks)."""

    def __init__(self, config):
        pass

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, 5

    def assign(self, partitions):
        pass

    def consume(self, num_messages=1, timeout=0):
        return []

    def close(self):
        pass


def test_an_audit_trail_read_that_stalls_is_an_error_not_a_shorter_trail(monkeypatch):
    """Given an audit trail of 5 records whose partition stops answering after its watermarks are read,
    When it is read (the API's GET /v1/admin/audit, `streams audit`),
    Then the read fails saying how far it got (before: it ended quietly after 30 s with what it had, none here,
    which reads as "no change was made")."""
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(audit_module, "Consumer", StalledConsumer)
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: float(next(clock)))
    trail = audit_module.AuditLog.__new__(audit_module.AuditLog)  # its reader only: no producer
    trail.bootstrap, trail.topic = "unused:9092", "notif.audit"
    with pytest.raises(BrokerUnavailable, match=r"read to offset 0 of 5"):
        list(trail.read())


@pytest.mark.parametrize("rate, burst", [(1e8, MAX_LIMIT + 1), (1e16, 10), (parse_rate("1e301"), 10)])
def test_a_limit_past_what_the_gate_holds_exactly_is_refused_by_the_shared_check(rate, burst):
    """Given a burst past 2**53, a rate past it, or a rate of 1e301 a second (the gate's Lua works in doubles),
    When the CLI's (and the API's) check looks at it,
    Then it is refused naming the bound (before: the CLI accepted the first two, and the third ended in an
    OverflowError traceback)."""
    with pytest.raises(ConfigError, match="at most|from 1 to"):
        check_provider(rate, burst, 0)
    with pytest.raises(ConfigError, match="at most|from 1 to"):
        check_tenant("acme", rate, burst)


@pytest.mark.parametrize("provider", ["webhook", "ingest-request", "Resend"])
def test_the_cli_ends_no_cool_down_of_what_has_none_and_names_what_has_one(provider):
    """Given the packaged providers,
    When an operator asks the CLI to end the cool-down of the webhook provider (its 429s hold one endpoint), of an
    ingest quota, or of a misspelt provider,
    Then it is refused naming the providers that have one, and Redis is not asked (the same rule as the API's)."""
    rt = SimpleNamespace(config=SimpleNamespace(registry=load_registry()),
                         limit_store=lambda: pytest.fail("nothing may be ended"))
    with pytest.raises(ConfigError, match=rf"no provider-wide cool-down for '{provider}' "
                                          r"\(providers that have one: resend, sms, sms-b;"):
        _clear_cool_down(rt, provider)  # type: ignore[arg-type]


def test_a_cool_down_ended_with_milliseconds_left_is_not_said_to_have_had_none(capsys):
    """Given resend's cool-down with 30 ms left,
    When an operator ends it,
    Then the CLI says 0.030 s were left (before: "0.0 s were left", which reads as no cool-down at all)."""
    audited = []
    rt = SimpleNamespace(config=SimpleNamespace(registry=load_registry()),
                         limit_store=lambda: SimpleNamespace(clear_cool_down=lambda provider, tenant=None: 0.03),
                         audit_log=lambda: SimpleNamespace(record=lambda *record: audited.append(record)))
    assert _clear_cool_down(rt, "resend") == 0  # type: ignore[arg-type]
    assert "resend: cool-down ended (0.030 s were left)" in capsys.readouterr().out
    assert [what for _, what, _, _ in audited] == ["cooldown/resend"]


class LimitsThenRedisFails:
    """Applies a change (another operator's rate change of 10 to 15 landed before it), then Redis fails: the change's
    answer is lost (`lost`), or the cool-down read after it fails."""

    def __init__(self, lost: bool):
        self.lost = lost

    def apply(self, provider, change):
        if self.lost:
            raise StoreWriteUnknown("cannot write the limits of 'resend' (Timeout reading from socket, test)")
        return AppliedLimits({"global_rate": 15.0}, {"global_rate": 20.0})

    def cool_down_left(self, provider, tenant=None):
        raise StoreUnavailable("cannot read the provider cool-down (test)")


@pytest.mark.parametrize("lost", [False, True], ids=["cool-down-unreadable", "answer-lost"])
def test_a_limits_change_the_cli_made_is_on_the_audit_trail_though_redis_fails_after_it(lost, monkeypatch, capsys):
    """Given Redis failing right after an operator's limits change ran in it (the cool-down read after it failing,
    or the change's own answer lost),
    When the CLI makes the change,
    Then the audit trail has it, against the limits its write replaced, or as maybe applied with what was asked,
    and the command exits 1 saying why (before: the change was live, printed, and on no record at all)."""
    audited = []
    rt = SimpleNamespace(config=SimpleNamespace(registry=load_registry()),
                         limit_store=lambda: LimitsThenRedisFails(lost),
                         state_guard=lambda role: SimpleNamespace(check=lambda force=False: True),  # Redis holds its data
                         audit_log=lambda: SimpleNamespace(record=lambda *record: audited.append(record[1:])))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["limits", "set", "--provider", "resend", "--global-rate", "20"]) == 1
    printed = capsys.readouterr()
    if lost:
        assert audited == [("limits/resend", None, {"outcome": "unknown", "intended": {"global_rate": 20.0}})]
        assert "Timeout reading from socket" in printed.err
    else:
        assert audited == [("limits/resend", {"global_rate": 15.0}, {"global_rate": 20.0})]
        assert "resend global_rate = 20.0" in printed.out and "cannot read the provider cool-down" in printed.err


class SendersRedisLost:
    """Sender domains of acme set by an operator, in a store whose writes Redis does not answer (applied, perhaps)."""

    setting = SimpleNamespace(by_tenant={}, enforced=True)

    def stored(self):
        return {"acme": ["acme.com"]}

    def set(self, tenant, domains):
        raise StoreWriteUnknown("cannot write the sender domains of 'acme' (Timeout reading from socket, test)")

    def remove(self, tenant):
        raise StoreWriteUnknown("cannot remove the sender domains of 'acme' (Timeout reading from socket, test)")


@pytest.mark.parametrize("argv, intended", [(["senders", "remove", "--tenant", "acme"], None),
                                            (["senders", "set", "--tenant", "acme", "--domains", "acme.io"],
                                             ["acme.io"])])
def test_a_sender_change_whose_answer_redis_lost_is_audited_as_maybe_applied(argv, intended, monkeypatch, capsys):
    """Given Redis applying an operator's sender-domains change and losing its answer,
    When the CLI makes it, Then it exits 1 saying why, and the audit trail has it as maybe applied with what was asked
    (before: on no record, and a rerun of the removal found nothing to remove: never audited)."""
    audited = []
    rt = SimpleNamespace(sender_store=lambda: SendersRedisLost(),
                         audit_log=lambda: SimpleNamespace(record=lambda *record: audited.append(record[1:])))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(argv) == 1
    assert "Timeout reading from socket" in capsys.readouterr().err
    assert audited == [("senders/acme", ["acme.com"], {"outcome": "unknown", "intended": intended})]


def test_a_change_interrupted_while_its_audit_record_is_written_says_so(monkeypatch, capsys):
    """Ctrl-C while the audit record of a change already made is written: a warning that it may be missing, exit 4
    (before: exit 130, nothing said, the change live and perhaps on no record)."""
    def interrupted(*record):
        raise KeyboardInterrupt

    store = SimpleNamespace(setting=SimpleNamespace(by_tenant={}, enforced=True), stored=lambda: {},
                            set=lambda tenant, domains: domains)
    rt = SimpleNamespace(sender_store=lambda: store, audit_log=lambda: SimpleNamespace(record=interrupted))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["senders", "set", "--tenant", "acme", "--domains", "acme.io"]) == 4
    assert "interrupted while its audit record was written" in capsys.readouterr().err


def test_a_broker_failure_no_layer_named_is_an_error_line_not_a_traceback(monkeypatch, capsys):
    def broker_down():
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "127.0.0.1:9092: Connection refused"))

    monkeypatch.setattr(operator_cli, "Runtime", lambda config: SimpleNamespace(sender_store=broker_down))
    assert main(["senders", "list"]) == 1
    assert capsys.readouterr().err.startswith("error: the message broker failed: ")


class KeyDeletedMeanwhile:
    """An API key read, then gone before its revocation (deleted by another operator, or Redis lost it)."""

    def get(self, key_id):
        return SimpleNamespace(key_id=key_id)

    def revoke(self, key_id):
        return None


def test_a_cli_command_that_did_nothing_says_so_and_exits_non_zero(monkeypatch, capsys):
    """Given an operator,
    When a key gone since it was read is revoked, or the dead letters are listed with a limit of 0,
    Then each is an error naming what is wrong, exit code not 0, nothing audited (before: "revoked" and exit 0 with
    nothing revoked; an empty list as if the DLQ were empty)."""
    audited = []
    rt = SimpleNamespace(api_keys=lambda: KeyDeletedMeanwhile(),
                         audit_log=lambda: SimpleNamespace(record=lambda *record: audited.append(record)))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["keys", "revoke", "0123456789ab", "--yes"]) == 1
    printed = capsys.readouterr()
    assert "no API key 0123456789ab" in printed.err and "revoked" not in printed.out and audited == []
    with pytest.raises(SystemExit) as exit_:
        main(["dlq", "list", "--limit", "0"])
    assert exit_.value.code == 2 and "'0' is not a number from 1 to 1000" in capsys.readouterr().err


class EndpointWritesUnanswered:
    """Tenant acme's endpoint ep_1, in a store whose writes Redis does not answer (applied, perhaps)."""

    def __init__(self):
        from streams.webhooks.model import Endpoint

        self.endpoint = Endpoint(id="ep_1", tenant="acme", url="https://hooks.example/x?token=t0k", event_types=("*",),
                                 description="", enabled=True, state="active", state_reason="", secrets=())
        self.endpoints = self
        self.directory = SimpleNamespace(catch_up=lambda: None)

    def current(self, ep):
        return ep

    def get(self, tenant, endpoint_id):
        return self.endpoint

    def _unanswered(self, *args, **kwargs):
        raise StoreWriteUnknown("cannot write endpoint ep_1 (Timeout reading from socket, test)")

    rotate_secret = update = set_active = _unanswered


@pytest.mark.parametrize("action, intended", [("rotate", {"secret": "rotated"}), ("disable", {"enabled": False}),
                                              ("reactivate", {"state": "active"})])
def test_an_endpoint_change_whose_answer_redis_lost_is_audited_as_maybe_applied(action, intended, monkeypatch,
                                                                               capsys):
    """Given tenant acme's endpoint, in a Redis that runs a change and loses its answer,
    When an operator rotates its secret, disables or reactivates it from the CLI,
    Then the command exits 1 saying why, and the audit trail has the change as maybe applied, without the URL
    (before: nothing on the trail, though a rotated secret or a state change may be live)."""
    audited = []
    hooks = EndpointWritesUnanswered()
    rt = SimpleNamespace(redis=lambda: SimpleNamespace(register_script=lambda script: None), namespace="",
                         config=SimpleNamespace(webhook_secret_keys=object()),  # the shell has the sealing keys
                         send_client=lambda: None,
                         webhook_ingest=lambda *args: hooks,
                         audit_log=lambda: SimpleNamespace(record=lambda *record: audited.append(record[1:])))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["endpoints", action, "ep_1", "--tenant", "acme"]) == 1
    assert "Timeout reading from socket" in capsys.readouterr().err
    [(what, before, after)] = audited
    assert (what, after["outcome"]) == ("endpoint/ep_1", "unknown")
    assert after["intended"] == {**before, **intended} and "t0k" not in str(audited)


def test_the_cli_names_a_user_without_a_name_by_its_uid(monkeypatch):
    """Given a CLI process whose user has no name (an arbitrary uid with no passwd entry, no USER nor LOGNAME),
    When an operator change is recorded on the audit trail,
    Then its actor is `cli:uid:<n>@<host>` (before: getpass raised KeyError after the change was made: a traceback,
    exit 1, and a `keys create` run again made a second key)."""
    import getpass
    import os

    from streams.state.audit import cli_actor

    def nameless() -> str:
        raise KeyError("getpwuid(): uid not found: 12345")

    monkeypatch.setattr(getpass, "getuser", nameless)
    assert cli_actor().startswith(f"cli:uid:{os.getuid()}@")


class KeysNeverAsked:
    """An API key store no command may reach (the command must stop first)."""

    def __getattr__(self, name):
        raise AssertionError(f"the key store was asked ({name})")


@pytest.mark.parametrize("action", ["revoke", "rotate"])
@pytest.mark.parametrize("pasted", ["{token}", " {token}", "'{token}'"])
def test_a_key_pasted_for_its_id_is_never_printed_back(action, pasted, monkeypatch, capsys):
    """Given an operator who pastes a tenant's API key where its id belongs (as it is, after a space, in quotes),
    When the key is to be revoked or rotated,
    Then the command exits 1 saying a key id is 12 hex digits, nothing is changed, and the key itself is printed
    nowhere (before: `error: no API key dr_ten_...`, a live credential on stderr, in a terminal's or a CI's log)."""
    token = "dr_ten_" + "k3y" * 12
    rt = SimpleNamespace(api_keys=lambda: KeysNeverAsked(), audit_log=lambda: KeysNeverAsked())
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["keys", action, pasted.format(token=token)]) == 1
    printed = capsys.readouterr()
    assert "k3yk3y" not in printed.out + printed.err
    assert f"`streams keys {action}` takes a key's id (12 hex digits" in printed.err
    assert "nothing was changed" in printed.err


def test_a_send_missing_while_redis_has_lost_its_data_is_not_called_missing(monkeypatch, capsys):
    """Given Redis that has lost its data, `streams state recover` not finished,
    When an operator looks a send up (`streams sends show`) and its status is not there,
    Then the command exits 1 saying Redis lost its data and the send may well exist (before: "no send X", as the API
    answered 503 for the same read)."""
    from streams.ingest.status import StatusStore

    monkeypatch.setattr(StatusStore, "get", lambda self, send_id: None)
    intact = [False]
    rt = SimpleNamespace(redis=lambda: SimpleNamespace(register_script=lambda script: None), namespace="",
                         state_guard=lambda role, client: SimpleNamespace(check=lambda: intact[0]))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["sends", "show", "s-1"]) == 1
    assert ("send s-1 is not in Redis, which has lost its data (or cannot say whether it has), and `streams state "
            "recover` has not finished: the send may well exist") in capsys.readouterr().err
    intact[0] = True
    assert main(["sends", "show", "s-1"]) == 1
    assert "no send s-1 (its history is kept 30 days)" in capsys.readouterr().err


class DegradedEndpoint(EndpointWritesUnanswered):
    """Tenant acme's endpoint ep_1, configured active and enabled, that the endpoint-health app calls degraded (it
    has not read a reset yet); its writes are answered."""

    def current(self, ep):
        from dataclasses import replace

        return replace(ep, state="degraded", state_reason="10 consecutive failures")

    def set_active(self, tenant, endpoint_id):
        return self.endpoint

    def update(self, tenant, endpoint_id, **changes):
        return self.endpoint

    def reset_health(self, tenant, endpoint_id):
        pass


@pytest.mark.parametrize("action", ["reactivate", "enable"])
def test_an_endpoint_changed_from_the_cli_is_shown_in_its_state_the_api_shows(action, monkeypatch, capsys):
    """Given tenant acme's endpoint, configured active, that the endpoint-health app still calls degraded,
    When an operator reactivates or enables it from the CLI,
    Then the endpoint printed is degraded, as the API shows it and as a replay meets it, and a reactivation says it
    takes deliveries once the health app has read the reset (before: `"state": "active"`, and a replay run right
    after was refused as the endpoint is degraded)."""
    import orjson

    hooks = DegradedEndpoint()
    rt = SimpleNamespace(redis=lambda: SimpleNamespace(register_script=lambda script: None), namespace="",
                         config=SimpleNamespace(webhook_secret_keys=object()), send_client=lambda: None,
                         webhook_ingest=lambda *args: hooks,
                         audit_log=lambda: SimpleNamespace(record=lambda *record: None))
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(["endpoints", action, "ep_1", "--tenant", "acme"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert (shown["id"], shown["state"]) == ("ep_1", "degraded")
    assert ("once the endpoint-health app has read the reset" in shown.get("note", "")) == (action == "reactivate")
    if action == "reactivate":  # one its tenant disabled stays so: the note says it
        from dataclasses import replace

        hooks.endpoint = replace(hooks.endpoint, enabled=False)
        assert main(["endpoints", action, "ep_1", "--tenant", "acme"]) == 0
        assert "it receives deliveries once enabled" in orjson.loads(capsys.readouterr().out)["note"]


@pytest.mark.parametrize("command, says", [
    (["keys", "revoke", "0123456789ab"], "`streams keys revoke` stops key 0123456789ab working at once"),
    (["keys", "rotate", "0123456789ab", "--overlap", "0"], "(rotate with an --overlap keeps the old key working"),
    (["endpoints", "delete", "ep_1", "--tenant", "acme"], "deletes endpoint ep_1 of tenant acme for good"),
])
def test_a_change_that_cannot_be_undone_is_made_only_when_the_operator_says_yes(command, says, monkeypatch, capsys):
    """Given an operator,
    When a key is revoked or rotated with no overlap, or an endpoint deleted, without --yes,
    Then the command exits 1 saying what would be lost and to say --yes, and nothing is asked of any store (before:
    done at once; a mistyped id deleted another endpoint and skipped its deliveries for good)."""
    rt = SimpleNamespace(api_keys=lambda: KeysNeverAsked(), audit_log=lambda: KeysNeverAsked(),
                         redis=lambda: KeysNeverAsked(), webhook_ingest=lambda *args: KeysNeverAsked(),
                         config=SimpleNamespace(webhook_secret_keys=object()), send_client=lambda: None, namespace="")
    monkeypatch.setattr(operator_cli, "Runtime", lambda config: rt)
    assert main(command) == 1
    err = capsys.readouterr().err
    assert says in err and "say --yes. Nothing was changed" in err
