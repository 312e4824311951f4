"""Standard Webhooks signatures: the specification's published example, our own verifier, and the
reference library as an independent check of what we sign."""

import time

import pytest
from standardwebhooks.webhooks import Webhook

from streams.webhooks.model import Endpoint, Secret
from streams.webhooks.signing import InvalidSignature, headers, new_secret, sign, verify

# The example published with the Standard Webhooks specification (and its reference libraries).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID, SPEC_TS, SPEC_BODY = "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_our_signature_matches_the_specifications_published_example():
    assert sign(SPEC_SECRET, SPEC_ID, SPEC_TS, SPEC_BODY) == SPEC_SIGNATURE


def test_our_verifier_accepts_the_published_example_and_refuses_tampering():
    h = {"webhook-id": SPEC_ID, "webhook-timestamp": str(SPEC_TS), "webhook-signature": SPEC_SIGNATURE}
    verify(h, SPEC_BODY, SPEC_SECRET, now=SPEC_TS + 10)
    with pytest.raises(InvalidSignature, match="no signature matches"):
        verify(h, b'{"test": 2432232315}', SPEC_SECRET, now=SPEC_TS + 10)
    with pytest.raises(InvalidSignature, match="from now"):
        verify(h, SPEC_BODY, SPEC_SECRET, now=SPEC_TS + 301)  # outside the 5-minute tolerance
    with pytest.raises(InvalidSignature, match="missing"):
        verify({"webhook-id": SPEC_ID}, SPEC_BODY, SPEC_SECRET, now=SPEC_TS)


@pytest.mark.parametrize("timestamp", ["1" + "0" * 400, "+1674087231", "1_674_087_231", "１６７４０８７２３１", " 1674087231"])
def test_a_timestamp_that_is_not_plain_digits_is_an_invalid_signature_not_a_crash(timestamp):
    """A forged delivery whose webhook-timestamp is 401 digits raised OverflowError (a receiver catching
    InvalidSignature to answer 401 answered 500); signs, underscores and non-ASCII digits were read as a time."""
    h = {"webhook-id": SPEC_ID, "webhook-timestamp": timestamp, "webhook-signature": SPEC_SIGNATURE}
    with pytest.raises(InvalidSignature, match="not a Unix time"):
        verify(h, SPEC_BODY, SPEC_SECRET, now=SPEC_TS)


def test_the_reference_library_verifies_what_we_sign_with_either_secret_during_a_rotation():
    old, new = new_secret(), new_secret()
    body, ts = b'{"type":"invoice.paid","data":{"id":7}}', int(time.time())
    signed = headers([new, old], "dlv_1", ts, body)
    assert len(signed["webhook-signature"].split()) == 2
    for secret in (old, new):
        assert Webhook(secret).verify(body, signed)["data"]["id"] == 7
        verify(signed, body, secret, now=time.time())
    with pytest.raises(InvalidSignature):
        verify(signed, body, new_secret(), now=time.time())


def test_an_endpoints_repr_never_shows_its_signing_secrets():
    """An endpoint in a log line, an assertion message or a traceback's locals shows its secrets' expiry, never
    their value (the dataclass repr showed every `whsec_` secret in full)."""
    ep = Endpoint("ep_1", "acme", "https://hooks.acme.test/in", ("*",),
                  secrets=(Secret("whsec_current"), Secret("whsec_previous", expires_at_ms=1)))
    assert "whsec_" not in repr(ep) and "whsec_" not in str(ep)
    assert ep.signing_secrets(0) == ["whsec_current", "whsec_previous"]
