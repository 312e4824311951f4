"""State that must outlive Redis: the operator log (`log`, a compacted topic that is the source of
truth for limits and API keys), the guard that detects lost Redis data and rebuilds operator state
(`guard`), and the recovery that rebuilds delivery marks and statuses from `notif.outcomes`."""
