"""Tensor parallelism: one model across several devices of a node, one process per rank.

`sharding` says which slice of each checkpoint tensor a rank holds (pure arithmetic); `group` is a
rank's handle on its collectives (gloo on the CPU, NCCL on GPUs); `workers` is rank 0's side of the
worker processes (start, per-step inputs, liveness), `worker` a worker's main. See docs/parallelism.md.
"""
