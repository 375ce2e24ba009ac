"""The records rollout writes and the learner reads: `trajectory` (one episode as the engine
recorded it, and `to_batch`), `batch` (the learner's Batch pytree) and `sampling_mask` (the
sampler's top-k/top-p masks, packed). Both `rollout` and `rl` import these; this package
imports neither.
"""
