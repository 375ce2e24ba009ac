"""What saved params were trained under: the model's layout, its cache and its tokenizer.

Params load into any model of the same shapes, but a run resumed (or started from another
run's params) under a different layer pattern, block size, window, cache dtype, kernel
backend or tokenizer samples a different policy than the one that produced them, silently;
a checkpoint resumed under the other scan_layers holds another param tree (stacked or not).
Every checkpoint records this fingerprint; a shipped base's config.json implies it. A load
whose fingerprint differs fails and names the fields, unless
`config.train.allow_fingerprint_change` lists each of them (a deliberate change, e.g. route
A's dense F layers in place of G, which reuse the same parameters).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from agentic_rl import resources
from agentic_rl.model.config import expand_pattern
from agentic_rl.train.params_file import file_sha256

FIELDS = ("layer_pattern", "block_size", "sliding_window", "cache_dtype", "kernel_backend",
          "scan_layers", "tokenizer")
# What a fingerprint saved before a field existed means by its absence.
_BEFORE = {"scan_layers": False}
# Fields a params file does not fix: it holds the unrolled layout whatever the run that
# wrote it scanned (params_file.py), so it loads into any. Its fingerprint says None.
_FILE_FREE = ("scan_layers",)


def tokenizer_hash(tokenizer_config: Mapping[str, Any]) -> str:
  """'byte', or 'hf:' + the sha256 of the tokenizer.json and its special-token names, and
  with a chat template, of the template's text, tokenizer_config.json and the stop tokens."""
  kind = tokenizer_config.get("kind", "byte")
  if kind != "hf":
    return str(kind)
  path = resources.resolve(tokenizer_config["path"])
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  specials = json.dumps(dict(tokenizer_config.get("special_tokens", {})), sort_keys=True)
  text = f"{file_sha256(path)}\n{specials}"
  chat_template = tokenizer_config.get("chat_template", "")
  if chat_template:  # Without one the hash stays what it was, so old checkpoints still load.
    from agentic_rl.rollout.chat_template import load_template_dir
    template, config, _ = load_template_dir(directory, chat_template)
    layout = {"template": template, "tokenizer_config": config,
              "stop_tokens": list(tokenizer_config.get("stop_tokens", ()))}
    text += "\n" + json.dumps(layout, sort_keys=True)
  return "hf:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def model_layout(model_config: Mapping[str, Any]) -> dict:
  """The fingerprint fields a config's `model` section sets (all but the tokenizer)."""
  return {
      "layer_pattern": "".join(expand_pattern(str(model_config["layer_pattern"]),
                                              int(model_config["num_layers"]))),
      "block_size": int(model_config["block_size"]),
      "sliding_window": int(model_config["sliding_window"]),
      "cache_dtype": str(model_config["cache_dtype"]),
      "kernel_backend": str(model_config["kernel_backend"]),
      "scan_layers": bool(model_config.get("scan_layers", _BEFORE["scan_layers"])),
  }


def fingerprint(model_config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> dict:
  """The fingerprint of a config's `model` and `tokenizer` sections (ConfigDicts or dicts)."""
  return {**model_layout(model_config), "tokenizer": tokenizer_hash(tokenizer_config)}


def of_config_json(path: str) -> dict | None:
  """The fingerprint a shipped base's config.json implies, or None without one; the
  fields the params file beside it does not fix (`_FILE_FREE`) are None."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    config = json.load(f)
  return {**fingerprint(config["model"], config["tokenizer"]),
          **{f: None for f in _FILE_FREE}}


def check(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
          allowed: tuple[str, ...], source: str) -> list[str]:
  """The fields that differ and are allowed to; raises ValueError naming the others.

  A checkpoint without a fingerprint (saved = None, written before there were any) has
  nothing to compare: it loads, and the caller says so. A field saved as None is one the
  source does not fix (a params file's scan_layers); one it lacks has its value from before
  the field existed.
  """
  if saved is None:
    return []
  saved = {f: saved.get(f, _BEFORE.get(f)) for f in FIELDS}
  differ = [f for f in FIELDS if saved[f] != current.get(f)
            and not (f in _FILE_FREE and saved[f] is None)]
  refused = [f for f in differ if f not in allowed]
  if refused:
    rows = "; ".join(f"{f}: saved {saved.get(f)!r}, now {current.get(f)!r}" for f in refused)
    raise ValueError(
        f"{source} was trained under a different layout ({rows}). Loading it would sample a "
        "different policy than the one that produced it (or, for scan_layers, restore "
        "another param tree). If the change is deliberate, list "
        f"the fields in config.train.allow_fingerprint_change (e.g. {tuple(refused)!r}).")
  return differ
