"""A session's call queue (service/sessions/records.take_calls): the group takes the oldest call, and with a sample
the samples queued right after it that can share its generation, never past a call of another kind (calls run in
the order they were made) and never more sequences than one generation draws."""

from __future__ import annotations

import time

import pytest

from moetune.api.models.training_sessions import OptimStep, Sample
from moetune.service.sessions import records
from moetune.service.store import SessionRow, Store


@pytest.fixture
def queue(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/moetune.db")
    store.migrate()
    records.add_session(store, SessionRow(id="ses_1", tenant="t", status="ready", created_at=time.time(), spec={},
                                          seed=1, output_uri="s3://o/ses_1"))

    def add(args) -> str:
        return records.add_call(store, "ses_1", args.kind, args.model_dump(mode="json")).id

    def take() -> list[tuple[str, int]]:
        return [(row.id, number) for row, number in records.take_calls(store, "ses_1", attempt=0)]

    yield add, take
    store.close()


def test_consecutive_alike_samples_are_taken_together_in_order(queue):
    add, take = queue
    first = add(Sample(prompts=[[1, 2]], n=4, seed=1))
    alike = [add(Sample(prompts=[[3]], n=2, seed=s, prompt_logprobs=s == 2)) for s in (2, 3)]
    hotter = add(Sample(prompts=[[1, 2]], n=4, temperature=0.5))
    step = add(OptimStep())
    after_step = add(Sample(prompts=[[1, 2]]))
    assert take() == [(first, 1), (alike[0], 2), (alike[1], 3)]
    assert take() == [(hotter, 4)]  # another temperature: its own generation
    assert take() == [(step, 5)]
    assert take() == [(after_step, 6)]  # after the step, not merged into an earlier sample
    assert take() == []


def test_a_generation_draws_at_most_merged_sequences(queue):
    add, take = queue
    calls = [add(Sample(prompts=[[1]] * 4, n=64)) for _ in range(2)]  # 256 sequences each
    assert [call for call, _ in take()] == calls[:1]
    assert [call for call, _ in take()] == calls[1:]
    many = [add(Sample(prompts=[[1]])) for _ in range(records.MERGED_CALLS + 1)]
    assert [call for call, _ in take()] == many[:records.MERGED_CALLS]
    assert [call for call, _ in take()] == many[records.MERGED_CALLS:]


def test_samples_of_other_weights_or_the_base_are_not_merged():
    one = Sample(prompts=[[1]], weights="a").model_dump(mode="json")
    assert Sample.mergeable(one, Sample(prompts=[[2]], n=3, seed=9, weights="a").model_dump(mode="json"))
    assert not Sample.mergeable(one, Sample(prompts=[[1]], weights="b").model_dump(mode="json"))
    assert not Sample.mergeable(one, Sample(prompts=[[1]], adapter=False).model_dump(mode="json"))
    with pytest.raises(ValueError, match="adapter false"):
        Sample(prompts=[[1]], weights="a", adapter=False)
