"""launch.memory_plan against hand-counted bytes, and the Qwen3-30B-A3B config's plan."""

import json
import os
import subprocess
import sys

from agentic_rl.model.config import ModelSpec, MoESpec
from agentic_rl.model.transformer import Model
from agentic_rl.parallel import memory_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V, D, N, K, H, F = 64, 32, 4, 2, 8, 48
SPEC = ModelSpec(vocab_size=V, d_model=D, num_layers=1, layer_pattern="F", num_heads=N,
                 num_kv_heads=K, head_dim=H, num_dense_layers=1, d_ff=F, tie_embeddings=False,
                 max_seq_len=64, moe=MoESpec(num_experts=0))


def test_params_per_device_by_hand():
  # Every matrix has a d_model axis (fsdp) and one of v, n, k or f (tensor); the three norm
  # scales [D] only d_model.
  matrices = V * D * 2 + D * N * H * 2 + D * K * H * 2 + D * F * 3
  scales = 3 * D
  sizes = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}
  got = memory_plan.tree_bytes_per_device(Model(SPEC).param_shapes(), sizes)
  assert got == 4 * (matrices // 4 + scales // 2)


def test_kv_cache_and_activations_split_over_the_mesh():
  sizes_1 = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  sizes_8 = {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
  one = memory_plan.plan(SPEC, sizes_1, batch=8, seq_len=64, slots=8, rollout_len=64)
  eight = memory_plan.plan(SPEC, sizes_8, batch=8, seq_len=64, slots=8, rollout_len=64)
  # 8 slots of 64 tokens, one F layer: k and v of K heads x H, 4 bytes, + the length counter.
  per_slot = 64 * 2 * K * H * 4 + 4
  assert one["breakdown"]["kv_cache"] == 8 * per_slot
  assert eight["breakdown"]["kv_cache"] == 2 * per_slot // 2  # 2 rows, kv heads over tensor.
  assert eight["breakdown"]["activations"] < one["breakdown"]["activations"] / 6


def test_a_batch_the_mesh_does_not_divide_stays_whole():
  """rules.py keeps an undivided batch whole on every device; so does the plan."""
  one = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  four = {"data": 4, "fsdp": 1, "tensor": 1, "expert": 1}
  for batch in (3, 6):
    kw = dict(batch=batch, seq_len=16, slots=batch, rollout_len=16)
    a, b = memory_plan.plan(SPEC, one, **kw), memory_plan.plan(SPEC, four, **kw)
    assert a["breakdown"]["activations"] == b["breakdown"]["activations"]
    assert a["breakdown"]["kv_cache"] == b["breakdown"]["kv_cache"]


def test_remat_keeps_less_for_the_backward():
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  acts = {policy: memory_plan.activation_bytes(SPEC.replace(num_layers=12, remat=policy),
                                               sizes, 8, 64)
          for policy in ("none", "save_dots", "full")}
  assert acts["full"] < acts["save_dots"] < acts["none"]
  # 'full': each layer's input (D floats a token) plus one whole layer, plus the logits.
  layer = (3 * D + 2 * N * H + 2 * K * H + 3 * F) * 4
  assert acts["full"] == 8 * 64 * (12 * D * 4 + layer + 2 * V * 4)


def test_the_qwen3_30b_a3b_plan_fits_its_slice_and_not_one_chip():
  def run(*args):
    out = subprocess.run([sys.executable, "-m", "launch.memory_plan", "--json",
                          "--config", "configs/qwen3_30b_a3b.py", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
  pod = run()
  assert pod["fits"] and pod["devices"] == 16 and pod["hbm_bytes"] == 95 * 2 ** 30
  assert set(pod["breakdown"]) == {"params", "gradients", "optimizer", "activations",
                                   "kv_cache"}
  # float32 params: ~30.5B x 4 bytes over 16 devices.
  assert 7.4e9 < pod["breakdown"]["params"] < 7.8e9
  # AdamW's two moments, the same shapes and dtype.
  assert abs(pod["breakdown"]["optimizer"] - 2 * pod["breakdown"]["params"]) < 1e6
  assert not run("--config.model.remat=none")["fits"]  # 101.7 GiB a chip.
  assert not run("--mesh", "data=1,fsdp=2,expert=2")["fits"]  # 4 chips: 173.9 GiB each.
  chip = run("--mesh", "data=1")
  assert not chip["fits"] and chip["breakdown"]["params"] > 100e9
