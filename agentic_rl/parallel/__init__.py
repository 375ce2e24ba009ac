"""Parallelism: the device mesh (`config.mesh`), the one table of logical-axis rules, and
sharded placement of params, optimiser state, batches and caches."""
