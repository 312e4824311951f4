"""How many alert emails one tenant's endpoints may send in an hour (pure)."""

from streams.health.budget import HOUR_S, AlertBudget
from streams.health.rules import alert_email


def test_a_tenant_gets_at_most_its_alerts_an_hour_and_another_tenant_is_not_counted_with_it():
    budget = AlertBudget(per_hour=3)
    assert [budget.take("noisy", "dropped", t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert budget.take("quiet", "dropped", 3)
    assert not budget.take("noisy", "dropped", HOUR_S - 1)
    assert budget.take("noisy", "dropped", HOUR_S + 0.5)  # the first one is an hour old


def test_a_burst_of_dropped_alerts_leaves_room_for_an_endpoint_stopped_alert():
    """Given a tenant whose endpoints sent their hour's whole budget of `dropped` alerts,
    When one of its endpoints is then disabled (`stopped`) in the same hour,
    Then that alert still goes out (the tenant must learn an endpoint gets nothing any more), within a budget of
    its own: `stopped` alerts are bounded too."""
    budget = AlertBudget(per_hour=3)
    assert [budget.take("acme", "dropped", t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert [budget.take("acme", "stopped", t) for t in (4, 5, 6, 7)] == [True, True, True, False]


def test_an_alert_names_the_endpoints_host_never_its_path_or_query():
    """A URL's path and query are the tenant's own text and may hold a token: the email names the host."""
    mail = alert_email("stopped", "ep_1", "https://hooks.example.com/in/URGENT-call-us?token=s3cret", "acme",
                       "HTTP 500", ["ops@acme.test"], "alerts@dual-rail.test")
    assert "hooks.example.com" in mail["text"] and "ep_1" in mail["text"]
    assert "URGENT" not in mail["text"] and "s3cret" not in mail["text"]
    assert "(deleted)" in alert_email("dropped", "ep_2", "(deleted)", "acme", "HTTP 500", [], "a@b.test")["text"]
