"""Which model size learns the expert's demonstrations fastest per CPU-second.

    python -m launch.bench_sft_sizes --config configs/sft_base.py --seconds 150 \
        --sizes 64,128,192,256

For each d_model (heads, d_ff and expert widths scale with it; the layer pattern stays),
trains SFT from scratch for a fixed wall-clock budget on the same demonstrations, batch
and learning-rate schedule, and scores the held-out split's demonstrations (token NLL and
accuracy on the expert's tokens) every `--eval_every` seconds. Prints one JSON line per
size and a final JSON line with every curve, so sizes compare at equal CPU time.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.expert import play_expert
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.train import config as train_config_lib
from agentic_rl.train import sft as sft_lib
from launch import config_flag

_CONFIG = config_flag.define_config("configs/sft_base.py", "Config file.")
_SIZES = flags.DEFINE_list("sizes", ["64", "128", "192", "256"], "d_model values.")
_SECONDS = flags.DEFINE_float("seconds", 150.0, "Training wall-clock budget per size.")
_EVAL_EVERY = flags.DEFINE_float("eval_every", 30.0, "Seconds between held-out scores.")
_HELDOUT = flags.DEFINE_integer("heldout_demos", 64, "Held-out demonstrations scored.")


def sized_model_config(base, d_model: int):
  """`base` with width d_model: head_dim 16 per 64 of width, d_ff 2x, experts d/2."""
  m = model_config_lib.default_model_config()
  m.update(base.to_dict())
  scale = d_model / 64
  m.d_model = d_model
  m.head_dim = int(16 * scale)
  m.d_ff = 2 * d_model
  m.moe.d_ff_expert = d_model // 2
  return m


def main(argv):
  del argv
  config = _CONFIG.value
  tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer)
  env_config = env_config_lib.validate_env_config(config.env,
                                                  max_turns=config.rollout.max_turns)
  factory = lambda: SweEnv(env_config)
  tc = train_config_lib.validate_train_config(config.train)
  rows = []
  demos = held = None
  for size in (int(s) for s in _SIZES.value):
    m = sized_model_config(config.model, size)
    spec = model_config_lib.validate(m)
    model = transformer.Model(spec)
    rollout_spec = rollout_config_lib.validate(config.rollout, spec, seed=config.seed)
    if demos is None:
      demos = sft_lib.render_demonstrations(
          tokenizer, rollout_spec, factory,
          [SweTaskSource("train", config=env_config)[i] for i in range(tc.sft_demos)],
          play_expert=play_expert)
      held = sft_lib.render_demonstrations(
          tokenizer, rollout_spec, factory,
          [SweTaskSource("heldout", config=env_config)[i] for i in range(_HELDOUT.value)],
          play_expert=play_expert)
      demos, held = [d for d in demos if d], [d for d in held if d]
      length = sft_lib.padded_length(max(d.length for d in demos + held),
                                     rollout_spec.max_len)
      arrays = sft_lib.demonstration_arrays(demos, length)
      held_arrays = {k: jnp.asarray(v) for k, v in
                     sft_lib.demonstration_arrays(held, length).items()}
    rl_spec = sft_lib.sft_learner_spec(
        rl_config_lib.validate(config.rl, m, config.rollout), tc)
    params = model.init(jax.random.key(0))
    optimizer = train_step_lib.make_optimizer(rl_spec)
    state = train_step_lib.init_train_state(model, params, rl_spec).replace(
        opt_state=optimizer.init(params))
    step_fn = sft_lib.make_sft_step(model, optimizer)
    score_fn = jax.jit(lambda p, b: sft_lib.demonstration_scores(model, p, b))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    def batch():
      rows_ = rng.choice(len(demos), size=tc.sft_batch_size)
      return {k: jnp.asarray(v[rows_]) for k, v in arrays.items()}

    t_compile = time.time()
    state, _ = step_fn(state, batch())
    jax.block_until_ready(state.params)
    jax.block_until_ready(score_fn(state.params, held_arrays))
    compile_s = time.time() - t_compile
    curve, trained, steps, next_eval = [], 0.0, 1, 0.0
    while trained < _SECONDS.value:
      t0 = time.time()
      state, metrics = step_fn(state, batch())
      jax.block_until_ready(metrics)
      trained += time.time() - t0
      steps += 1
      if trained >= next_eval or trained >= _SECONDS.value:
        nll, acc = (float(x) for x in score_fn(state.params, held_arrays))
        curve.append({"seconds": round(trained, 1), "steps": steps,
                      "heldout_nll": nll, "heldout_token_accuracy": acc})
        next_eval += _EVAL_EVERY.value
    row = {"d_model": size, "params": n_params, "seconds_per_step": trained / (steps - 1),
           "tokens_per_s": tc.sft_batch_size * length * (steps - 1) / trained,
           "compile_s": compile_s, "final": curve[-1], "curve": curve}
    print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    rows.append(row)
  print(json.dumps({"benchmark": "sft_sizes", "batch": tc.sft_batch_size, "length": length,
                    "train_demos": len(demos), "heldout_demos": len(held),
                    "seconds_budget": _SECONDS.value, "rows": rows}), flush=True)


if __name__ == "__main__":
  app.run(main)
