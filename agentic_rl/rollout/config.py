"""The rollout engine's config section (`config.rollout`): defaults, validation, frozen spec.

`validate(config.rollout, model_spec)` turns a bad value into a `ValueError`
naming the field (`config.rollout.<field>`), the value and what was expected,
and returns `RolloutSpec`, a hashable view safe as a jit static argument.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.model.config import ModelSpec

# Why a trajectory ended. Env-reported reasons (info['end_reason']) are kept as given.
END_SUBMIT = "submit"  # The environment finished the episode (the agent submitted).
END_TURN_BUDGET = "turn_budget"  # max_turns assistant turns were taken.
END_TOKEN_BUDGET = "token_budget"  # max_total_tokens reached.
END_CONTEXT_LIMIT = "context_limit"  # The slot's cache capacity (max_len) reached.
END_EOS = "eos"  # The model emitted <|eos|> and the environment did not end the episode.
# Failures of one trajectory; it ends there (Trajectory.error holds the exception) and the
# rest of the run goes on.
END_ENV_ERROR = "env_error"  # env_factory, env.reset or env.step raised, or a bad StepResult.
END_RENDER_ERROR = "render_error"  # The tokenizer raised on a prompt, observation or action.
END_REASONS = (END_SUBMIT, END_TURN_BUDGET, END_TOKEN_BUDGET, END_CONTEXT_LIMIT, END_EOS,
               END_ENV_ERROR, END_RENDER_ERROR)  # The engine's own; envs may add theirs.
# Why a model turn ended (per turn, in Trajectory.turn_end_reasons).
TURN_STOP = "stop"  # The model emitted a stop id (<|end_turn|> or <|eos|>).
TURN_MAX_NEW_TOKENS = "max_new_tokens"  # max_new_tokens_per_turn reached; turn truncated.
TURN_BUDGET_CUT = "budget"  # The trajectory's token budget or context limit cut the turn.


def default_rollout_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.num_slots = 8  # Sequences decoded together; each holds one trajectory.
  c.max_len = 0  # Cache capacity per slot in tokens; 0 = model.max_seq_len.
  c.prefill_chunk = 256  # Tokens per prefill call per row (shorter chunks are -1 padded).
  c.prefill_rows = 1  # Rows (slots or prompt-store rows) prefilled per call.
  c.prompt_store_rows = 4  # Prompts prefilled ahead, waiting to be copied into slots.
  c.temperature = 1.0  # 0 = greedy (argmax; recorded as temperature 1, mask = argmax only).
  c.top_k = 0  # 0 = off.
  c.top_p = 1.0  # 1.0 = off.
  c.group_size = 1  # G samples per task (GRPO groups), sharing one prompt prefill.
  c.max_turns = 8  # Model turns per trajectory.
  c.max_total_tokens = 0  # Prompt + model + tool tokens per trajectory; 0 = max_len.
  c.max_new_tokens_per_turn = 256
  c.env_threads = 8  # Host threads stepping environments.
  c.seed = 0  # Base of the per-trajectory sampling seeds.
  c.system_prompt = ""  # Used when the environment has no `system_prompt` of its own.
  return c


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  num_slots: int
  max_len: int
  prefill_chunk: int
  prefill_rows: int
  prompt_store_rows: int
  temperature: float
  top_k: int
  top_p: float
  group_size: int
  max_turns: int
  max_total_tokens: int
  max_new_tokens_per_turn: int
  env_threads: int
  seed: int
  system_prompt: str

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def recorded_temperature(self) -> float:
    """The temperature the learner must divide by (greedy records 1: the mask does the rest)."""
    return 1.0 if self.greedy else self.temperature

  @property
  def token_limit(self) -> int:
    """Tokens a trajectory may hold: the tighter of the budget and the cache capacity."""
    return min(self.max_total_tokens, self.max_len)

  @property
  def token_limit_reason(self) -> str:
    return END_TOKEN_BUDGET if self.max_total_tokens < self.max_len else END_CONTEXT_LIMIT


def _require(ok: bool, field: str, value, expected: str):
  if not ok:
    raise ValueError(f"config.rollout.{field}={value!r}: expected {expected}.")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def validate(rollout_config: ml_collections.ConfigDict, model_spec: ModelSpec) -> RolloutSpec:
  """Checks `config.rollout` against the model and returns its frozen spec."""
  c = rollout_config
  known = set(default_rollout_config().keys())
  unknown = sorted(set(c.keys()) - known)
  if unknown:
    raise ValueError(f"config.rollout has unknown fields {unknown}; expected fields "
                     f"{sorted(known)}.")
  for field in ("num_slots", "prefill_chunk", "prefill_rows", "prompt_store_rows",
                "group_size", "max_turns", "max_new_tokens_per_turn", "env_threads"):
    _require(_is_int(c[field]) and c[field] > 0, field, c[field], "a positive integer")
  for field in ("max_len", "max_total_tokens", "top_k", "seed"):
    _require(_is_int(c[field]) and c[field] >= 0, field, c[field], "an integer >= 0")
  max_len = c.max_len or model_spec.max_seq_len
  _require(max_len <= model_spec.max_seq_len, "max_len", c.max_len,
           f"at most model.max_seq_len={model_spec.max_seq_len} (0 means that value)")
  _require(max_len % model_spec.block_size == 0, "max_len", max_len,
           f"a multiple of model.block_size={model_spec.block_size}")
  _require(c.prefill_rows <= c.num_slots, "prefill_rows", c.prefill_rows,
           f"at most num_slots={c.num_slots} (idle rows of a prefill call are other slots)")
  _require(c.prefill_rows <= c.prompt_store_rows, "prefill_rows", c.prefill_rows,
           f"at most prompt_store_rows={c.prompt_store_rows} (prompts are prefilled there)")
  _require(c.prefill_chunk <= max_len, "prefill_chunk", c.prefill_chunk,
           f"at most the cache capacity max_len={max_len}")
  temperature = float(c.temperature)
  _require(temperature >= 0.0, "temperature", c.temperature, "a number >= 0 (0 = greedy)")
  _require(c.top_k <= model_spec.vocab_size, "top_k", c.top_k,
           f"0 (off) or at most model.vocab_size={model_spec.vocab_size}")
  top_p = float(c.top_p)
  _require(0.0 < top_p <= 1.0, "top_p", c.top_p, "a number in (0, 1] (1 = off)")
  max_total = c.max_total_tokens or max_len
  _require(max_total >= 2, "max_total_tokens", c.max_total_tokens,
           "0 (the cache capacity) or at least 2")
  _require(isinstance(c.system_prompt, str), "system_prompt", c.system_prompt, "a string")
  return RolloutSpec(
      num_slots=c.num_slots, max_len=max_len, prefill_chunk=c.prefill_chunk,
      prefill_rows=c.prefill_rows, prompt_store_rows=c.prompt_store_rows,
      temperature=temperature, top_k=c.top_k, top_p=top_p, group_size=c.group_size,
      max_turns=c.max_turns, max_total_tokens=max_total,
      max_new_tokens_per_turn=c.max_new_tokens_per_turn, env_threads=c.env_threads,
      seed=c.seed, system_prompt=c.system_prompt)
