"""The driver side of a PAT pool: glue between the driver's bookkeeping and the pure planner
(`planner_glue`). Imports no ray and no sglang.
"""
