"""dual-rail dispatch: multi-tenant notification dispatch on Apache Kafka."""

__version__ = "0.1.0"
