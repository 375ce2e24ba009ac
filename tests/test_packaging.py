"""The project is an installable package: shipped files resolve from any directory, and no
shipped file records a host path."""

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from agentic_rl import resources

ROOT = pathlib.Path(__file__).parents[1]


def _tracked_files():
  out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
  return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def _json_strings(value):
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for v in value.values():
      yield from _json_strings(v)
  elif isinstance(value, list):
    for v in value:
      yield from _json_strings(v)


def test_no_shipped_file_records_a_host_path():
  root = str(ROOT.resolve())
  for path in _tracked_files():
    if not path.is_file() or path.suffix not in (".py", ".json", ".md", ".toml", ".txt", ".sh"):
      continue
    text = path.read_text(encoding="utf-8", errors="replace")
    assert root not in text, f"{path.relative_to(ROOT)} records the checkout's path {root}"
    if path.suffix == ".json" and path.parent.name != "tokenizers":  # Vocabularies hold "/".
      for value in _json_strings(json.loads(text)):
        assert not os.path.isabs(value), f"{path.relative_to(ROOT)}: absolute path {value!r}"


def test_shipped_names_resolve_and_round_trip(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # No configs/ folder here: the shipped package must answer.
  base = resources.resolve("configs/assets/base_tiny_bpe")
  assert os.path.isfile(os.path.join(base, "params.safetensors"))
  assert resources.portable(base) == os.path.join("configs", "assets", "base_tiny_bpe")
  assert resources.resolve("mine.json") == str(tmp_path / "mine.json")
  assert resources.resolve("/abs/x") == "/abs/x"
  assert resources.portable("/elsewhere/x.json") == "/elsewhere/x.json"
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "own.py").write_text("")
  # A user's own file of that name wins over the shipped one.
  assert resources.resolve("configs/own.py") == str(tmp_path / "configs" / "own.py")


def _run_elsewhere(cwd, *args, python=sys.executable, pythonpath=str(ROOT)):
  env = {**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def test_configs_and_launch_commands_work_from_any_directory(tmp_path):
  out = _run_elsewhere(tmp_path, "-m", "launch.model_info", "--config", "configs/quickstart.py",
                       "--config.model.d_model=32", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout)["num_layers"] == 4
  code = ("from configs import quickstart; from agentic_rl import resources;"
          "from agentic_rl.rollout import tokenizer as t; c = quickstart.get_config();"
          "print(t.make_tokenizer(c.tokenizer).vocab_size,"
          " resources.resolve(c.train.init_checkpoint))")
  out = _run_elsewhere(tmp_path, "-c", code)
  assert out.returncode == 0, out.stderr[-2000:]
  vocab, base = out.stdout.split()
  assert int(vocab) == 1024 and base == str(ROOT / "configs" / "assets" / "base_tiny_bpe")


@pytest.mark.slow
def test_the_wheel_installs_and_runs_from_any_directory(tmp_path):
  wheels = tmp_path / "wheels"
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                          str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
  assert build.returncode == 0, build.stderr[-2000:]
  (wheel,) = wheels.glob("agentic_rl-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  for shipped in ("configs/assets/base_tiny_bpe/params.safetensors",
                  "configs/tokenizers/swe_bpe_1k.json", "launch/train.py",
                  "agentic_rl/kernels/dispatch.py", "agentic_rl/resources.py"):
    assert shipped in names, shipped
  assert not any(name.startswith("tests/") for name in names)
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                 check=True, timeout=120)
  python = str(venv / "bin" / "python")
  install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                           capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stderr[-2000:]
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  code = ("import configs, agentic_rl; from agentic_rl import resources;"
          "print(configs.__file__); print(resources.resolve('configs/assets/base_tiny_bpe'))")
  out = _run_elsewhere(elsewhere, "-c", code, python=python, pythonpath="")
  assert out.returncode == 0, out.stderr[-2000:]
  configs_file, base = out.stdout.split()
  assert configs_file.startswith(str(venv)) and base.startswith(str(venv))
  assert os.path.isfile(os.path.join(base, "params.safetensors"))
  out = _run_elsewhere(elsewhere, "-m", "launch.model_info", "--config",
                       "configs/quickstart.py", "--json", python=python, pythonpath="")
  assert out.returncode == 0, out.stderr[-2000:]
