"""After a failed attempt: the pure retry decision (`policy`, with the named policies in
`policies.toml`), the delayed-retry tiers' consumer (`retrier`) and the dead-letter tools (`dlq`)."""
