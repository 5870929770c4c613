"""Multi-token stop strings of a session's sample call (workers/sessions/stops.py) on the tiny checkpoint's byte
tokenizer: the text ends just before the first stop, the tokens are those wholly before it.

Sabotage noted: cutting at the last stop found (max instead of min) fails both tests, and so does keeping the token
after the kept prefix (the straddling one)."""

import pytest

from moetune.workers.sessions.stops import cut_at_stop, stop_reached


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _tokens(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_completion_ends_before_the_first_stop_string(tokenizer):
    decode = tokenizer.decode
    tokens = _tokens(tokenizer, "ada likes red. END bob END")
    assert len(_tokens(tokenizer, " END")) > 1  # a stop the engine could not stop on
    kept, text = cut_at_stop(tokens, decode, ["bob", " END"])
    assert text == "ada likes red." and decode(kept) == text and kept == tokens[: len(kept)]
    assert cut_at_stop(tokens, decode, ["nowhere"]) == (tokens, "ada likes red. END bob END")
    assert cut_at_stop(tokens, decode, ["ada"]) == ([], "")


def test_a_row_ends_at_the_token_that_completes_a_stop(tokenizer):
    """Decoding stops as soon as a row's text holds a stop string; the cut of that shorter row is the cut of the row
    decoded on to its end."""
    decode, stops = tokenizer.decode, ["bob", " END"]
    tokens = _tokens(tokenizer, "ada likes red. END bob END")
    ends_at = next(n for n in range(len(tokens) + 1) if stop_reached(tokens[:n], decode, stops))
    assert decode(tokens[:ends_at]) == "ada likes red. END"
    assert cut_at_stop(tokens[:ends_at], decode, stops) == cut_at_stop(tokens, decode, stops)
    assert not stop_reached(tokens, decode, ["nowhere"])


def test_a_token_straddling_the_stop_is_dropped_with_it():
    """A tokenizer whose tokens hold several characters: the stop 'cd' starts inside the token 'bc'."""
    vocabulary = {1: "ab", 2: "bc", 3: "de", 4: "f"}
    tokens = [1, 2, 3, 4]  # "abbcdef"

    def decode(ids):
        return "".join(vocabulary[i] for i in ids)

    assert cut_at_stop(tokens, decode, ["cd"]) == ([1], "abb")
    assert cut_at_stop(tokens, decode, ["de", "f"]) == ([1, 2], "abbc")
