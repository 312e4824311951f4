"""API keys on the real store (Redis): rotating never extends the life of a key being retired."""

import time

from streams.ingest.api_keys import ApiKeys


def test_rotating_a_rotated_key_again_never_extends_its_end(redis_client, namespace):
    """Given a key rotated with a 1 h overlap,
    When it is rotated again with 30 days' overlap (an operator repeating the rotation),
    Then it still ends within the hour (before, its end moved to 30 days: the key meant to be retired kept
    working a month), and the second rotation made another new key, which works."""
    keys = ApiKeys(redis_client, namespace)
    old_token = keys.create("tenant", "acme", "billing")
    old = keys.resolve(old_token)
    first_token, first = keys.rotate(old.key_id, overlap_s=3600)
    second_token, second = keys.rotate(old.key_id, overlap_s=30 * 24 * 3600)
    assert second.expires_at_ms == first.expires_at_ms <= int(time.time() * 1000) + 3600 * 1000
    assert keys.resolve(first_token).tenant == keys.resolve(second_token).tenant == "acme"
