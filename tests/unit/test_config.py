"""Settings read from the environment: defaults, and errors that name the variable."""

import re

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


def test_a_lag_reading_age_that_cannot_work_is_refused_at_start_naming_the_variable():
    """YIELD_STALE_AFTER_S=0 made every lag reading stale at once; it is refused, naming the variable."""
    assert Config.from_env({"YIELD_STALE_AFTER_S": "1.5"}).yield_policy.stale_after_s == 1.5
    with pytest.raises(ConfigError,
                       match=r"^environment variable YIELD_STALE_AFTER_S \(0.0\) must be a number of seconds from 1 to 60$"):
        Config.from_env({"YIELD_STALE_AFTER_S": "0"})


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


def test_a_provider_base_url_with_a_path_is_refused_at_start_naming_the_provider_and_the_url():
    """Given RESEND_BASE_URL with a path prefix (/v1), a query, or no host,
    When the settings are read,
    Then the process stops with an error naming the variable, the provider and the URL to give (its host; never
    the path, which may hold a token) (before, every request
    went to /v1/emails, which the allowlist refused in the pool thread: nothing was ever sent, and each send
    was re-sent as an unknown outcome until it was dead-lettered); a bare host, with or without a slash, is
    taken as it is."""
    assert Config.from_env({"RESEND_BASE_URL": "https://api.resend.com"}).providers["resend"].base_url == \
        "https://api.resend.com"
    assert Config.from_env({"SMS_B_BASE_URL": "http://127.0.0.1:18080/"}).providers["sms-b"].base_url == \
        "http://127.0.0.1:18080/"
    with pytest.raises(ConfigError, match=r"RESEND_BASE_URL \(provider 'resend'\) "
                                          r"must name no path.*give 'https://api.example.com'"):
        Config.from_env({"RESEND_BASE_URL": "https://api.example.com/v1"})
    with pytest.raises(ConfigError, match="give 'https://gw.example.com'") as refused:  # a token in the path
        Config.from_env({"SMS_BASE_URL": "https://gw.example.com/bot123:S3CRET"})
    assert "S3CRET" not in str(refused.value)
    with pytest.raises(ConfigError, match="SMS_BASE_URL .*provider 'sms'.* no path, query"):
        Config.from_env({"SMS_BASE_URL": "https://sms.example.com/?region=eu"})
    for bad in ("api.example.com", "ftp://api.example.com", "https://api.example.com:port"):
        with pytest.raises(ConfigError, match="must be an http\\(s\\) URL with a host"):
            Config.from_env({"RESEND_BASE_URL": bad})


@pytest.mark.parametrize("bad", ["https://user:s3cret@api.example.com/v1", "ftp://user:s3cret@api.example.com",
                                 "https://user:s3cret@api.example.com:port", "https://u:s3cret@x@api.example.com/v1",
                                 "https://u:s3/cret@api.example.com/v1", "https://s3cret@api.example.com/v1",
                                 "https:/user:s3cret@api.example.com", "user:s3cret@api.example.com",
                                 "https:\\\\user:s3cret@api.example.com"])
def test_a_password_in_a_refused_provider_base_url_never_reaches_the_error(bad):
    """The refusal names the URL, and for a path the URL to give instead: both with what comes before the `@`
    masked (a password, one holding `@` or `/`, a token given as the user), a scheme with one slash or none
    included (before: those printed the password)."""
    with pytest.raises(ConfigError) as refused:
        Config.from_env({"RESEND_BASE_URL": bad})
    assert "s3cret" not in str(refused.value) and "***@" in str(refused.value)


def test_a_token_in_a_refused_provider_base_urls_query_never_reaches_the_error():
    """Given a provider base URL carrying its API key in the query (`?api_key=...`),
    When the settings refuse it (a base URL names no query),
    Then the error names the variable and the URL to give, never the query (before, the key was printed whole, to
    the role's log)."""
    with pytest.raises(ConfigError) as refused:
        Config.from_env({"RESEND_BASE_URL": "https://api.example.com/?api_key=re_live_SECRET123#anchor9"})
    assert "SECRET123" not in str(refused.value) and "anchor9" not in str(refused.value)
    assert "RESEND_BASE_URL (provider 'resend')" in str(refused.value)
    assert "give 'https://api.example.com'" in str(refused.value)


