"""One OpenAI request on one base's Engine: the prompt (the tokenizer's chat template for chat), `n` choices as
concurrent engine rows, `stop` strings on the decoded text; events for the ingress to turn into JSON or SSE.

Events, in order: {"prompt_tokens"} once the request is accepted, then {"index", "text"} deltas and one
{"index", "finish_reason", "completion_tokens"} per choice; or a single {"error"} (OpenAI's error fields plus the
HTTP status) in place of any of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from moetune.api.errors import ErrorCode
from moetune.workers.generate import (
    AdapterLoadError,
    ContextLengthError,
    Engine,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from moetune.workers.serve.text import StreamingText

_PARAM_NAMES = {"max_new_tokens": "max_tokens"}  # engine names -> OpenAI's


def error_event(status: int, code: str, message: str, param: str | None = None) -> dict:
    return {"error": {"status": status, "code": str(code), "message": message, "param": param}}


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The special token the chat template writes right after an assistant turn (e.g. `<|im_end|>`): a chat
    answer ends there, besides the tokenizer's eos."""
    marker = "\x00moetune\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # a template that refuses a lone assistant turn: eos alone ends answers
        return ()
    after = tokenizer(text.split(marker, 1)[-1], add_special_tokens=False)["input_ids"][:1]
    return tuple(t for t in after if t in tokenizer.all_special_ids)


class Completions:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.end_of_turn = end_of_turn_ids(engine.tokenizer)

    def prompt_ids(self, body: dict) -> list[int]:
        tokenizer = self.engine.tokenizer
        if body.get("messages") is not None:
            text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]

    def requests(self, body: dict, prompt: list[int]) -> list[GenerationRequest]:
        budget = body.get("max_tokens") or max(1, self.engine.context_length - len(prompt))
        stop_ids = self.end_of_turn if body.get("messages") is not None else ()
        seed = body.get("seed")
        return [GenerationRequest(prompt, body.get("adapter_uri"), SamplingParams(
            max_new_tokens=budget, temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
            seed=None if seed is None else seed + i, stop_token_ids=stop_ids)) for i in range(body.get("n", 1))]

    async def run(self, body: dict) -> AsyncIterator[dict]:
        param = "messages" if body.get("messages") is not None else "prompt"
        try:
            prompt = self.prompt_ids(body)
            requests = self.requests(body, prompt)
            for request in requests:
                self.engine.check(request)
        except ContextLengthError as e:
            yield error_event(400, ErrorCode.context_length_exceeded, str(e), _PARAM_NAMES.get(e.param, e.param))
            return
        except InvalidRequestError as e:
            yield error_event(400, ErrorCode.invalid_request, str(e), _PARAM_NAMES.get(e.param, e.param) or param)
            return
        except Exception as e:  # the chat template refused the messages (jinja's raise_exception, a bad role)
            yield error_event(400, ErrorCode.invalid_request, f"{param}: {e}", param)
            return
        yield {"prompt_tokens": len(prompt)}
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._choice(i, r, body.get("stop") or [], queue))
                 for i, r in enumerate(requests)]
        try:
            for _ in range(len(tasks)):
                while True:
                    event = await queue.get()
                    yield event
                    if "error" in event:
                        return
                    if "finish_reason" in event:
                        break
        finally:
            for task in tasks:
                task.cancel()

    async def _choice(self, index: int, request: GenerationRequest, stop: list[str], queue: asyncio.Queue) -> None:
        text = StreamingText(self.engine.tokenizer, stop)
        tokens, reason = 0, "length"
        try:
            async for event in self.engine.stream(request):
                if event.finish_reason is not None:
                    reason = event.finish_reason
                    break
                tokens += 1
                delta = text.add(event.token_id)
                if delta:
                    queue.put_nowait({"index": index, "text": delta})
                if text.stopped:
                    reason = "stop"
                    break
        except AdapterLoadError as e:
            queue.put_nowait(error_event(503, ErrorCode.adapter_unavailable,
                                         f"The adapter {request.adapter} cannot be loaded: {e}", "model"))
            return
        except Exception as e:  # a failed forward: this request fails, the replica keeps serving
            queue.put_nowait(error_event(500, ErrorCode.internal_error, f"generation failed: {e}"))
            return
        rest = text.finish()
        if rest:
            queue.put_nowait({"index": index, "text": rest})
        queue.put_nowait({"index": index, "finish_reason": reason, "completion_tokens": tokens})
