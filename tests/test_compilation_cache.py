"""launch/compilation_cache.py: on by default, off on request, and programs land on disk."""

import os
import subprocess
import sys
import textwrap


def _run(env_value, tmp_path):
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      from launch import compilation_cache
      compilation_cache.MIN_COMPILE_SECONDS = 0.0
      path = compilation_cache.enable()
      print(path)
      print(jax.config.jax_compilation_cache_dir)
      jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))).block_until_ready()
      """)
  env = {**os.environ, "HOME": str(tmp_path / "home")}
  env.pop("AGENTIC_RL_COMPILATION_CACHE", None)
  if env_value is not None:
    env["AGENTIC_RL_COMPILATION_CACHE"] = env_value
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  return out.stdout.split("\n")


def test_default_folder_under_home_fills_with_programs(tmp_path):
  path, config_dir, _ = _run(None, tmp_path)
  assert path == config_dir == str(tmp_path / "home" / ".cache" / "agentic_rl" / "jax")
  assert any(name.startswith("jit_") for name in os.listdir(path))


def test_a_folder_of_ones_own_and_off(tmp_path):
  path, _, _ = _run(str(tmp_path / "cache"), tmp_path)
  assert path == str(tmp_path / "cache") and os.listdir(path)
  path, config_dir, _ = _run("off", tmp_path)
  assert path == "None" and config_dir in ("None", "")
  assert not os.path.exists(tmp_path / "home" / ".cache")
