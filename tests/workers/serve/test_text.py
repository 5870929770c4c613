"""Streaming text: no half characters, stop strings on decoded text (cut before them, never shown in part)."""

from moetune.workers.serve.text import StreamingText


class ByteTokenizer:
    """One token per byte, as the tiny tokenizer's byte alphabet (decode joins and decodes the bytes)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop: list[str]) -> tuple[list[str], str, bool]:
    streaming = StreamingText(ByteTokenizer(), stop)
    deltas = []
    for byte in text.encode():
        deltas.append(streaming.add(byte))
        if streaming.stopped:
            break
    deltas.append(streaming.finish())
    return [d for d in deltas if d], "".join(deltas), streaming.stopped


def test_stop_strings_end_the_answer_before_them():
    deltas, text, stopped = _stream("The sky is blue.\nNext", ["\nNext", "zzz"])
    assert text == "The sky is blue." and stopped
    assert not any("\n" in d for d in deltas)  # the held-back prefix of the stop string was never shown


def test_a_multibyte_character_comes_whole_and_held_back_text_comes_at_the_end():
    deltas, text, stopped = _stream("café ab", ["abc"])
    assert text == "café ab" and not stopped
    assert "é" in "".join(deltas) and all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == "ab"  # a possible start of "abc", shown once the answer ended


def test_an_answer_ending_inside_a_character_shows_it_as_decoding_the_whole_answer_does():
    streaming = StreamingText(ByteTokenizer(), [])
    shown = [streaming.add(byte) for byte in b"ok " + "é".encode()[:1]]
    assert "".join(shown) + streaming.finish() == "ok \ufffd"
