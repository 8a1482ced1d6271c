"""gmtool verify: hunt for wrong replays before users meet them.

capturable.py  ops that would break capture or freeze host state, with their module paths
dyndims.py     one bucket captured with two compositions: the host scalars baked into the graph
graphnodes.py  CUDA: a captured graph's nodes (kernel, grid, block, scalar arguments, module) via cuda-bindings
nodediff.py    two captures' nodes aligned and compared: the kernels whose launch depends on the composition
scheduler.py   an engine-like stream of steps: arrivals, chunked prefill, decode, finish, block reuse
poison.py      memory a correct graph never reads, filled with NaN or sentinels around a checked replay
taps.py        per-layer outputs copied into persistent buffers: where graph and eager first diverge
faults.py      bugs injected on purpose (--inject), to show each one is caught and named
soak.py        the soak: a mode x memory strategy run, checked every K steps, localized on a mismatch
report.py      verify.json, the table and the verdict
"""
