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


def test_the_ingest_bulk_process_defaults_to_nice_ten_and_can_be_turned_off():
    """Given no DUAL_RAIL_INGEST_BULK settings, then nice 19, then `off`, then bad values,
    Then batches go to a bulk process at nice 10, then 19; `off` serves them in the API process; a nice value out
    of range or an unknown mode is refused naming its variable."""
    assert Config.from_env({}).ingest_bulk_nice == 10
    assert Config.from_env({"DUAL_RAIL_INGEST_BULK_NICE": "19"}).ingest_bulk_nice == 19
    assert Config.from_env({"DUAL_RAIL_INGEST_BULK": "off", "DUAL_RAIL_INGEST_BULK_NICE": "19"}).ingest_bulk_nice is None
    with pytest.raises(ConfigError, match="DUAL_RAIL_INGEST_BULK_NICE=20 must be from 0 to 19"):
        Config.from_env({"DUAL_RAIL_INGEST_BULK_NICE": "20"})
    with pytest.raises(ConfigError, match="DUAL_RAIL_INGEST_BULK='thread' is not valid"):
        Config.from_env({"DUAL_RAIL_INGEST_BULK": "thread"})


def test_an_ingest_instance_name_must_be_usable_in_a_transactional_id():
    """Given DUAL_RAIL_INGEST_INSTANCE unset, set to a pod's name, then to names with a space or a slash,
    Then it is None (hostname-pid is used), the name, then refused naming the variable and what it may hold."""
    assert Config.from_env({}).ingest_instance is None
    assert Config.from_env({"DUAL_RAIL_INGEST_INSTANCE": "api-7d9f8-x2k4q"}).ingest_instance == "api-7d9f8-x2k4q"
    for bad in ("api 1", "api/1", "x" * 101):
        with pytest.raises(ConfigError, match="DUAL_RAIL_INGEST_INSTANCE=.* must be 1-100 letters, digits"):
            Config.from_env({"DUAL_RAIL_INGEST_INSTANCE": bad})
