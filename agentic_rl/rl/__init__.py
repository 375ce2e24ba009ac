"""The RL learner: trajectories in, updates out, the train-inference mismatch always measured.
(The Batch record and the sampling masks it reads live in agentic_rl/records.)

  config           config.rl defaults, validation, RLSpec
  logprobs         target-aligned token log-probs and entropies
  advantages       GRPO, Dr. GRPO, RLOO, turn-level, GAE
  objectives       PPO-clip (clip-higher), GSPO, aggregation, KL to reference, value loss
  corrections      TIS, MIS (token, sequence), IcePop
  mismatch         k1, k3, |d log p|, outliers, routing and block agreement, by turn/position
  learner          the learner's forward with replay, its loss, mismatch_metrics
  train_step       TrainState, AdamW + warmup-cosine + clipping, micro-batches, guard
  task_selection   pass-rate tracker, priorities, the revisited task pool
  dynamic_sampling drop groups with equal rewards, refill
"""
