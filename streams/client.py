"""Alias kept for earlier code: the SDK now lives in `streams.ingest.sdk` (`from streams import SendClient`)."""

from .ingest.sdk import SendClient

__all__ = ["SendClient"]
