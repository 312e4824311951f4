"""The redis-py adapter pieces every role shares: a connection, the Lua scripts shipped beside
their adapters, and the translation of every Redis error into StoreUnavailable.

`REDIS_URL` names a single Redis (`redis://host:port/0`) or a Redis Cluster: the scheme
`redis+cluster://` (`rediss+cluster://` with TLS), or `?cluster=1` on a `redis://` URL. A cluster URL
may list several startup nodes, `redis+cluster://h1:p1,h2:p2,h3:p3`; the client discovers the rest.
Every key a Lua script touches carries one hash tag (`streams.names.RedisKeys`), so each script
call runs on one node; pipelines are split by node and the replies put back in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import AskError, MovedError, NoScriptError, RedisClusterException, TryAgainError
from redis.retry import Retry

from .errors import ConfigError, StoreUnavailable

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRUE = {"1", "true", "yes", "on"}
# Fail fast (a short timeout) so callers can hold and retry, never hang.
_TIMEOUTS: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 2, "health_check_interval": 30}


# Compare-and-set of one hash field: a record read, changed and written back only if nobody wrote it
# meanwhile (0: it changed; read it again). KEYS[1] the hash; ARGV: field, the value as read, the new value.
SET_FIELD_IF_UNCHANGED = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def connect(url: str) -> redis.Redis:
    """A client that fails fast (a short timeout) so callers can hold and retry, never hang. A
    cluster URL gives a `ClusterClient` (a redis-py RedisCluster), which must reach one startup
    node now: StoreUnavailable when none answers."""
    if is_cluster_url(url):
        return connect_cluster(url)
    try:
        return Client.from_url(url, **_TIMEOUTS)
    except ValueError:  # its text may quote part of the URL: a password holding `/`, `?` or `#` ends up in the port
        raise ConfigError("REDIS_URL is not a URL Redis can be reached at (not shown: it may hold a password): its "
                          "scheme is redis://, rediss:// or unix://, and '/', '?', '#' and '@' in its password are "
                          "percent-encoded (%2F, %3F, %23, %40)") from None


class Client(redis.Redis):
    """redis-py's Redis, whose pipelines run registered scripts in one round trip (ScriptPipeline)."""

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> ScriptPipeline:
        return ScriptPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class ScriptPipeline(redis.client.Pipeline):
    """A pipeline that sends its scripts as EVALSHA straight away. redis-py asks `SCRIPT EXISTS`
    before every pipeline that runs a script: a second round trip on the dispatch path, for a cache
    that is empty only after Redis restarted. Here a command that meets NOSCRIPT gets its script
    loaded and is sent again, alone, after the others (the project's script pipelines hold only
    scripts, independent of each other). What NOSCRIPT refused never ran, so this resends nothing
    that ran. (A connection lost mid-pipeline sends nothing again: the connections do not retry. The
    caller fails closed, as after any answer lost; a worker releases the claims of a round whose
    answer was lost before its next round.)"""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        if self.transaction or self.explicit_transaction or self.watching:
            return super().execute(raise_on_error)  # MULTI/EXEC: redis-py's own way
        stack = list(self.command_stack)
        registered: set[Any] = self.scripts
        scripts = {s.sha: s for s in registered}
        self.scripts: set[Any] = set()  # skips redis-py's SCRIPT EXISTS
        results = super().execute(raise_on_error=False)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            client = redis.Redis(connection_pool=self.connection_pool)
            for sha in {stack[i][0][1] for i in missing}:
                if sha in scripts:
                    client.script_load(scripts[sha].script)
            again = ScriptPipeline(self.connection_pool, self.response_callbacks, False, None)
            for i in missing:
                args, options = stack[i]
                again.execute_command(*args, **options)
            for i, result in zip(missing, again.execute(raise_on_error=False), strict=True):
                results[i] = result
        if raise_on_error:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results


def is_cluster(client: redis.Redis | RedisCluster) -> bool:
    return isinstance(client, RedisCluster)


