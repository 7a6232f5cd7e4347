"""The reference backend (`backend="reference"`): one Ray actor per device (`ShardWorker`, holding one TP shard of
the reference engine), the `WorkerGroup` that calls them, the reconfiguration and rebalance protocols that run on
them, and `RefPool`, the driver's `Pool` over them (built by `backend.py`).

Only this package and verl/ import ray; importing the package itself does not.
"""
