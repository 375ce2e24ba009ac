"""The workload flags both peer scripts take (launch.bench_sampler's names and defaults).
Imported by file name: each peer runs as a script in its own venv."""

import argparse

DEFAULTS = (("batch", 8), ("prompt", 128), ("gen", 128), ("num_layers", 4), ("d_model", 256),
            ("d_ff", 1024), ("num_heads", 4), ("num_kv_heads", 2), ("head_dim", 64),
            ("vocab_size", 512), ("num_experts", 0), ("experts_per_tok", 2),
            ("d_ff_expert", 256), ("repeats", 3))


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser()
  for name, default in DEFAULTS:
    p.add_argument(f"--{name}", type=int, default=default)
  return p.parse_args()
