import json

import pytest

from moetune.api import storage
from moetune.workers.data.rows import load_rows
from moetune.workers.data.sampling import eval_micro_batches, step_micro_batches
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.sft import collate, tokenize_row, tokenize_rows
from moetune.workers.errors import DatasetError
from moetune.workers.tiny import tiny_rows


def _write(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return f"file://{path}"


GOOD_TEXT = json.dumps({"text": "hello"})
GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.mark.parametrize("bad, problem", [
    ("{not json", "row 3: not valid JSON"),
    ("[1, 2]", "row 3: must be a JSON object"),
    (json.dumps({"text": "a", "messages": []}), "row 3: must have exactly one of 'text' or 'messages'"),
    (json.dumps({"text": ""}), "row 3: 'text' must be a non-empty string"),
    (json.dumps({"messages": []}), "row 3: 'messages' must be a non-empty list"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}),
     "row 3: 'messages[1].content' must be a string or a non-empty list of content parts"),
    (json.dumps({"messages": [{"role": "robot", "content": "q"}]}), "row 3: 'messages[0].role' must be one of"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}), "row 3: 'messages' must contain an assistant"),
])
def test_malformed_row_names_file_and_row(tmp_path, bad, problem):
    uri = _write(tmp_path, [GOOD_TEXT, GOOD_CHAT, bad, GOOD_TEXT])
    with pytest.raises(DatasetError) as err:
        load_rows(uri, "training_file")
    assert str(err.value).startswith(f"training_file {uri} {problem}")
    assert (err.value.code, err.value.param) == ("invalid_training_file", "training_file")


def test_blank_lines_keep_row_numbers(tmp_path):
    uri = _write(tmp_path, [GOOD_TEXT, "", "{}"])
    with pytest.raises(DatasetError, match="row 3:"):
        load_rows(uri, "validation_file")


def test_missing_and_empty_files(tmp_path, s3_bucket):
    with pytest.raises(DatasetError, match=f"training_file s3://{s3_bucket}/nope.jsonl does not exist"):
        load_rows(f"s3://{s3_bucket}/nope.jsonl", "training_file")
    storage.write_bytes(f"s3://{s3_bucket}/empty.jsonl", b"\n")
    with pytest.raises(DatasetError, match="holds no rows"):
        load_rows(f"s3://{s3_bucket}/empty.jsonl", "training_file")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _trained_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t in example.labels if t != IGNORE])


def test_text_rows_train_every_token_plus_eos(tokenizer):
    example = tokenize_row(tokenizer, {"text": "abc abc"}, seq_len=64)
    assert example.labels == example.input_ids
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert _trained_text(tokenizer, example) == "abc abc</s>"


def test_text_parts_train_exactly_as_the_equivalent_string(tokenizer, tmp_path):
    """OpenAI's list-of-parts content without images renders as its text parts joined, as templates that loop over
    parts render them; this tokenizer's template takes strings only, so the join is all it sees."""
    as_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what does "},
                                                          {"type": "text", "text": "ada like?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "ada likes red."}]}]}
    as_string = {"messages": [{"role": "user", "content": "what does ada like?"},
                              {"role": "assistant", "content": "ada likes red."}]}
    assert load_rows(_write(tmp_path, [json.dumps(as_parts)]), "training_file") == [as_parts]
    assert tokenize_row(tokenizer, as_parts, seq_len=256) == tokenize_row(tokenizer, as_string, seq_len=256)
    assert _trained_text(tokenizer, tokenize_row(tokenizer, as_parts, seq_len=256)) == "ada likes red.<|end|>"


def test_chat_rows_train_only_assistant_turns(tokenizer):
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}]}
    example = tokenize_row(tokenizer, row, seq_len=256)
    assert _trained_text(tokenizer, example) == "a1<|end|>a2<|end|>"
    assert tokenizer.decode(example.input_ids).startswith("<s><|system|>be brief<|end|><|user|>q1")


def test_chat_without_template_uses_fallback(tokenizer):
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    example = tokenize_row(plain, row, seq_len=64)
    assert _trained_text(plain, example) == "a</s>\n"


def test_truncation_and_rows_without_trained_tokens(tokenizer):
    long_prompt = {"messages": [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "a"}]}
    kept, dropped = tokenize_rows(tokenizer, [long_prompt, {"text": "y" * 100}], seq_len=16)
    assert dropped == 1 and len(kept) == 1 and len(kept[0].input_ids) == 16


def test_collate_pads_with_ignored_labels(tokenizer):
    examples, _ = tokenize_rows(tokenizer, [{"text": "a"}, {"text": "abcd"}], seq_len=64)
    batch = collate(examples, tokenizer.pad_token_id)
    assert batch.inputs["input_ids"].shape == (2, 5)
    assert batch.labels[0, 2:].tolist() == [IGNORE] * 3
    assert batch.inputs["input_ids"][0, 2:].tolist() == [tokenizer.pad_token_id] * 3
    assert "attention_mask" not in batch.inputs  # right padding needs none (tests/workers/methods/test_padding.py)
    assert batch.tokens == 2 + 5


def test_ranks_get_distinct_micro_batches_deterministically():
    n, global_batch, micro, world = 10, 8, 2, 2
    for step in range(3):  # step 1 wraps into the second epoch's shuffle
        per_rank = [step_micro_batches(n, step, global_batch, micro, r, world, seed=5) for r in range(world)]
        assert all([len(mb) for mb in mbs] == [micro, micro] for mbs in per_rank)
    # One epoch's worth of steps covers every example once, split between the ranks.
    first_epoch = [i for s in range(2) for r in range(world)
                   for mb in step_micro_batches(16, s, global_batch, micro, r, world, seed=5) for i in mb]
    assert sorted(first_epoch) == list(range(16))
    assert step_micro_batches(n, 1, 8, 2, 1, 2, seed=5) == step_micro_batches(n, 1, 8, 2, 1, 2, seed=5)
    assert step_micro_batches(n, 1, 8, 2, 1, 2, seed=5) != step_micro_batches(n, 1, 8, 2, 1, 2, seed=6)


def test_eval_batches_cover_everything_in_equal_counts():
    shares = [eval_micro_batches(7, 2, r, 2) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 2
    seen = sorted(i for share in shares for mb in share for i in mb if i is not None)
    assert seen == list(range(7))


def test_tiny_dataset_rows_are_valid(tmp_path):
    from moetune.workers.tiny import write_tiny_dataset

    path = write_tiny_dataset(str(tmp_path / "d.jsonl"), n_rows=20, seed=3)
    rows = load_rows(f"file://{path}", "training_file")
    assert rows == tiny_rows(20, 3)
    assert {"text", "messages"} == {key for row in rows for key in row}
