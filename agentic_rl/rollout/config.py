"""The rollout engine's config section (`config.rollout`): one frozen dataclass.

`RolloutSpec` holds the defaults and checks (agentic_rl/config_schema.py);
`validate(config.rollout, model_spec, seed=config.seed)` builds it by field name, checks it
against the model, and resolves the 0 = "the model's" capacities. A bad value is a
`ValueError` naming `config.rollout.<field>`. The spec is hashable: a jit static argument.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.config_schema import (FieldError, check, derived, from_config_dict,
                                      to_config_dict)
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


def _positive(field: str, value: int) -> None:
  check(value > 0, field, value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  num_slots: int = 8  # Sequences decoded together; each holds one trajectory.
  max_len: int = 0  # Cache capacity per slot in tokens; 0 = model.max_seq_len.
  prefill_chunk: int = 256  # Most tokens per prefill call per row.
  prefill_rows: int = 1  # Most rows (slots or prompt-store rows) prefilled per call.
  # > 0: a prefill call takes the smallest compiled shape that holds its work: chunks
  # halve from prefill_chunk while they keep at least this many tokens, rows halve from
  # prefill_rows down to 1 (prefill_shapes.py). 0: every call is prefill_rows x
  # prefill_chunk. Per call, [1, 16] costs a sixth to a tenth of [4, 64]; end to end
  # it has not yet measured faster (issue 17), hence off by default. On, the shape
  # follows which envs had answered, so a row's logits vary at float32 round-off from
  # run to run: a resumed run no longer equals the uninterrupted one bit for bit.
  prefill_chunk_min: int = 0
  prompt_store_rows: int = 4  # Prompts prefilled ahead, waiting to be copied into slots.
  temperature: float = 1.0  # 0 = greedy (argmax; recorded as temperature 1, mask = argmax).
  top_k: int = 0  # 0 = off.
  top_p: float = 1.0  # 1.0 = off.
  group_size: int = 1  # G samples per task (GRPO groups), sharing one prompt prefill.
  max_turns: int = 8  # Model turns per trajectory (the env's turn budget too).
  max_total_tokens: int = 0  # Prompt + model + tool tokens per trajectory; 0 = max_len.
  max_new_tokens_per_turn: int = 256
  # Decode steps per device call: a jitted loop feeds each slot its own draws and returns
  # when every slot has stopped (stop id, budget) or after this many steps. 1 = a host
  # round trip per token; more saves them, while a slot that stopped early idles until
  # the call returns.
  decode_steps_per_call: int = 8
  env_threads: int = 8  # Host threads stepping environments.
  seed: int = derived(0, "config.seed")  # Base of the per-trajectory sampling seeds.
  system_prompt: str = ""  # Used when the environment has no `system_prompt` of its own.

  def __post_init__(self):
    for name in ("num_slots", "prefill_chunk", "prefill_rows", "prompt_store_rows",
                 "group_size", "max_turns", "max_new_tokens_per_turn", "env_threads",
                 "decode_steps_per_call"):
      _positive(name, getattr(self, name))
    for name in ("max_len", "max_total_tokens", "top_k", "seed", "prefill_chunk_min"):
      check(getattr(self, name) >= 0, name, getattr(self, name), "an integer >= 0")
    check(self.prefill_rows <= self.num_slots, "prefill_rows", self.prefill_rows,
          f"at most num_slots={self.num_slots} (idle rows of a prefill call are other slots)")
    check(self.prefill_rows <= self.prompt_store_rows, "prefill_rows", self.prefill_rows,
          f"at most prompt_store_rows={self.prompt_store_rows} (prompts are prefilled there)")
    check(self.temperature >= 0.0, "temperature", self.temperature,
          "a number >= 0 (0 = greedy)")
    check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1] (1 = off)")
    check(self.max_total_tokens == 0 or self.max_total_tokens >= 2, "max_total_tokens",
          self.max_total_tokens, "0 (the cache capacity) or at least 2")

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


def default_rollout_config() -> ml_collections.ConfigDict:
  return to_config_dict(RolloutSpec())


def validate(rollout_config, model_spec: ModelSpec, *, seed: int | None = None
             ) -> RolloutSpec:
  """`config.rollout` checked against the model, with the run's `config.seed`; capacities
  given as 0 resolved (max_len = model.max_seq_len, max_total_tokens = max_len)."""
  joined = {} if seed is None else {"seed": seed}
  spec = from_config_dict(RolloutSpec, rollout_config, "config.rollout", **joined)
  max_len = spec.max_len or model_spec.max_seq_len
  checks = (
      (max_len <= model_spec.max_seq_len, "max_len", spec.max_len,
       f"at most model.max_seq_len={model_spec.max_seq_len} (0 means that value)"),
      (max_len % model_spec.block_size == 0, "max_len", max_len,
       f"a multiple of model.block_size={model_spec.block_size}"),
      (spec.prefill_chunk <= max_len, "prefill_chunk", spec.prefill_chunk,
       f"at most the cache capacity max_len={max_len}"),
      (spec.top_k <= model_spec.vocab_size, "top_k", spec.top_k,
       f"0 (off) or at most model.vocab_size={model_spec.vocab_size}"),
  )
  try:
    for ok, field, value, expected in checks:
      check(ok, field, value, expected)
  except FieldError as e:
    raise e.at("config.rollout") from None
  return dataclasses.replace(spec, max_len=max_len,
                             max_total_tokens=spec.max_total_tokens or max_len)
