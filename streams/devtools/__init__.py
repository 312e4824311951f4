"""What only development, benchmarks and the demo use: the local stack (`stack`), a set of
processes started together (`fleet`), the mock provider (`mock_provider`), the naive baseline
(`baseline`), the benchmarks (`bench_*`) and the demo (`demo`). Production code never imports it."""
