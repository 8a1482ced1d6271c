"""Measuring: the workbench, the sweep and its probes, how a replay is judged, timing, the hf-compiled peer, the benchmark."""
