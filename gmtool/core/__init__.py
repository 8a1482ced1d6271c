"""Requests to graphs: buckets, batches, persistent inputs, the paged KV cache, the executor and its backends."""
