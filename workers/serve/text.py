"""Tokens to text as they come: incremental decoding that never emits half a character, and `stop` strings
checked on the decoded text (OpenAI's rule: the answer ends before the first stop string, which is not part of
it)."""

from __future__ import annotations


class StreamingText:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # decoded so far (stop strings cut off)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> str:
        """The text this token makes safe to show (may be ""); sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character still incomplete
            return ""
        return self._advance(text, final=False)

    def finish(self) -> str:
        """Whatever was held back (and a last incomplete character, as decoding the whole answer shows it)."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=True)

    def _advance(self, text: str, final: bool) -> str:
        self.text = text
        cut = min((i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        # hold back a tail that could still become a stop string
        held = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                                   default=0)
        return self._take(len(text) - held)

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta, self.emitted = self.text[self.emitted:upto], upto
        return delta
