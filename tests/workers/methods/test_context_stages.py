"""Staged context length: the schedule's validation and which length each step gets; examples cut to a stage."""

import pytest
from pydantic import ValidationError

from moetune.api.models.training import TrainingSpec
from moetune.workers.loop.tuner import MicroBatchTuner
from moetune.workers.methods.sft import IGNORE, Example, collate


def test_each_step_gets_its_stage_length():
    t = TrainingSpec(seq_len_schedule=[{"until_step": 2, "seq_len": 64}, {"until": 0.5, "seq_len": 128},
                                       {"seq_len": 256}])
    assert t.seq_len == 256  # the longest stage: tokenization and the memory plan use it
    assert [t.seq_len_at(step, total_steps=10) for step in range(1, 11)] == [64] * 2 + [128] * 3 + [256] * 5
    assert TrainingSpec(seq_len=96).seq_len_at(7, 10) == 96


@pytest.mark.parametrize("stages,message", [
    ([{"until_step": 2, "seq_len": 64}], "the last stage runs to the end"),
    ([{"seq_len": 64}, {"seq_len": 128}], "every stage but the last needs"),
    ([{"until_step": 2, "seq_len": 128}, {"seq_len": 64}], "must not shrink"),
    ([{"until_step": 4, "seq_len": 64}, {"until_step": 2, "seq_len": 96}, {"seq_len": 128}], "must increase"),
    ([{"until_step": 2, "until": 0.5, "seq_len": 64}, {"seq_len": 128}], "not both"),
])
def test_bad_schedules_are_refused(stages, message):
    with pytest.raises(ValidationError, match=message):
        TrainingSpec(seq_len_schedule=stages)


def test_a_stage_cuts_examples_and_the_tuner_starts_over():
    e = Example(list(range(10)), [IGNORE] * 4 + list(range(4, 10)))
    short = e.truncated(6)
    assert short.input_ids == list(range(6)) and short.loss_tokens == 2 and e.truncated(64) is e
    assert collate([short, e.truncated(8)], pad_id=0).inputs["input_ids"].shape == (2, 8)
    tuner = MicroBatchTuner(per_rank=8, seq_len=64, budget_bytes=1e6, size=4)
    tuner.ceiling = 4
    tuner.new_stage(256)
    assert (tuner.seq_len, tuner.size, tuner.ceiling) == (256, 1, 4)

