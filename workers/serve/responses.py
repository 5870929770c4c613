"""Engine events (workers/serve/completions.py) -> OpenAI's response objects and SSE chunks, for chat and
text completions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from moetune.workers.serve.schema import new_id, now, usage


@dataclass
class Shape:
    """What differs between chat and text completions."""

    object: str  # the non-streamed answer's
    chunk_object: str
    id_prefix: str
    chat: bool


CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)
TEXT = Shape("text_completion", "text_completion", "cmpl", chat=False)


@dataclass
class Answer:
    shape: Shape
    model: str
    n: int
    prompt_tokens: int
    id: str = field(default_factory=str)
    created: int = field(default_factory=now)
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int = 0

    def __post_init__(self):
        self.id = new_id(self.shape.id_prefix)
        self.texts, self.reasons = [""] * self.n, [None] * self.n

    def add(self, event: dict) -> None:
        i = event["index"]
        if "text" in event:
            self.texts[i] += event["text"]
        if "finish_reason" in event:
            self.reasons[i] = event["finish_reason"]
            self.completion_tokens += event["completion_tokens"]

    def body(self) -> dict:
        if self.shape.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r,
                        "logprobs": None} for i, (t, r) in enumerate(zip(self.texts, self.reasons, strict=True))]
        else:
            choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": None}
                       for i, (t, r) in enumerate(zip(self.texts, self.reasons, strict=True))]
        return {"id": self.id, "object": self.shape.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.prompt_tokens, self.completion_tokens)}

    # ---------------------------------------------------------------- streaming

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": self.shape.chunk_object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _choice(self, index: int, text: str | None, reason: str | None) -> dict:
        if self.shape.chat:
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}

    def opening_chunks(self) -> list[str]:
        """Chat streams start each choice with the assistant role."""
        if not self.shape.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}]) for i in range(self.n)]

    def chunk(self, event: dict) -> str:
        self.add(event)
        if "text" in event:
            return self._chunk([self._choice(event["index"], event["text"], None)])
        return self._chunk([self._choice(event["index"], None, event["finish_reason"])])

    def closing_chunks(self, include_usage: bool) -> list[str]:
        tail = [self._chunk([], usage=usage(self.prompt_tokens, self.completion_tokens))] if include_usage else []
        return [*tail, "data: [DONE]\n\n"]

    def error_chunk(self, error: dict) -> str:
        """An error after the stream began (the status line is already sent)."""
        fields = {k: v for k, v in error.items() if k != "status"}
        return f"data: {json.dumps({'error': fields})}\n\n"
