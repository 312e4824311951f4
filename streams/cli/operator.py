"""Operator tasks: topics as code, rate limits, API keys and dead letters."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..errors import (
    AuditUnconfirmed,
    ConfigError,
    PublishError,
    ReplayOutcomeUnknown,
    SendValidationError,
    StoreUnavailable,
    StoreWriteUnknown,
)
from ..gate.limits import cool_down_ended, cool_down_subject
from ..runtime import Runtime
from ..send import check_tenant_id

if TYPE_CHECKING:
    from ..send import Send
    from ..webhooks.model import Endpoint


def _audited(rt: Runtime, what: str, before: object, after: object) -> None:
    """Record an operator change, applied already and its result printed, on the audit trail as
    `cli:<user>@<host>`. Printed first so that a record the broker does not confirm never hides what
    was done (a new key's token, a replay's send id): the command then warns and exits 4."""
    from ..state.audit import cli_actor

    try:
        rt.audit_log().record(cli_actor(), what, before, after)
    except PublishError as exc:
        raise AuditUnconfirmed(f"{what} was applied, but the audit trail did not confirm its record ({exc}); "
                               "it may be missing from `streams audit`") from None
    except KeyboardInterrupt:  # the change is made: said, not a silent exit 130
        raise AuditUnconfirmed(f"{what} was applied, but the command was interrupted while its audit record was "
                               "written; it may be missing from `streams audit`") from None


def _audited_maybe(rt: Runtime, what: str, before: object, intended: object) -> None:
    """A change whose store or broker did not answer: it may have been applied, and is on the audit trail as such,
    best effort (a record the broker does not confirm is only warned of)."""
    try:
        _audited(rt, what, before, {"outcome": "unknown", "intended": intended})
    except AuditUnconfirmed as unconfirmed:
        print(f"warning: {unconfirmed}", file=sys.stderr)


@contextlib.contextmanager
def _audited_if_unanswered(rt: Runtime, what: str, before: object, intended: object) -> Iterator[None]:
    """A change whose write Redis did not answer (StoreWriteUnknown) may be live: audited as maybe applied, then its
    error ends the command (exit 1). Left unaudited, a rerun finds nothing to change and records nothing either."""
    try:
        yield
    except StoreWriteUnknown:
        _audited_maybe(rt, what, before, intended)
        raise


def topics(sub) -> None:
    p = sub.add_parser("topics", help="declarative topics in topics/*.toml")
    p.add_argument("action", choices=["plan", "apply"])
    p.add_argument("--dir", help="definition folder (default: the repository's topics/)")
    p.add_argument("--namespace", default=None, help="prefix for every topic name (default: "
                   "DUAL_RAIL_TOPIC_NAMESPACE; isolates test runs)")
    p.add_argument("--profile", choices=["dev", "cluster"], default=None,
                   help="replication profile: dev (1 replica), cluster (3 replicas, min.insync.replicas=2) "
                        "(default: DUAL_RAIL_TOPIC_PROFILE, else as topics/*.toml say)")

    def run(args: argparse.Namespace) -> int:
        from ..names import TopicNames
        from ..retry.policy import check_tiers_keep_copies, load_policies
        from ..topology.admin import TopicAdmin
        from ..topology.spec import load_definitions, plan, topics_dir

        config = args.config
        namespace = config.namespace if args.namespace is None else args.namespace
        specs = load_definitions(topics_dir(args.dir), namespace=namespace,
                                 profile=args.profile or config.topic_profile)
        # Before anything is planned: a tier keeping copies less long than a policy parks them would lose them.
        check_tiers_keep_copies(load_policies(config.retry_policies_path), specs, TopicNames(namespace))
        admin = TopicAdmin(config.bootstrap)
        changes = plan(specs, admin.state(list(specs)))
        if args.action == "plan":
            for change in changes:
                print(change)
            print(f"{len(specs)} topics defined, {len(changes)} change(s) pending")
            return 2 if changes else 0
        refused = [c for c in changes if c.kind == "refused"]
        if refused:
            for change in refused:
                print(change, file=sys.stderr)
            print("nothing applied: fix the definitions or the cluster first", file=sys.stderr)
            return 1
        admin.apply(changes, specs)
        for change in changes:
            print(change)
        print(f"{len(specs)} topics defined, {len(changes)} change(s) applied")
        return 0

    p.set_defaults(func=run)


def _rate(text: str) -> float:
    from ..gate.limits import parse_rate

    try:
        return parse_rate(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listed(text: str) -> int:
    """How many to list: 1 to 1,000, as the operator API's `limit` (0 or fewer listed nothing, without a word)."""
    if not text.isdigit() or not 1 <= int(text) <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 1 to 1000")
    return int(text)


