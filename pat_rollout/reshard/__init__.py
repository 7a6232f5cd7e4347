"""Weight resharding between TP layouts: the pure plan (`reshard.plan`, re-exported from
`layout.transition`) and its execution on one device's shards (`reshard.apply`, torch).

This package root imports nothing eagerly, so importing `reshard.plan` stays torch-free.
Must not import ray or sglang; `apply` reaches other devices only through `comm.transport`.
"""
