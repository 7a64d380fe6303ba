"""The tools beside the services: benchmarks, the demo, trace replay, and test support."""