def limits(sub) -> None:
    p = sub.add_parser("limits", help="operator: provider and tenant rate limits (in Redis)")
    p.add_argument("action", choices=["set", "unset", "show", "clear-cooldown"],
                   help="unset: remove --tenant's own limit (it is held to the default '*' again); "
                        "clear-cooldown: end the provider-wide hold a 429 set (its Retry-After, up to a day: a quota "
                        "429's reset), once the provider takes requests again, e.g. its quota was raised; with "
                        "--tenant, the hold of that tenant's own account at the provider")
    p.add_argument("--provider", required=True, help="a provider of providers.toml (resend, sms, sms-b, webhook), "
                                                     "or an ingest quota (ingest-requests, ingest-transactional, "
                                                     "ingest-marketing)")
    p.add_argument("--global-rate", type=_rate, help="provider requests a second (its real limit); or a count per "
                                                    "unit: 30/min, 100/h, 500/day")
    p.add_argument("--global-burst", type=int)
    p.add_argument("--reserve", type=int, help="global tokens marketing may not take (kept for transactional)")
    p.add_argument("--tenant", help="tenant id, or '*' for the default")
    p.add_argument("--rate", type=_rate, help="tenant messages a second (0.5: one every 2 s); or a count per unit: "
                                               "30/min, 100/h, 500/day")
    p.add_argument("--burst", type=int)
    p.add_argument("--concurrency", type=int,
                   help="pacing: requests in flight per worker to this provider (0: providers.toml's)")
    p.add_argument("--pause-ms", type=int, help="pacing: the least pause between request waves (0: none)")

    def run(args: argparse.Namespace) -> int:
        from ..gate.limits import LimitChange

        rt = Runtime(args.config)
        from ..ingest.quotas import QUOTAS

        known = [*rt.config.registry.providers, *QUOTAS]
        if args.provider not in known:
            raise ConfigError(f"no provider or quota {args.provider!r} (known: {', '.join(known)})")
        if args.action == "clear-cooldown":
            return _clear_cool_down(rt, args.provider, args.tenant)
        store = rt.limit_store()
        changing = args.action in ("set", "unset")
        if not changing:
            shown = store.show(args.provider)
        else:
            if args.action == "unset":
                if args.tenant is None:
                    raise ConfigError("limits unset needs --tenant: the tenant whose own limit is removed")
                others = ("global_rate", "global_burst", "reserve", "rate", "burst", "concurrency", "pause_ms")
                given = [f"--{n.replace('_', '-')}" for n in others if getattr(args, n) is not None]
                if given:
                    raise ConfigError(f"limits unset takes --provider and --tenant only, not {', '.join(given)}")
                change = LimitChange(unset_tenant=args.tenant)
            else:
                change = LimitChange(args.global_rate, args.global_burst, args.reserve, args.tenant, args.rate,
                                     args.burst, args.concurrency, args.pause_ms)
            # A change is merged with the limits Redis holds and logged whole: Redis having lost its data (no role
            # has looked yet), it would log this change alone and the provider's other limits would be gone from
            # the log. The guard's look rebuilds them first (and fails the command when it cannot tell).
            rt.state_guard("cli").check(force=True)
            with _audited_if_unanswered(rt, f"limits/{args.provider}", None,
                                        {k: v for k, v in asdict(change).items() if v is not None}):
                before, shown, changed = store.apply(args.provider, change)
        for key, value in shown.items():
            print(f"{args.provider} {key} = {value}")
        if changing and not changed:  # nothing to change (a tenant without a limit of its own: a typo?)
            print(f"{args.provider}: nothing changed" + (f" (tenant {args.tenant} has no limit of its own)"
                                                          if args.action == "unset" else ""), file=sys.stderr)
        elif changing:  # recorded before the cool-down is read: a failure of that read fails nothing made
            _audited(rt, f"limits/{args.provider}", before, shown)
        _print_cool_downs(store, args.provider, args.tenant, rt.config.registry.providers)
        return 0

    p.set_defaults(func=run)