def ping_every_master(client: redis.Redis | RedisCluster) -> None:
    """PING Redis; on a Redis Cluster every master (a plain PING goes to one node, which could answer while the
    master holding some tenants' keys is down). Raises redis-py's errors."""
    if is_cluster(client):
        client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.ping()


def is_cluster_url(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        return True
    return any(k == "cluster" and v.lower() in _TRUE for k, v in parse_qsl(parts.query))


_HOSTS = re.compile(r"[^,/?@]+:\d+(,[^,/?@]+:\d+)*(?:[/?]|\Z)")  # a host:port list, then a path, a query or the end


def cluster_startup(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL as redis-py takes it: a `redis://` URL of the first node (credentials, database
    0 and options kept, `cluster` dropped), and every startup node (host, port)."""
    scheme, rest = url.split("://", 1)
    scheme = CLUSTER_SCHEMES.get(scheme, scheme)
    # The credentials end at the `@` the hosts follow (a password may hold `/`, `@` or `?`; an option in the query
    # may hold `@`): nothing of them is ever taken for a host, nor named by an error.
    userinfo, at = "", ""
    hosts_first = _HOSTS.match(rest)  # then any `@` is after them, in the path or query (none can be in a host)
    if "@" in rest and not (hosts_first and rest.index("@") > hosts_first.end()):
        for i in reversed([i for i, c in enumerate(rest) if c == "@"]):
            if _HOSTS.match(rest, i + 1):
                userinfo, at, rest = rest[:i], "@", rest[i + 1:]
                break
        else:  # no host:port list follows any `@`: the last one ends the credentials
            userinfo, at, rest = rest.rpartition("@")
    hosts, sep, tail = rest.partition("/")
    if "?" in hosts:  # no path: the query follows the hosts directly
        hosts, _, query = hosts.partition("?")
        tail, sep = f"?{query}", "/"
    # As a URL's userinfo, the characters that would end it are percent-encoded (redis-py decodes them).
    for char, code in (("/", "%2F"), ("?", "%3F"), ("#", "%23"), ("@", "%40")):
        userinfo = userinfo.replace(char, code)
    nodes = []
    for entry in hosts.split(","):
        host, _, port = entry.strip().rpartition(":")
        if not host or not port.isdigit():
            raise StoreUnavailable(f"Redis Cluster URL: {entry.strip()!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    first = f"{userinfo}{at}{hosts.split(',')[0].strip()}"
    parts = urlsplit(f"{scheme}://{first}{sep}{tail}")
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "cluster"])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment)), nodes


def connect_cluster(url: str) -> ClusterClient:
    first, nodes = cluster_startup(url)
    try:
        return ClusterClient(url=first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **_TIMEOUTS)
    except (RedisClusterException, redis.RedisError) as exc:
        where = ", ".join(f"{h}:{p}" for h, p in nodes)
        raise StoreUnavailable(f"Redis Cluster unavailable: no startup node answered ({where}): {exc}") from None


class ClusterUnavailable(redis.exceptions.ClusterError):
    """A cluster failure redis-py reports outside its RedisError tree (no node for a slot, every
    retry used up), as a RedisError, so that every caller fails closed on it like on any Redis error."""


class ClusterClient(RedisCluster):
    """redis-py's RedisCluster, as the adapters use a Redis:

    - every error is a RedisError (redis-py raises RedisClusterException, outside that tree, when
      no node serves a slot), so the gate fails closed and dispatch holds instead of crashing;
    - registered Lua scripts work in pipelines: redis-py's cluster pipeline refuses EVALSHA (it
      cannot load scripts on the nodes first), so a pipelined script is sent as EVAL with its
      source (Redis caches it); outside pipelines, EVALSHA with EVAL as the fallback on NOSCRIPT
      (a failed-over or restarted node has an empty script cache);
    - MGET works in pipelines (redis-py refuses it there; the project's MGETs have one hash tag);
    - a call whose connection fails or whose reply does not come in time is not sent again (redis-py
      would, 10 times over, for a pipeline's every command on that node, the answered ones too): it may
      have run, and a bucket debit, a refund or a claim run twice is a wrong count or a claim found
      busy. The caller fails closed and tries again later, as with a single Redis (whose connections do
      not retry either); the slot map is read again first. Redirections (MOVED, ASK, TRYAGAIN: the
      node did not run the command) are followed as before. So a master that stops answering costs a
      call one socket timeout (5 s; a second one when the slot map is then asked of that master first),
      not ten.
    """

    pipeline_class: type[ClusterClientPipeline]  # set below the pipeline's class

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))  # a call is sent once (above)
        super().__init__(*args, **kwargs)
        self.scripts: dict[str, str | bytes] = {}  # sha1 -> source, for EVAL

    def register_script(self, script: str | bytes) -> Any:
        registered = super().register_script(script)
        self.scripts[registered.sha] = script
        return registered

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailable(f"Redis Cluster: {exc}") from exc

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        try:
            return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)
        except NoScriptError:
            if sha not in self.scripts:
                raise
            return self.execute_command("EVAL", self.scripts[sha], numkeys, *keys_and_args)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterClientPipeline:
        if transaction:
            raise ClusterUnavailable("Redis Cluster: MULTI/EXEC pipelines are not used with a cluster")
        if shard_hint:
            raise ClusterUnavailable("Redis Cluster: shard_hint is not supported")
        pipe = self.pipeline_class(
            nodes_manager=self.nodes_manager,
            commands_parser=self.commands_parser,
            startup_nodes=self.nodes_manager.startup_nodes,
            result_callbacks=self.result_callbacks,
            cluster_response_callbacks=self.cluster_response_callbacks,
            read_from_replicas=self.read_from_replicas,
            load_balancing_strategy=self.load_balancing_strategy,
            reinitialize_steps=self.reinitialize_steps,
            retry=self.retry,
            lock=self._lock,
            transaction=False,
            event_dispatcher=self._event_dispatcher,
        )
        pipe.scripts = self.scripts
        return pipe


class ClusterClientPipeline(ClusterPipeline):
    """A non-transactional cluster pipeline: commands are grouped by node, sent, and the replies
    returned in the order of the commands (see ClusterClient)."""

    scripts: dict[str, str | bytes] = {}

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        source = self.scripts.get(sha)
        if source is None:
            return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)
        return self.execute_command("EVAL", source, numkeys, *keys_and_args)

    def mget(self, keys: Any, *args: Any) -> Any:
        names = [keys] if isinstance(keys, (str, bytes)) else list(keys)
        return self.execute_command("MGET", *names, *args)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = sorted(self._execution_strategy.command_queue, key=lambda c: c.position)
        try:
            if not stack:
                return []
            replies = self.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        except RedisClusterException as exc:
            raise ClusterUnavailable(f"Redis Cluster: {exc}") from exc
        finally:
            self.reset()
        unanswered = False
        for i, command in enumerate(stack):
            if isinstance(replies[i], (MovedError, AskError, TryAgainError)):  # not run there: run it where it is
                try:
                    replies[i] = self.parent_execute_command(*command.args, **command.options)
                except redis.RedisError as exc:
                    replies[i] = exc
                except RedisClusterException as exc:  # no node serves the slot: a RedisError like any other
                    replies[i] = ClusterUnavailable(f"Redis Cluster: {exc}")
            unanswered |= isinstance(replies[i], (redis.ConnectionError, redis.TimeoutError))
        if unanswered:  # as redis-py does after a single command's: a failed-over master's slots move
            try:
                self.nodes_manager.initialize()
            except (RedisClusterException, redis.RedisError):
                pass  # no node answers: the caller holds, and the next call reads the map again
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies


ClusterClient.pipeline_class = ClusterClientPipeline


def load_script(package: str | None, name: str) -> str:
    """A Lua script shipped beside the adapter that loads it."""
    return resources.files(package or "streams").joinpath(name).read_text()


@contextmanager
def store_errors(what: str, error: type[StoreUnavailable] = StoreUnavailable) -> Iterator[None]:
    """Translate any Redis failure inside the block into `error` naming `what` was being done."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as exc:
        raise error(f"{what}: Redis unavailable ({exc})") from None
