"""Rates as operators write them: tokens a second, whole or a fraction, or a count per unit."""

import pytest

from streams.cli import main
from streams.errors import ConfigError
from streams.gate.limits import check_provider, check_tenant, parse_rate


@pytest.mark.parametrize(("text", "rate"), [
    ("20", 20), ("0.5", 0.5), ("30/min", 0.5), ("120/minute", 2), ("3600/h", 1), ("100/h", 100 / 3600),
    ("500/day", 500 / 86_400), (" 2 / s ", 2),
])
def test_a_rate_reads_as_tokens_a_second_and_a_whole_one_as_an_integer(text, rate):
    got = parse_rate(text)
    assert got == rate
    assert isinstance(got, int) == float(rate).is_integer()


@pytest.mark.parametrize("text", ["fast", "30/week", "", "1e400", "nan", "/min", "30/"])
def test_what_is_not_a_rate_is_refused_saying_how_to_write_one(text):
    with pytest.raises(ConfigError, match=r"is not a rate: give tokens a second \(20, 0.5\) or a count per unit"):
        parse_rate(text)


def test_a_rate_below_one_a_day_or_not_above_zero_is_refused_and_a_fraction_above_is_taken():
    check_tenant("acme", 0.5, 1)
    check_tenant("acme", parse_rate("1/day"), 1)
    for rate in (0, -1, parse_rate("1/day") / 2):
        with pytest.raises(ConfigError, match="tenant rate must be at least one a day"):
            check_tenant("acme", rate, 1)


def test_a_burst_that_would_take_over_ten_years_to_refill_is_refused():
    """The gate's figures in milliseconds (a bucket's expiry, a wait) must stay integers Redis can read: a burst of 2
    billion at one a day would need 5 million years of refill."""
    check_tenant("acme", parse_rate("1/day"), 3650)
    check_tenant("acme", parse_rate("85/day"), 310_250)  # exactly ten years, whatever the rounding of 85/86,400
    with pytest.raises(ConfigError, match="tenant burst 3651 at 1.15741e-05 a second would take 3,651.0 days to "
                                          "refill, over the 3,650 days allowed: a burst of at most 3,650 at this rate"):
        check_tenant("acme", parse_rate("1/day"), 3651)
    with pytest.raises(ConfigError, match="global burst 2000000000 .* days to refill"):
        check_provider(parse_rate("1/day"), 2_000_000_000, 0)


def test_the_cli_names_a_rate_it_cannot_read_before_touching_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["limits", "set", "--provider", "resend", "--tenant", "acme", "--rate", "30/week", "--burst", "1"])
    assert exit_.value.code == 2
    assert "argument --rate: '30/week' is not a rate" in capsys.readouterr().err