def _print_cool_downs(store, provider: str, tenant: str | None, providers) -> None:
    """What is left of the provider's 429 hold, and of `tenant`'s own account's."""
    if provider in providers and (left := store.cool_down_left(provider)):
        print(f"{provider} cool_down_left_s = {_seconds(left)}  (a 429's hold on every worker; "
              "`streams limits clear-cooldown` ends it)")
    if tenant not in (None, "*") and provider in providers and (left := store.cool_down_left(provider, tenant)):
        print(f"{provider} tenant {tenant} own_account_hold_s = {_seconds(left)}  (a 429 of "
              f"its own account; `streams limits clear-cooldown --tenant {tenant}` ends it)")


def _seconds(left: float) -> str:
    """A cool-down's seconds left, never shown as 0.0 while some is left."""
    return f"{left:.1f}" if left >= 0.1 else f"{left:.3f}"


def _clear_cool_down(rt: Runtime, provider: str, tenant: str | None = None) -> int:
    """End a provider's cool-down (`tenant`: that of the tenant's own account there); workers holding on it ask
    the gate again within seconds."""
    if provider not in (names := rt.config.registry.with_cool_down()):
        raise ConfigError(f"no provider-wide cool-down for {provider!r} (providers that have one: {', '.join(names)}; "
                          "an ingest quota has none, and a webhook endpoint's 429 holds only that endpoint)")
    tenant = None if tenant == "*" else tenant  # the default tenant's account is the shared one
    named = provider + (f" (tenant {tenant}'s own account)" if tenant else "")
    try:
        left = rt.limit_store().clear_cool_down(provider, tenant)
    except StoreUnavailable as exc:  # Redis may have ended it before its answer was lost
        print(f"error: {exc}", file=sys.stderr)
        _audited_maybe(rt, cool_down_subject(provider, tenant), None, {"cool_down_left_s": 0})
        return 1
    print(f"{named}: cool-down ended ({_seconds(left)} s were left)" if left else f"{named}: no cool-down" + (
        f" (a tenant sending under the shared account is held by {provider}'s own: clear-cooldown without --tenant)"
        if tenant else ""))
    if left:
        _audited(rt, *cool_down_ended(provider, left, tenant))
    return 0


def senders(sub) -> None:
    p = sub.add_parser("senders", help="operator: the domains each tenant may send email from")
    p.add_argument("action", choices=["list", "set", "remove"])
    p.add_argument("--tenant", help="set, remove: a tenant id, or '*' for tenants without an entry of their own")
    p.add_argument("--domains", help="set: comma-separated domains (subdomains included; empty: no email)")

    def run(args: argparse.Namespace) -> int:
        rt = Runtime(args.config)
        store = rt.sender_store()
        if args.action == "list":
            stored = store.stored()
            for tenant, domains in stored.items():
                print(f"{tenant}  {', '.join(domains) or '(no email)'}  [operator]")
            for tenant, defaults in sorted(store.setting.by_tenant.items()):
                if tenant not in stored:
                    print(f"{tenant}  {', '.join(sorted(defaults)) or '(no email)'}  [SENDER_DOMAINS]")
            if not stored and not store.setting.enforced:
                print("no sender domains set: any sender is accepted")
            return 0
        if not args.tenant:
            raise ConfigError(f"`streams senders {args.action}` needs --tenant")
        before = store.stored().get(args.tenant)
        if args.action == "set":
            if args.domains is None:
                raise ConfigError("`streams senders set` needs --domains (comma-separated; '' for no email)")
            domains = [d.strip() for d in args.domains.split(",") if d.strip()]
            with _audited_if_unanswered(rt, f"senders/{args.tenant}", before, domains):
                after = store.set(args.tenant, domains)
            print(f"{args.tenant}  {', '.join(after) or '(no email)'}")
            _audited(rt, f"senders/{args.tenant}", before, after)
            return 0
        with _audited_if_unanswered(rt, f"senders/{args.tenant}", before, None):
            removed = store.remove(args.tenant)
        if not removed:
            raise ConfigError(f"no sender domains set by an operator for {args.tenant!r}")
        print(f"removed {args.tenant}'s sender domains (SENDER_DOMAINS applies again)")
        _audited(rt, f"senders/{args.tenant}", before, None)
        return 0

    p.set_defaults(func=run)