def test_log_level_is_taken_in_any_case_and_a_wrong_one_is_refused_naming_the_variable():
    """Given LOG_LEVEL unset, `debug`, `Warning`, ` warn` (a name logging also knows), then `bogus`,
    When the settings are read,
    Then the level is INFO, DEBUG, WARNING, WARN, and `bogus` is refused naming the variable and the levels (before,
    any value was taken, and the process then died in the logging setup with a traceback, `Unknown level`)."""
    assert Config.from_env({}).log_level == "INFO"
    assert Config.from_env({"LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert Config.from_env({"LOG_LEVEL": "Warning"}).log_level == "WARNING"
    assert Config.from_env({"LOG_LEVEL": " warn"}).log_level == "WARN"
    with pytest.raises(ConfigError, match="LOG_LEVEL='bogus' is not valid: expected one of NOTSET, DEBUG, INFO"):
        Config.from_env({"LOG_LEVEL": "bogus"})


def test_printing_the_settings_or_a_token_shows_no_secret():
    """Given settings with a Redis password and provider keys, an OAuth client secret and a fetched token,
    When they are printed as Python shows objects (`repr`: a debug log line, a traceback tool's locals),
    Then none of the secrets is shown (before, every one was)."""
    from streams.providers.tokens import Token

    config = Config.from_env({"REDIS_URL": "redis://:hunter2pw@redis.example:6379/0",
                              "RESEND_BASE_URL": "https://user:baseS3cret@api.resend.com",
                              "RESEND_API_KEYS": '{"*": "re_live_abc123"}',
                              "SMS_B_CREDENTIALS": '{"client_id": "c1", "client_secret": "cs_SECRET9"}'})
    shown = repr(config) + repr(Token("eyJhbGciOi.token.sig", 1.0, 0.5))
    for secret in ("hunter2pw", "baseS3cret", "re_live_abc123", "cs_SECRET9", "eyJhbGciOi"):
        assert secret not in shown


@pytest.mark.parametrize("name, value, says", [
    ("DUAL_RAIL_COMMIT_INTERVAL_MS", "0", "must be at least 1 (ms: 0 turns commits off"),
    ("KAFKA_DELIVERY_TIMEOUT_MS", "0", "must be at least 1000"),
    ("PROVIDER_TIMEOUT_S", "nan", "must be a number of seconds above 0"),
    ("PROVIDER_TIMEOUT_S", "0", "must be a number of seconds above 0"),
    ("PROVIDER_AUTH_HOLD_S", "-1", "must be a number of seconds from 0"),
    ("WEBHOOK_TIMEOUT_S", "nan", "must be a number of seconds above 0"),
    ("WEBHOOK_ENDPOINT_CONCURRENCY", "0", "must be at least 1"),
    ("WEBHOOK_BACKLOG_MAX_COUNT", "-5", "must be at least 1"),
    ("WEBHOOK_BACKLOG_MAX_AGE_S", "inf", "must be a number of seconds from 0"),
    ("DUAL_RAIL_RETRY_TIME_SCALE", "0", "must be a number of seconds above 0"),
    ("DUAL_RAIL_TOPIC_NAMESPACE", "a b/", "must be at most 100 letters, digits"),
])
def test_a_setting_that_cannot_work_is_refused_at_start_naming_the_variable(name, value, says):
    """Given a setting that cannot work (a commit interval of 0, which librdkafka takes as no commits at all: the
    transactional lag, read from commits, only grew and marketing stayed paused for good; a timeout that is not a
    number; a concurrency of 0; a topic prefix no topic name may hold),
    When a role reads its settings,
    Then it is refused naming the variable and what it must be (before: each was accepted)."""
    with pytest.raises(ConfigError, match=rf"environment variable {name}=.* {re.escape(says)}"):
        Config.from_env({name: value})
    assert Config.from_env({"WEBHOOK_BACKLOG_MAX_AGE_S": "0", "PROVIDER_AUTH_HOLD_S": "0"}).provider_auth_hold_s == 0


@pytest.mark.parametrize("argv, says", [
    (["worker", "--channel", "email", "--lane", "marketing", "--concurrency", "0"],
     "argument --concurrency: 0 must be at least 1"),
    (["lag-monitor", "--interval", "2"], "argument --interval: 2 must be a number of seconds above 0 and at most 0.5"),
    (["lag-monitor", "--retry-watch-every", "nan"], "argument --retry-watch-every: nan must be a number of seconds"),
])
def test_a_role_argument_that_cannot_work_is_refused_naming_the_option(argv, says, capsys):
    """Given a worker asked for 0 requests in flight (it would consume and never send), a lag monitor asked to read
    every 2 s (a traceback before) or to watch the retry tiers every NaN seconds (a busy loop),
    Then the command is refused naming the option and what it must be."""
    from streams.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert says in capsys.readouterr().err
