"""Settings read from the environment: defaults, and errors that name the variable."""

import pytest

from streams.config import Config
from streams.errors import ConfigError


def test_marketing_nice_defaults_to_ten_and_names_the_variable_when_out_of_range():
    """Given no DUAL_RAIL_MARKETING_NICE, then 0, then 25 and "low",
    When the settings are read,
    Then the default is 10, 0 turns it off, and 25 or "low" are refused naming the variable and the value."""
    assert Config.from_env({}).marketing_nice == 10
    assert Config.from_env({"DUAL_RAIL_MARKETING_NICE": "0"}).marketing_nice == 0
    with pytest.raises(ConfigError, match="DUAL_RAIL_MARKETING_NICE=25 must be from 0 to 19"):
        Config.from_env({"DUAL_RAIL_MARKETING_NICE": "25"})
    with pytest.raises(ConfigError, match="DUAL_RAIL_MARKETING_NICE"):
        Config.from_env({"DUAL_RAIL_MARKETING_NICE": "low"})
