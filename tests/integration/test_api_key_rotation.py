"""API keys on the real store (Redis): rotating never extends the life of a key being retired, and a revocation keeps
its time."""

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


def test_a_rotation_racing_another_keeps_the_sooner_end(redis_client, namespace, monkeypatch):
    """Given a key, and operator A rotating it with 30 days' overlap,
    When operator B rotates it with a 1 h overlap between A's read of the key and A's write,
    Then the key ends within the hour (before: A's write, checked against the end it had read, none, moved the
    end to 30 days: B's retirement of the key was undone)."""
    keys, other = ApiKeys(redis_client, namespace), ApiKeys(redis_client, namespace)
    key = keys.resolve(keys.create("tenant", "acme")).key_id
    create = ApiKeys.create
    raced = []

    def b_rotates_first(self, *args, **kwargs):  # runs inside A's rotate, after A read the key
        token = create(self, *args, **kwargs)
        if not raced:
            raced.append("B")
            other.rotate(key, overlap_s=3600)
        return token

    monkeypatch.setattr(ApiKeys, "create", b_rotates_first)
    _, after = keys.rotate(key, overlap_s=30 * 24 * 3600)
    assert raced and after.expires_at_ms <= int(time.time() * 1000) + 3600 * 1000


def test_revoking_a_revoked_key_keeps_its_first_revocation_time(redis_client, namespace, monkeypatch):
    """Given a revoked key,
    When it is revoked again later,
    Then its revocation time is still the first one (before: moved to the second call's, hiding when it was
    revoked)."""
    keys = ApiKeys(redis_client, namespace)
    key = keys.resolve(keys.create("tenant", "acme")).key_id
    first = keys.revoke(key).revoked_at_ms
    later = time.time() + 5
    monkeypatch.setattr(time, "time", lambda: later)  # the second revocation, five seconds on
    assert keys.revoke(key).revoked_at_ms == first
