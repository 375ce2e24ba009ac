"""A config's model sharded over a mesh against one device: the learner's and sampler's paths.

    python -m launch.check_sharding --config configs/quickstart.py \
        --mesh data=2,fsdp=2,expert=2 --json

Prints {"forward_max_abs_diff", "grad_max_abs_diff", "sampler_logp_max_abs_diff",
"ep_path", "devices", "overflow_frac"} (agentic_rl/parallel/check.py). On a CPU with fewer
devices than the mesh needs, it restarts itself with that many emulated devices
(XLA_FLAGS=--xla_force_host_platform_device_count). The MoE runs expert parallel
(--ep_path all_to_all, capacity config.model.moe.capacity_factor) when the mesh has an
expert axis above 1.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app
from absl import flags

from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_MESH = flags.DEFINE_string("mesh", "data=2,fsdp=2,expert=2", "Axis sizes, e.g. data=2,expert=4.")
_EP_PATH = flags.DEFINE_enum("ep_path", "all_to_all",
                             ["all_to_all", "ragged_all_to_all", "dropless"],
                             "The MoE dispatch under the mesh (ragged_all_to_all runs its "
                             "emulation on XLA:CPU).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences (a multiple of the batch shards).")
_LENGTH = flags.DEFINE_integer("length", 32, "Tokens per sequence.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line.")
_FLAG = "--xla_force_host_platform_device_count"


def _ensure_devices(needed: int) -> None:
  """Re-executes under `needed` emulated CPU devices if jax sees fewer (before jax starts)."""
  if _FLAG in os.environ.get("XLA_FLAGS", ""):
    return
  import jax
  if jax.device_count() >= needed or jax.default_backend() != "cpu":
    return
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={needed}",
             JAX_PLATFORMS="cpu")
  os.execve(sys.executable, [sys.executable, "-m", "launch.check_sharding", *sys.argv[1:]], env)


def main(argv):
  del argv
  from agentic_rl.model.config import validate
  from agentic_rl.parallel import check
  from agentic_rl.parallel.mesh_config import AXES, parse_flag

  mesh = parse_flag(_MESH.value)
  if any(getattr(mesh, a) == -1 for a in AXES):
    raise app.UsageError("--mesh: give every axis a size (no -1) to compare on.")
  _ensure_devices(math.prod(getattr(mesh, a) for a in AXES))
  spec = validate(_CONFIG.value.model)
  report = check.compare(spec, mesh, batch=_BATCH.value, length=_LENGTH.value,
                         seed=_CONFIG.value.seed, dispatch=_EP_PATH.value)
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
