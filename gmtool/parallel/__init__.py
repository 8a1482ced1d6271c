"""Tensor parallelism (`--tp N`): N ranks, each holding 1/N of the attention heads, the MLP width and the KV heads.

- comm: the process group of this run, the all-reduce op (one opaque op, so a CUDA graph captures the NCCL
  kernel and the CPU tape records one step that replays the gloo collective), record gathering to rank 0.
- shard: the model's q/k/v and gate/up projections split by columns (heads), o and down by rows, an
  all-reduce after each row-parallel layer, from the model's HF base_model_tp_plan where it has one.
- launch: gmtool starting its N processes itself, or running as one rank under torchrun; one-line errors for
  a bad request, a missing rendezvous and a failed rank (naming it; the others are stopped within --tp-timeout).
"""