def _unconfirmed(command: str, consequence: str) -> ConfigError:
    """The refusal of a change that cannot be undone, asked without --yes: what it would do, and that nothing was."""
    return ConfigError(f"`{command}` {consequence}: say --yes. Nothing was changed")


KEY_ID = re.compile(r"[0-9a-f]{12}")  # what `streams keys list` names a key by (ingest/api_keys.py key_id)


def keys(sub) -> None:
    p = sub.add_parser("keys", help="operator: ingest API keys (create, list, revoke, rotate)")
    p.add_argument("action", choices=["create", "list", "revoke", "rotate"])
    p.add_argument("key_id", nargs="?", help="revoke / rotate: the key's id (from `streams keys list`)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--tenant", help="create: a tenant key; list: only this tenant's")
    who.add_argument("--operator", action="store_true", help="create: an operator key")
    p.add_argument("--label", default="", help="create: what the key is for")
    p.add_argument("--overlap", type=int, default=24 * 3600, help="rotate: seconds the old key keeps working")
    p.add_argument("--yes", action="store_true",
                   help="revoke, rotate --overlap 0: yes, the key stops working now (it cannot be undone)")

    def run(args: argparse.Namespace) -> int:
        from ..ingest.api_keys import key_id, public

        rt = Runtime(args.config)
        api_keys = rt.api_keys()
        if args.action == "list":
            for k in api_keys.list(args.tenant):
                state = "revoked" if k.revoked_at_ms else ("expiring" if k.expires_at_ms else "valid")
                print(f"{k.id}  {k.role:<8} {k.tenant or '-':<20} {state:<8} created={k.created_at_ms} "
                      f"last_used={k.last_used_ms or '-'} {k.label}")
            return 0
        if args.action == "create":
            if not args.operator and not args.tenant:
                raise ConfigError("`streams keys create` needs --tenant T or --operator")
            role = "operator" if args.operator else "tenant"
            token = api_keys.create(role, args.tenant, args.label)
            print(token)  # first: nothing after it may leave a key nobody holds
            _audited(rt, f"apikey/{key_id(token)}", None,
                     {"role": role, "tenant": args.tenant if role == "tenant" else None, "label": args.label})
            return 0
        if not args.key_id:
            raise ConfigError(f"`streams keys {args.action}` needs a key id")
        if not KEY_ID.fullmatch(args.key_id):  # a key pasted for its id, say: never printed back (logs keep stderr)
            raise ConfigError(f"`streams keys {args.action}` takes a key's id (12 hex digits, from `streams keys "
                              f"list`), not the key itself (if it is one, its id is {key_id(args.key_id.strip())}); "
                              "nothing was changed")
        if (args.action == "revoke" or args.overlap == 0) and not args.yes:
            overlap = (" (rotate with an --overlap keeps the old key working meanwhile)"
                       if args.action == "rotate" else "")
            raise _unconfirmed(f"streams keys {args.action}", f"stops key {args.key_id} working at once, for every "
                               f"request of whoever holds it, and cannot be undone{overlap}")
        before = api_keys.get(args.key_id)
        if before is None:
            raise ConfigError(f"no API key {args.key_id}")
        if args.action == "revoke":
            after = api_keys.revoke(args.key_id)
            if after is None:  # deleted since it was read
                raise ConfigError(f"no API key {args.key_id}")
            print(f"revoked {args.key_id}")
            _audited(rt, f"apikey/{args.key_id}", public(before), public(after))
            return 0
        with _audited_if_unanswered(rt, f"apikey/{args.key_id}", public(before),
                                    {"rotated": True, "overlap_s": args.overlap}):
            rotated = api_keys.rotate(args.key_id, args.overlap)
        if rotated is None:
            raise ConfigError(f"API key {args.key_id} is no longer valid: create a new one")
        token, old = rotated
        print(token)
        _audited(rt, f"apikey/{args.key_id}", public(before), {"old": public(old), "new_id": key_id(token)})
        return 0

    p.set_defaults(func=run)


