"""Per-device memory of a config on a mesh: params, optimiser, gradients, activations, KV cache.

    python -m launch.memory_plan --config configs/qwen3_30b_a3b.py --json
    python -m launch.memory_plan --config configs/full_scale.py \
        --mesh data=1,fsdp=16,tensor=4,expert=16 --hbm_gib 95 --json

From eval_shape and the sharding rules only: nothing is allocated, so a 30B model plans on
a laptop (agentic_rl/parallel/memory_plan.py says what each term counts). The mesh is
--mesh, else config.mesh; every axis needs a size (no -1: there are no devices to fill).
The workload is the flags, else the config's `workload` section (batch, seq_len, slots,
rollout_len; configs/qwen3_30b_a3b.py has one), else the config's learner batch (config.train.groups_per_step x
config.rollout.group_size sequences of config.rollout.max_len) and its rollout slots, when
the config has those sections. Prints {"per_device_bytes", "breakdown", "hbm_bytes", "fits",
"mesh"}.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags

from launch import config_flag

_CONFIG = config_flag.define_config("configs/qwen3_30b_a3b.py", "Config file.")
_MESH = flags.DEFINE_string("mesh", None, "e.g. data=2,fsdp=8,expert=4 (default config.mesh).")
_HBM_GIB = flags.DEFINE_float("hbm_gib", None, "Device memory in GiB (default config's).")
_BATCH = flags.DEFINE_integer("batch", None, "Learner sequences per micro-batch (global).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Learner tokens per sequence.")
_SLOTS = flags.DEFINE_integer("slots", None, "Rollout slots (global).")
_ROLLOUT_LEN = flags.DEFINE_integer("rollout_len", None, "Cache capacity per slot.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line.")


def _get(config, path, default):
  node = config
  for key in path.split("."):
    if key not in node:
      return default
    node = node[key]
  return node


def main(argv):
  del argv
  from agentic_rl.model.config import validate
  from agentic_rl.parallel import memory_plan
  from agentic_rl.parallel.mesh_config import (AXES, check_model, parse_flag,
                                               validate_mesh_config)
  from agentic_rl.rl import config as rl_config
  from agentic_rl.rl.train_step import make_optimizer

  config = _CONFIG.value
  spec = validate(config.model)
  mesh = parse_flag(_MESH.value) if _MESH.value else validate_mesh_config(
      _get(config, "mesh", {}))
  if any(getattr(mesh, a) == -1 for a in AXES):
    raise app.UsageError(f"every mesh axis needs a size to plan ({mesh}); pass --mesh.")
  sizes = {a: getattr(mesh, a) for a in AXES}
  check_model(sizes, spec)
  max_len = (_get(config, "workload.seq_len", 0) or _get(config, "rollout.max_len", 0)
             or spec.max_seq_len)
  batch = _BATCH.value or _get(config, "workload.batch", 0) or (
      _get(config, "train.groups_per_step", 8) * _get(config, "rollout.group_size", 1))
  rl = rl_config.validate(_get(config, "rl", rl_config.default_rl_config()))
  hbm = _HBM_GIB.value if _HBM_GIB.value is not None else _get(config, "hbm_gib", None)
  report = memory_plan.plan(
      spec, sizes, batch=batch, seq_len=_SEQ_LEN.value or max_len,
      slots=_SLOTS.value or _get(config, "workload.slots", 0) or _get(
          config, "rollout.num_slots", batch),
      rollout_len=_ROLLOUT_LEN.value or _get(config, "workload.rollout_len", 0) or max_len, optimizer=make_optimizer(rl),
      kl_reference=rl.loss.kl_coef > 0,
      hbm_bytes=None if hbm is None else int(hbm * 2 ** 30))
  if _JSON.value:
    print(json.dumps(report))
    return
  gib = 2 ** 30
  print(f"mesh {sizes} ({report['devices']} devices)")
  for name, b in report["breakdown"].items():
    print(f"  {name:<12} {b / gib:10.2f} GiB")
  print(f"  {'total':<12} {report['per_device_bytes'] / gib:10.2f} GiB"
        + ("" if hbm is None else f" of {hbm} GiB: {'fits' if report['fits'] else 'DOES NOT FIT'}"))


if __name__ == "__main__":
  app.run(main)
