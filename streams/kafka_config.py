"""librdkafka settings shared by every client, each with the guarantee it buys."""

from __future__ import annotations

import logging

_log = logging.getLogger("streams.kafka")


def client_config(bootstrap: str, quiet: bool = False, **extra) -> dict:
    """Common settings; `quiet` routes librdkafka's connection chatter to a silent logger."""
    conf: dict = {
        "bootstrap.servers": bootstrap,
        # librdkafka logs through Python logging instead of raw stderr lines.
        "logger": _quiet if quiet else _log,
    }
    conf.update(extra)
    return conf


_quiet = logging.getLogger("streams.kafka.quiet")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False