def audit(sub) -> None:
    p = sub.add_parser("audit", help="operator: the audit trail of operator changes")
    p.add_argument("--since-ms", type=int, default=0, help="only entries at or after this time (Unix ms)")
    p.add_argument("--json", action="store_true", help="one JSON document per line")

    def run(args: argparse.Namespace) -> int:
        import orjson

        rt = Runtime(args.config)
        for entry in rt.audit_log().read(args.since_ms):
            if args.json:
                print(orjson.dumps(entry).decode())
            else:
                print(f"{entry['at_ms']}  {entry['who']:<30} {entry['what']:<40} "
                      f"{orjson.dumps(entry['before']).decode()} -> {orjson.dumps(entry['after']).decode()}")
        return 0

    p.set_defaults(func=run)


def _replay(rt: Runtime, send_id: str, outcome_checked: bool, dead_letter: bool) -> int:
    """`dead_letter`: replay a dead letter, once however often asked; else a new delivery of any finished send."""
    from ..ingest.status import StatusStore
    from ..retry.replay import replay, replay_dead_letter

    r = rt.redis()
    store = StatusStore(r, rt.namespace, holds_data=rt.state_guard("cli", r).check)
    client = rt.send_client(known_policies=frozenset(rt.policies()))

    def admit(new: Send) -> None:  # a webhook delivery's endpoint, as deliveries see it, must take it
        if new.channel == "webhook":
            webhooks = rt.webhook_ingest(r, client, store)
            webhooks.directory.catch_up()
            webhooks.refuse_undeliverable_replay(new)

    try:
        if dead_letter:
            done = replay_dead_letter(rt.bootstrap, rt.names, store, client, send_id, outcome_checked, admit=admit)
            if done.send is None:
                print(f"{send_id} was replayed already as {done.send_id} (replay_of={send_id}); nothing was published")
                return 0
            new = done.send
        else:
            new = replay(rt.bootstrap, rt.names, store, client, send_id, outcome_checked=outcome_checked, admit=admit,
                         alone=True)
    except ReplayOutcomeUnknown as exc:  # it may be out: said first (its send id), then on the audit trail as such
        print(f"error: {exc}", file=sys.stderr)
        _audited_maybe(rt, f"replay/{send_id}", None, {"send_id": exc.replay_id, "replay_of": send_id})
        return 1
    print(f"replayed {send_id} as a new send {new.send_id} (replay_of={send_id}) to "
          f"{rt.names.lane(new.channel, new.lane)}")
    _audited(rt, f"replay/{send_id}", None, {"send_id": new.send_id, "replay_of": send_id})
    return 0


def _outcome_checked_flag(p) -> None:
    p.add_argument("--outcome-checked", action="store_true",
                   help="replay a send dead-lettered unknown_outcome: you checked the provider does not hold it")


def dlq(sub) -> None:
    p = sub.add_parser("dlq", help="operator: list, show and replay dead letters")
    p.add_argument("action", choices=["list", "show", "replay"])
    p.add_argument("send_id", nargs="?")
    p.add_argument("--reason", help="list only this reason")
    p.add_argument("--limit", type=_listed, default=50, help="how many of the newest to list (1-1000)")
    _outcome_checked_flag(p)

    def run(args: argparse.Namespace) -> int:
        from ..ingest.status import StatusStore
        from ..retry import dlq as tools

        rt = Runtime(args.config)
        if args.action == "list":
            listing = tools.latest(rt.bootstrap, rt.names.dlq, args.limit, args.reason)
            shown = listing.latest
            for r in shown:
                print(tools.summary_line(r))
            print(f"{len(shown)} of {listing.total} dead letters")
            return 0
        if not args.send_id:
            raise ConfigError(f"`streams dlq {args.action}` needs a send id")
        if args.action == "replay":
            return _replay(rt, args.send_id, args.outcome_checked, dead_letter=True)
        status = StatusStore(rt.redis(), rt.namespace).get(args.send_id) or {}
        position = (status["dlq_partition"], status["dlq_offset"]) if "dlq_offset" in status else None
        print(tools.describe(tools.find(rt.bootstrap, rt.names.dlq, args.send_id, position)))
        return 0

    p.set_defaults(func=run)


