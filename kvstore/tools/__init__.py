"""The tools beside the services: benchmarks (``kvstore bench``, with the local Redis and tiny
model they start), the demo, trace replay and the KV-event viewer. matplotlib and tqdm, which
only these use, are the ``kvstore[bench]`` extra (tools.bench.extras)."""
