"""How sends come in: the Python SDK (`sdk`), the HTTP ingest API (`api`) with its keys
(`api_keys`), and the send status store kept current from `notif.outcomes` (`status`)."""