def sends(sub) -> None:
    p = sub.add_parser("sends", help="operator: a send's status and history, and replays")
    p.add_argument("action", choices=["show", "replay"])
    p.add_argument("send_id")
    _outcome_checked_flag(p)

    def run(args: argparse.Namespace) -> int:
        import orjson

        from ..ingest.status import StatusStore

        rt = Runtime(args.config)
        if args.action == "replay":
            return _replay(rt, args.send_id, args.outcome_checked, dead_letter=False)
        r = rt.redis()
        store = StatusStore(r, rt.namespace, holds_data=rt.state_guard("cli", r).check)
        status = store.get(args.send_id)
        if status is None:
            try:
                store.require_data()
            except StoreUnavailable:  # lost (StateLost), or the operator log cannot say
                raise StoreUnavailable(f"send {args.send_id} is not in Redis, which has lost its data (or cannot say "
                                       "whether it has), and `streams state recover` has not finished: the send may "
                                       "well exist; ask again once it has") from None
            raise ConfigError(f"no send {args.send_id} (its history is kept 30 days)")
        print(orjson.dumps({"send_id": args.send_id, **status}, option=orjson.OPT_INDENT_2).decode())
        return 0

    p.set_defaults(func=run)


def state(sub) -> None:
    p = sub.add_parser("state", help="operator: Redis state (epoch, lost data, recovery)")
    p.add_argument("action", choices=["status", "recover", "acknowledge-loss"],
                   help="status: is Redis's data intact? recover: rebuild delivery marks and statuses from "
                        "notif.outcomes, then resume dispatch; acknowledge-loss: resume without rebuilding the marks "
                        "(both restore limits, keys and endpoints from the operator log)")
    p.add_argument("--yes", action="store_true",
                   help="acknowledge-loss: yes, resume without the delivery marks (sends delivered before the loss "
                        "may be sent again)")

    def run(args: argparse.Namespace) -> int:
        from ..state.recover import acknowledge_loss, recover

        if args.action == "acknowledge-loss" and not args.yes:
            raise _unconfirmed("streams state acknowledge-loss", "resumes dispatch without the delivery marks: sends "
                               "delivered before the loss may be sent again. `streams state recover` rebuilds them "
                               "from notif.outcomes first; to accept the duplicates")

        rt = Runtime(args.config)
        client = rt.redis()
        if args.action == "status":
            intact = rt.state_guard("cli", client).check(force=True)
            print("Redis state intact" if intact else
                  "Redis has LOST its data: operator state was restored from the operator log; dispatch holds "
                  "until `streams state recover` (or `streams state acknowledge-loss --yes`)")
            return 0 if intact else 3
        oplog = rt.operator_log()
        if args.action == "recover":
            try:
                done = recover(rt.bootstrap, client, rt.names, rt.config.keys, oplog,
                               progress=lambda m: print(f"  {m}", file=sys.stderr))
            except BaseException as exc:  # Ctrl-C included: it may have restored operator state and marks before
                try:
                    _audited(rt, "state/recover", None, {"finished": False, "error": type(exc).__name__})
                except Exception as unconfirmed:  # noqa: BLE001 - the recovery's own error is the answer
                    print(f"warning: {unconfirmed}", file=sys.stderr)
                raise
            skipped = f" ({done.skipped} unusable events skipped)" if done.skipped else ""
            print(f"recovered: {done.events} outcome events read, {done.delivered_marks} delivered marks, "
                  f"{done.stop_marks} reconcile/tried marks, {done.statuses} statuses and {done.replay_marks} "
                  f"replay marks rebuilt{skipped}; dispatch resumes")
            _audited(rt, "state/recover", None, {"events": done.events, "delivered_marks": done.delivered_marks,
                                                 "stop_marks": done.stop_marks,
                                                 "statuses": done.statuses, "replay_marks": done.replay_marks,
                                                 "skipped": done.skipped})
        else:
            epoch = acknowledge_loss(client, rt.config.keys, oplog)
            print(f"acknowledged: epoch {epoch}; dispatch resumes (sends delivered before the loss may be sent again)")
            _audited(rt, "state/acknowledge-loss", None, {"epoch": epoch})
        return 0

    p.set_defaults(func=run)


