"""A Redis Cluster URL (`redis+cluster://user:password@host:port,host:port/db?options`) read into redis-py's
startup node list and first-node URL: the credentials are never taken for a host, nor named by an error."""

import pytest
import redis

from streams.errors import ConfigError, StoreUnavailable
from streams.redis_client import cluster_startup, connect


@pytest.mark.parametrize("url, first, nodes", [
    ("redis+cluster://default:s3cr/et@h1:7000,h2:7001/0", "redis://default:s3cr%2Fet@h1:7000/0",
     [("h1", 7000), ("h2", 7001)]),
    ("redis+cluster://default:s3cr/et@h1:7000,h2:7001", "redis://default:s3cr%2Fet@h1:7000",
     [("h1", 7000), ("h2", 7001)]),
    ("redis+cluster://u:p@ss@h1:7000", "redis://u:p%40ss@h1:7000", [("h1", 7000)]),
    ("redis+cluster://h1:7000?client_name=ops@example", "redis://h1:7000/?client_name=ops%40example",
     [("h1", 7000)]),
    ("redis+cluster://h1:7000/0?client_name=a@b:1", "redis://h1:7000/0?client_name=a%40b%3A1", [("h1", 7000)]),
    ("redis+cluster://h1:7000,h2:7001?cluster=1&x=2", "redis://h1:7000/?x=2", [("h1", 7000), ("h2", 7001)]),
    ("redis+cluster://u:pw@[::1]:7000,h2:7001", "redis://u:pw@[::1]:7000", [("::1", 7000), ("h2", 7001)]),
])
def test_a_password_holding_url_delimiters_stays_the_password(url, first, nodes):
    """Given cluster URLs whose password holds `/` or `@`, or whose query holds `@` (even before a host:port),
    When the URL is read,
    Then the nodes are the hosts, and the first node's URL gives redis-py the password as written (before, a `/`
    in the password cut the URL there: the start of the password was taken for a host)."""
    assert cluster_startup(url) == (first, nodes)
    if "s3cr" in url:
        assert redis.connection.parse_url(cluster_startup(url)[0])["password"] == "s3cr/et"


@pytest.mark.parametrize("url", ["redis+cluster://default:s3cr/et@h1:7000,bad",
                                 "redis+cluster://default:s3cr/et@h1"])
def test_a_wrong_host_is_named_without_the_password(url):
    """Given a cluster URL with a password holding `/` and a host without a port,
    When the URL is read,
    Then the error names the host, never any part of the password (before: `'default:s3cr' is not host:port`)."""
    with pytest.raises(StoreUnavailable, match="is not host:port") as refused:
        cluster_startup(url)
    assert "s3cr" not in str(refused.value)


def test_a_redirected_command_whose_slot_no_node_serves_fails_as_a_redis_error_in_its_place():
    """Given a cluster pipeline of two commands, the second answered MOVED (its slot moved), and a cluster where no
    node serves that slot when the command is run where it moved (SlotNotCoveredError, outside redis-py's
    RedisError tree),
    When the pipeline is run without raising,
    Then the first reply stands and the second is a RedisError (ClusterUnavailable), which every caller handles by
    failing closed (before: the cluster error escaped and ended the worker's loop)."""
    from types import SimpleNamespace

    import redis
    from redis.exceptions import MovedError, SlotNotCoveredError

    from streams.redis_client import ClusterClientPipeline, ClusterUnavailable

    pipe = object.__new__(ClusterClientPipeline)
    commands = [SimpleNamespace(position=0, args=("GET", "a"), options={}),
                SimpleNamespace(position=1, args=("GET", "b"), options={})]
    pipe._execution_strategy = SimpleNamespace(command_queue=commands, reset=lambda: None)
    pipe.reset = lambda: None
    pipe.send_cluster_commands = lambda stack, raise_on_error, allow_redirections: [b"1", MovedError("3999 h:1")]

    def moved_nowhere(*args, **options):
        raise SlotNotCoveredError("no node serves slot 3999")

    pipe.parent_execute_command = moved_nowhere
    replies = pipe.execute(raise_on_error=False)
    assert replies[0] == b"1"
    assert isinstance(replies[1], ClusterUnavailable) and isinstance(replies[1], redis.RedisError)


def test_a_single_redis_url_whose_password_breaks_it_is_refused_without_showing_any_of_it():
    """Given REDIS_URL with a password holding '/' (base64 passwords often do), not percent-encoded,
    When a role connects,
    Then it is a configuration error saying how to write it, quoting nothing of the URL (before: redis-py's
    ValueError, uncaught, printed part of the password as the port in every role's traceback)."""
    with pytest.raises(ConfigError) as refused:
        connect("redis://:Zm9v/YmFy@redis:6379/0")
    assert "percent-encoded" in str(refused.value) and "Zm9v" not in str(refused.value)
