"""A Redis Cluster URL (`redis+cluster://user:password@host:port,host:port/db?options`) read into redis-py's
startup node list and first-node URL: the credentials are never taken for a host, nor named by an error."""

import pytest
import redis

from streams.errors import StoreUnavailable
from streams.redis_client import cluster_startup


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