def endpoints(sub) -> None:
    p = sub.add_parser("endpoints", help="operator: a tenant's webhook endpoints")
    p.add_argument("action", choices=["list", "show", "create", "enable", "disable", "delete", "rotate", "reactivate",
                                      "reseal"])
    p.add_argument("endpoint_id", nargs="?")
    p.add_argument("--tenant", required=True, help="reseal: '*' for every tenant")
    p.add_argument("--url")
    p.add_argument("--events", help="comma-separated event types ('*' for all)")
    p.add_argument("--description", default="")
    p.add_argument("--yes", action="store_true",
                   help="delete: yes, delete it for good (its deliveries waiting or in retry are skipped)")
    p.add_argument("--unsealed", action="store_true",
                   help="create/rotate in a shell without WEBHOOK_SECRET_KEYS (a development stack without keys): "
                        "store the signing secret unsealed, which is refused without it; with the keys, the secret "
                        "is sealed all the same")

    def run(args: argparse.Namespace) -> int:
        import orjson

        from ..ingest.status import StatusStore
        from ..webhooks.sealing import UnsealError, sealed_with

        if args.action == "delete" and args.endpoint_id and not args.yes:
            raise _unconfirmed("streams endpoints delete", f"deletes endpoint {args.endpoint_id} of tenant "
                               f"{args.tenant} for good (its deliveries waiting or in retry are skipped, its signing "
                               "secrets gone; `disable` stops deliveries and can be undone)")
        rt = Runtime(args.config)
        r = rt.redis()
        webhooks = rt.webhook_ingest(r, rt.send_client(), StatusStore(r, rt.namespace))
        webhooks.directory.catch_up()  # to show each endpoint's health
        store = webhooks.endpoints
        if args.action == "list":
            for ep in map(webhooks.current, store.all(args.tenant)):
                print(f"{ep.id}  {ep.state:<9} {'enabled ' if ep.enabled else 'disabled'} {ep.url}  "
                      f"[{', '.join(ep.event_types)}]")
            return 0
        if args.action == "reseal":  # every secret under the first of WEBHOOK_SECRET_KEYS (a key rotation)
            sealer = rt.config.webhook_secret_keys
            if sealer is None:
                raise ConfigError("`streams endpoints reseal` needs WEBHOOK_SECRET_KEYS (its first key seals)")
            tenants = store.tenants() if args.tenant == "*" else [args.tenant]  # as Redis holds them, not the view
            what, key = f"endpoints/{args.tenant}/reseal", sealer.keys[0][0]
            changed = 0
            try:
                for tenant in tenants:
                    for moved in store.resealing(tenant):  # counted one by one: a tenant may stop part-way
                        changed += moved
            except BaseException as exc:  # Ctrl-C included
                # Stopped part-way (a secret no listed key opens, Redis or the operator log failing): what was
                # re-sealed before is on the audit trail too, not only what a later run re-seals. At least: an
                # endpoint written to Redis whose operator-log record then failed is not counted.
                print(f"stopped at tenant {tenant}: at least {changed} endpoint(s) re-sealed under key {key!r} before",
                      file=sys.stderr)
                if changed:
                    try:
                        _audited(rt, what, None, {"key": key, "endpoints_at_least": changed,
                                                  "stopped_at_tenant": tenant, "error": type(exc).__name__})
                    except Exception as unconfirmed:  # noqa: BLE001 - the reseal's own error is the answer
                        print(f"warning: {unconfirmed}", file=sys.stderr)
                if isinstance(exc, UnsealError):  # a secret sealed under a key no longer listed
                    raise ConfigError(f"{exc}: list that key again (after the first) and re-seal") from None
                raise
            print(f"{changed} endpoint(s) of {len(tenants)} tenant(s) re-sealed under key {key!r}")
            _audited(rt, what, None, {"key": key, "endpoints": changed})
            return 0
        if args.action in ("create", "rotate") and rt.config.webhook_secret_keys is None and not args.unsealed:
            # The secret is sealed with this shell's keys: without them it would sit in the clear in Redis and in the
            # operator log, though the API and the workers (which have them) seal every secret they store.
            raise ConfigError(f"`streams endpoints {args.action}` seals the signing secret with WEBHOOK_SECRET_KEYS, "
                              "which this shell does not have: set it as the API and the webhook workers have it "
                              "(or pass --unsealed on a development stack without keys); nothing was changed")
        if args.action == "create":
            if not args.url or not args.events:
                raise ConfigError("`streams endpoints create` needs --url and --events")
            try:  # the API takes it from the key, never mistyped
                check_tenant_id(args.tenant)
            except SendValidationError:
                raise ConfigError(f"{args.tenant[:80]!r} is not a tenant id (1 to 64 ASCII letters, digits, '_' or "
                                  "'-'): no event of any tenant could reach an endpoint created for it") from None
            ep, secret = store.create(args.tenant, args.url, args.events.split(","), args.description)
            print(orjson.dumps({**ep.public(), "secret": secret}, option=orjson.OPT_INDENT_2).decode())
            _audited(rt, f"endpoint/{ep.id}", None, _audit_view(ep))
            return 0
        if not args.endpoint_id:
            raise ConfigError(f"`streams endpoints {args.action}` needs an endpoint id")
        missing = ConfigError(f"no endpoint {args.endpoint_id} for tenant {args.tenant}")
        stored = store.get(args.tenant, args.endpoint_id)
        if stored is None:
            raise missing
        before = webhooks.current(stored)
        what = f"endpoint/{args.endpoint_id}"
        if args.action == "delete":
            with _audited_if_unanswered(rt, what, _audit_view(before), None):
                deleted = store.delete(args.tenant, args.endpoint_id)
            if not deleted:
                raise missing
            print(f"deleted {args.endpoint_id}")
            _audited(rt, what, _audit_view(before), None)
            return 0
        if args.action == "rotate":
            with _audited_if_unanswered(rt, what, _audit_view(before), {**_audit_view(before), "secret": "rotated"}):
                rotated = store.rotate_secret(args.tenant, args.endpoint_id)
            if rotated is None:
                raise missing
            print(rotated)
            _audited(rt, what, _audit_view(before), {**_audit_view(before), "secret": "rotated"})
            return 0
        found: Endpoint | None = before
        if args.action == "reactivate":  # counter and alert window reset, deliveries resume
            with _audited_if_unanswered(rt, what, _audit_view(before), {**_audit_view(before), "state": "active"}):
                found = webhooks.set_active(args.tenant, args.endpoint_id)
            if found is None:
                raise missing
            try:
                webhooks.reset_health(args.tenant, args.endpoint_id)
            except BaseException as exc:  # Ctrl-C included
                _reactivated_in_part(rt, what, before, webhooks.current(found), exc)
                raise
        elif args.action in ("enable", "disable"):
            enabled = args.action == "enable"
            with _audited_if_unanswered(rt, what, _audit_view(before), {**_audit_view(before), "enabled": enabled}):
                found = store.update(args.tenant, args.endpoint_id, enabled=enabled)
        if found is None:
            raise missing
        shown = webhooks.current(found).public()  # with its health, as the API shows it
        if args.action == "reactivate":
            shown["note"] = ("the endpoint receives deliveries again within a few seconds, once the endpoint-health "
                             "app has read the reset (its state shows active then): replay what it missed then"
                             if found.enabled else "the endpoint is reactivated, and disabled by its tenant "
                             "(enabled: false): it receives deliveries once enabled")
        if args.action == "show":  # for an operator: which key seals each secret (WebhookSecretsUnreadable), no secret
            shown["secrets"] = [{"sealed_with": sealed_with(s.value) or "(in the clear)",
                                 "expires_at_ms": s.expires_at_ms} for s in found.secrets]
        print(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())
        if args.action != "show":  # reactivated: active now, before the health app has read it
            after = found if args.action == "reactivate" else webhooks.current(found)
            _audited(rt, what, _audit_view(before), _audit_view(after))
        return 0

    p.set_defaults(func=run)


def _reactivated_in_part(rt: Runtime, what: str, before, after, exc: BaseException) -> None:
    """A reactivation whose health reset was not confirmed: the endpoint's configured state is active already (a
    410's disable is lifted), so that change goes on the audit trail, as the endpoint now stands (`after`: still
    degraded while the endpoint-health app holds it so), with the error; reactivating again finishes it. The
    reset's own error stays the answer, whatever happens to this record."""
    from ..webhooks.ingest import reactivated_in_part

    print(f"{what}: {reactivated_in_part(after.state)}", file=sys.stderr)
    try:
        _audited(rt, what, _audit_view(before), {**_audit_view(after), "error": type(exc).__name__})
    except BaseException as unconfirmed:  # noqa: BLE001 - Ctrl-C here too: the reset's error is the answer
        print(f"warning: {unconfirmed or type(unconfirmed).__name__}", file=sys.stderr)


def _audit_view(ep) -> dict:
    """An endpoint as the audit trail keeps it: never its secrets, nor its URL (which may carry a token)."""
    return {"tenant": ep.tenant, "enabled": ep.enabled, "state": ep.state, "event_types": list(ep.event_types)}


COMMANDS = [topics, limits, senders, keys, audit, dlq, sends, state, endpoints]
