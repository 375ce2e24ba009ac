"""The `config.mesh` section: device-mesh axis sizes, with -1 to fill.

Axes, outermost first: data (pure data parallel: params replicated), fsdp (data parallel
whose params and optimiser state are sharded over it), tensor (heads, FFN hidden, vocab),
expert (routed experts). The product must equal the device count; at most one axis is -1,
and takes what the others leave. `resolve` checks that against the devices and the model
(experts divisible by the expert axis, query heads by the tensor axis) and names the field,
before anything compiles.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from agentic_rl.config_schema import check, from_config_dict, is_int, to_config_dict

AXES = ("data", "fsdp", "tensor", "expert")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1

  def __post_init__(self):
    for axis in AXES:
      size = getattr(self, axis)
      check(is_int(size) and (size >= 1 or size == -1), axis, size,
            "a positive axis size, or -1 to take the devices the other axes leave")
    fill = [a for a in AXES if getattr(self, a) == -1]
    check(len(fill) <= 1, fill[-1] if fill else "data", -1,
          f"at most one axis set to -1 (here {fill})")

  def resolve(self, num_devices: int) -> dict[str, int]:
    """Axis name -> size for `num_devices` devices, the -1 axis filled."""
    sizes = {a: getattr(self, a) for a in AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
      check(num_devices % fixed == 0, fill[0], -1,
            f"a size that fills {num_devices} devices, but the other axes multiply to "
            f"{fixed}, which does not divide {num_devices}")
      sizes[fill[0]] = num_devices // fixed
    product = math.prod(sizes.values())
    check(product == num_devices, "data", sizes["data"],
          f"axis sizes whose product equals the {num_devices} devices; "
          f"{' x '.join(f'{a}={s}' for a, s in sizes.items())} = {product}")
    return sizes


def check_model(sizes: dict[str, int], model_spec) -> None:
  """The model divides over the mesh: query heads over tensor, experts over expert."""
  tensor, expert = sizes["tensor"], sizes["expert"]
  if model_spec.num_heads % tensor:
    raise ValueError(f"config.mesh.tensor={tensor} does not divide config.model.num_heads="
                     f"{model_spec.num_heads}: each tensor shard holds whole query heads.")
  experts = model_spec.moe.num_experts
  if expert > 1 and (experts == 0 or experts % expert):
    raise ValueError(f"config.mesh.expert={expert} does not divide config.model.moe."
                     f"num_experts={experts}: each expert shard holds whole experts.")


def default_mesh_config() -> ml_collections.ConfigDict:
  """config.mesh: every device on the data axis (what runs did before there was a mesh)."""
  return to_config_dict(MeshSpec())


def validate_mesh_config(mesh_config) -> MeshSpec:
  return from_config_dict(MeshSpec, mesh_config, "config.mesh")


def parse_flag(text: str) -> MeshSpec:
  """'data=2,fsdp=2,expert=2' (axes left out are 1; -1 fills) -> MeshSpec."""
  sizes = {a: 1 for a in AXES}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, value = part.partition("=")
    if not eq or name not in AXES:
      raise ValueError(f"--mesh={text!r}: expected comma-separated axis=size with axes "
                       f"from {AXES}, got {part!r}.")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(f"--mesh={text!r}: {name}={value!r} is not an integer.") from None
  return validate_mesh_config(sizes)
