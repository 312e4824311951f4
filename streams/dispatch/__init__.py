"""The lane worker and its parts: what a message becomes (`intake`), per-tenant queues
(`tenant_queues`, pure), provider requests (`requests`), outcomes (`settle`), what is written to
Kafka (`records`), why partitions are paused (`pauses`) and processed_jobs (`idempotency`)."""
