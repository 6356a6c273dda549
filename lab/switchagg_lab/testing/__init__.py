"""Pieces the test suites, benchmarks and testbed share: a worker process that allreduces
seeded tensors, and the checks of its results against the exact sums."""
