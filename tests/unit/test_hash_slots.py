"""The hash slots the epoch's markers live in: computed the way a Redis Cluster computes them."""

from __future__ import annotations

from redis.crc import key_slot

from streams.names import HASH_SLOTS, RedisKeys, hash_slot, slot_tags


def test_a_tenants_marker_lives_in_the_slot_of_its_processed_jobs_keys():
    """Given tenants with ids of every allowed kind of character,
    When their epoch marker's key is named,
    Then redis-py's own slot function puts it in the slot of the tenant's processed_jobs, lease and record keys (a
    claim script reads it there, so on a Redis Cluster it must be one slot)."""
    keys = RedisKeys("ns.")
    for tenant in ("acme", "t-1", "A_b", "x" * 64, "0", "bulk"):
        marker = key_slot(keys.tenant_epoch_marker(tenant).encode())
        assert marker == key_slot(keys.processed(tenant, "s1").encode()) == key_slot(keys.lease(tenant, "k").encode())
        assert marker == hash_slot(f"t:{tenant}")


def test_every_slot_gets_one_marker_of_its_own():
    """Given the markers of a namespace,
    When each one's slot is computed by redis-py,
    Then the 16,384 markers cover the 16,384 slots, one each (a lost shard loses the markers of exactly its slots)."""
    markers = RedisKeys("ns.").epoch_markers()
    assert len(markers) == HASH_SLOTS == len(set(markers)) == len(slot_tags())
    assert [key_slot(m.encode()) for m in markers] == list(range(HASH_SLOTS))
