"""train/learner_lengths.py: the fixed set of RL learner lengths, by hand."""

import pytest

from agentic_rl.train import learner_lengths as ll


def test_default_quarters_of_max_len_rounded_up_to_128():
  assert ll.learner_lengths((), 768) == (256, 384, 640, 768)
  assert ll.learner_lengths((), 1024) == (256, 512, 768, 1024)
  assert ll.learner_lengths((), 100) == (100,)  # Never above max_len.


def test_configured_lengths_sorted_and_checked():
  assert ll.learner_lengths((1024, 300, 300), 1000) == (300, 1024)
  with pytest.raises(ValueError, match=r"config.train.learner_lengths=\(256, 512\).*"
                                       r"config.rollout.max_len=768"):
    ll.learner_lengths((256, 512), 768)
  with pytest.raises(ValueError, match="positive"):
    ll.learner_lengths((0, 768), 768)


def test_bucket_is_the_smallest_that_holds():
  lengths = (256, 384, 640, 768)
  assert [ll.bucket(n, lengths) for n in (1, 256, 257, 700, 768)] == [256, 256, 384, 768, 768]
  with pytest.raises(ValueError, match="769 tokens"):
    ll.bucket(769, lengths)


def test_trainer_resolves_max_len_0_to_the_models_max_seq_len(tmp_path):
  # An imported HF run config leaves rollout.max_len at 0 (the model's max_seq_len).
  from agentic_rl.train.trainer import Trainer
  from tests.train.tiny_config import tiny_config
  config = tiny_config()
  config.rollout.max_len = 0
  trainer = Trainer(config, str(tmp_path))
  try:
    assert trainer.learner_lengths[-1] == config.model.max_seq_len
    assert trainer.learner_lengths == ll.learner_lengths((), config.model.max_seq_len)
  finally:
    trainer.close()
