"""Webhook signing secrets sealed at rest: what `WEBHOOK_SECRET_KEYS` accepts (and how it says what is
wrong without showing a key), and that a sealed secret opens only with its key and for its endpoint."""

import base64

import pytest

from streams.config import Config
from streams.errors import ConfigError
from streams.webhooks.sealing import Sealer, UnsealError, open_secret, seal

K1, K2 = base64.b64encode(b"1" * 32).decode(), base64.b64encode(b"2" * 32).decode()
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_a_sealed_secret_opens_with_its_key_for_its_endpoint_only():
    """Given keys k2 (first, seals) and k1,
    When a secret is sealed for endpoint ep_a,
    Then the stored value shows neither the secret nor a key, opens for ep_a (also where only k2 is listed),
    and refuses to open for ep_b (a sealed value copied onto another endpoint) or once altered."""
    sealer = Sealer.parse(f"k2:{K2},k1:{K1}")
    stored = seal(SECRET, "ep_a", sealer)
    assert stored.startswith("sealed:v1:k2:") and SECRET not in stored and SECRET[6:] not in stored
    assert open_secret(stored, "ep_a", sealer) == SECRET
    assert open_secret(stored, "ep_a", Sealer.parse(f"k2:{K2}")) == SECRET
    assert seal(SECRET, "ep_a", sealer) != stored  # a fresh nonce every time
    with pytest.raises(UnsealError, match="sealed for another endpoint"):
        open_secret(stored, "ep_b", sealer)
    altered = stored[:-6] + ("A" if stored[-6] != "A" else "B") + stored[-5:]
    with pytest.raises(UnsealError):
        open_secret(altered, "ep_a", sealer)


def test_a_secret_sealed_under_a_key_no_longer_listed_names_the_key_not_the_secret():
    stored = seal(SECRET, "ep_a", Sealer.parse(f"old:{K1}"))
    with pytest.raises(UnsealError, match="sealed with key 'old', which WEBHOOK_SECRET_KEYS does not list") as e:
        open_secret(stored, "ep_a", Sealer.parse(f"new:{K2}"))
    assert SECRET not in str(e.value)
    with pytest.raises(UnsealError, match="WEBHOOK_SECRET_KEYS is not set"):
        open_secret(stored, "ep_a", None)


def test_without_keys_secrets_are_stored_and_read_as_they_are():
    assert seal(SECRET, "ep_a", None) == SECRET
    assert open_secret(SECRET, "ep_a", Sealer.parse(f"k1:{K1}")) == SECRET  # stored before keys were set


@pytest.mark.parametrize("setting, says", [
    (f"{K1}", "entry 1 must be <key id>:<base64 key>"),
    (f"k1:{K1},bad id:{K2}", "entry 2 must be"),
    ("k1:not*base64", "the key of 'k1' is not base64"),
    (f"k1:{base64.b64encode(b'x' * 16).decode()}", "is 16 bytes; AES-256 takes 32"),
    (f"k1:{K1},k1:{K2}", "listed twice"),
])
def test_a_wrong_key_setting_is_refused_at_start_naming_the_entry_never_the_key(setting, says):
    with pytest.raises(ConfigError, match=says) as e:
        Config.from_env({"WEBHOOK_SECRET_KEYS": setting})
    assert K1 not in str(e.value) and K2 not in str(e.value)


def test_keys_never_show_in_a_repr():
    config = Config.from_env({"WEBHOOK_SECRET_KEYS": f"k1:{K1}"})
    assert config.webhook_secret_keys is not None
    assert K1 not in repr(config) and "1111" not in repr(config.webhook_secret_keys)
    assert Config.from_env({}).webhook_secret_keys is None


def _delivery(sealer):
    from streams.webhooks.delivery import WebhookDelivery

    d = WebhookDelivery.__new__(WebhookDelivery)  # only its secret opening: no endpoint view, no sessions
    d.sealer, d._unseal_logged = sealer, {}
    return d


def test_a_previous_secret_that_does_not_open_is_left_out_but_the_current_one_must_open():
    """Given an endpoint whose previous secret is sealed under a key no longer listed,
    When a delivery is signed,
    Then it is signed with the current secret alone (its receiver holds that one); and when the current secret
    does not open, nothing is signed (the attempt is not sent)."""
    from streams.webhooks.model import Endpoint, Secret

    listed, dropped = Sealer.parse(f"new:{K2}"), Sealer.parse(f"old:{K1}")
    previous, current = "whsec_" + "P" * 32, "whsec_" + "C" * 32
    ep = Endpoint("ep_a", "acme", "https://hooks.example/x", ("*",), secrets=(
        Secret(seal(current, "ep_a", listed)), Secret(seal(previous, "ep_a", dropped), expires_at_ms=2**62)))
    assert _delivery(listed)._open_secrets(ep, 0) == [current]
    assert _delivery(dropped)._open_secrets(ep, 0) == []
