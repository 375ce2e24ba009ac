"""config.mesh: -1 fills, and a mesh the devices or the model cannot take is an error that
names the field, raised before anything compiles; the rules give every param of the
full-size configs a spec (from shapes only)."""

import jax
import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.model.config import ModelSpec, MoESpec, validate
from agentic_rl.model.transformer import Model
from agentic_rl.parallel import rules
from agentic_rl.parallel.mesh_config import MeshSpec, check_model, parse_flag
from configs import full_scale


def test_minus_one_takes_what_the_other_axes_leave():
  assert MeshSpec().resolve(8) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
  assert MeshSpec(data=2, fsdp=-1, expert=2).resolve(8)["fsdp"] == 2
  assert parse_flag("data=2,fsdp=2,expert=2").resolve(8)["tensor"] == 1


@pytest.mark.parametrize("spec,devices,field", [
    (MeshSpec(data=2, fsdp=2, tensor=1, expert=1), 8, "config.mesh.data"),
    (MeshSpec(data=-1, fsdp=3), 8, "config.mesh.data"),
])
def test_a_mesh_the_devices_cannot_take_names_the_field(spec, devices, field):
  with pytest.raises(ConfigError, match=field.split(".")[-1]):
    spec.resolve(devices)


def test_bad_sizes_name_the_field():
  with pytest.raises(ConfigError, match="config.mesh.fsdp"):
    parse_flag("fsdp=0")
  with pytest.raises(ConfigError, match="at most one axis"):
    parse_flag("data=-1,fsdp=-1")
  with pytest.raises(ValueError, match="axis=size"):
    parse_flag("model=2")


def test_the_model_must_divide_over_the_mesh():
  spec = ModelSpec(num_heads=4, num_kv_heads=2, moe=MoESpec(num_experts=6))
  with pytest.raises(ValueError, match="config.mesh.tensor=8 does not divide "
                                       "config.model.num_heads=4"):
    check_model({"data": 1, "fsdp": 1, "tensor": 8, "expert": 1}, spec)
  with pytest.raises(ValueError, match="config.mesh.expert=4 does not divide "
                                       "config.model.moe.num_experts=6"):
    check_model({"data": 1, "fsdp": 1, "tensor": 1, "expert": 4}, spec)


def test_every_param_of_the_full_scale_model_gets_a_spec():
  spec = validate(full_scale.get_config().model)
  shapes = Model(spec).param_shapes()
  sizes = {"data": 1, "fsdp": 16, "tensor": 4, "expert": 16}
  specs = rules.param_specs(shapes, sizes)
  flat = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, rules.P))
  assert len(flat) == len(jax.tree.leaves(shapes))
  routed = {jax.tree_util.keystr(path): s for path, s in flat if path[-1].key == "w_gate_edf"}
  # scan_layers: a scanned slot's routed experts stand for its 15 layers, r never sharded.
  stacked = [s for key, s in routed.items() if key.startswith("['layers']")]
  unrolled = [s for key, s in routed.items() if not key.startswith("['layers']")]
  assert spec.layer_scan.repeats == 15 and len(stacked) == spec.layer_scan.period
  assert (len(unrolled) + len(stacked) * spec.layer_scan.repeats
          == spec.num_layers - spec.num_dense_layers)
  assert all(s == rules.P(None, "expert", "fsdp", "tensor") for s in stacked)
  assert all(s == rules.P("expert", "fsdp", "tensor") for s in unrolled)
