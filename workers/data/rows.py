"""Training data: JSONL rows validated up front, tokenized with the model's tokenizer, batched per rank.

A row is either `{"text": ...}` (every token trained, plus eos) or `{"messages": [...]}` (rendered with
the tokenizer's chat template; only assistant turns are trained).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from moetune.api import storage
from moetune.workers.errors import DatasetError, JobError

IGNORE = -100  # label of tokens that carry no loss (prompt turns, padding)
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Used only when the checkpoint's tokenizer has no chat template of its own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# ------------------------------------------------------------------ validation


def _row_problem(row) -> str | None:
    """What is wrong with one parsed row, or None."""
    if not isinstance(row, dict):
        return "must be a JSON object"
    has_text, has_messages = "text" in row, "messages" in row
    if has_text == has_messages:
        return "must have exactly one of 'text' or 'messages'"
    if has_text:
        if not isinstance(row["text"], str) or not row["text"]:
            return "'text' must be a non-empty string"
        return None
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, message in enumerate(messages):
        where = f"'messages[{i}]"
        if not isinstance(message, dict):
            return f"{where}' must be an object with 'role' and 'content'"
        if message.get("role") not in CHAT_ROLES:
            return f"{where}.role' must be one of {', '.join(CHAT_ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"{where}.content' must be a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "'messages' must contain an assistant turn (nothing to train on otherwise)"
    return None


def load_rows(uri: str, param: str) -> list[dict]:
    """Reads and validates every row of a JSONL file; raises DatasetError naming file and row."""
    try:
        text = storage.read_text(uri)
    except FileNotFoundError:
        raise DatasetError(param, f"{param} {uri} does not exist") from None
    except UnicodeDecodeError:
        raise DatasetError(param, f"{param} {uri} is not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(param, f"{param} {uri} cannot be read: {e}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(param, f"{param} {uri} row {number}: not valid JSON ({e.msg})") from None
        problem = _row_problem(row)
        if problem:
            raise DatasetError(param, f"{param} {uri} row {number}: {problem}")
        rows.append(row)
    if not rows:
        raise DatasetError(param, f"{param} {uri} holds no rows")
    return rows


# ------------------------------------------------------------------ tokenization


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss is taken; the model shifts labels itself

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE for label in self.labels)

    @property
    def loss_tokens(self) -> int:
        """Positions that carry loss once labels are shifted by one, as a causal LM scores them."""
        return sum(label != IGNORE for label in self.labels[1:])


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        chat_template=None if tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE,
    )


def _assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of assistant replies.

    A reply's span starts after its generation prompt (the assistant header) and ends where the
    rendering of the conversation up to that reply ends; this holds for any template whose
    renderings of growing prefixes are prefixes of each other.
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        end_text = _render(tokenizer, messages[: i + 1])
        if not full.startswith(end_text):
            raise JobError(
                "unsupported_chat_template",
                "the model's chat template renders a conversation differently from its prefixes; "
                "assistant turns cannot be located for loss masking",
                "model",
            )
        start_text = _render(tokenizer, messages[:i], generation_prompt=True)
        if not end_text.startswith(start_text):  # a template whose generation prompt differs from its header
            start_text = _render(tokenizer, messages[:i])
        spans.append((len(start_text), len(end_text)))
    return full, spans


def tokenize_row(tokenizer, row: dict, seq_len: int) -> Example:
    if "text" in row:
        ids = tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:seq_len]
        return Example(ids, list(ids))
    text, spans = _assistant_spans(tokenizer, row["messages"])
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:seq_len]
    labels = [
        token if any(lo <= start < hi for lo, hi in spans) else IGNORE
        for token, (start, _) in zip(ids, encoded["offset_mapping"])
    ]
    return Example(ids, labels)


def tokenize_rows(tokenizer, rows: list[dict], seq_len: int) -> tuple[list[Example], int]:
    """Tokenized examples that carry loss, and how many rows were dropped for carrying none."""
    examples = [tokenize_row(tokenizer, row, seq_len) for row in rows]
    kept = [e for e in examples if e.trained_tokens]
    return kept, len(examples) - len(kept)


# ------------------------------------------------------------------ batching


def steps_per_epoch(n_examples: int, global_batch_size: int) -> int:
    return math.ceil(n_examples / global_batch_size)


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def step_examples(n_examples: int, step: int, global_batch_size: int, rank: int, world: int, seed: int) -> list[int]:
    """Example indices this rank trains on in optimizer step `step` (0-based).

    The data is one endless stream of per-epoch shuffles; step s takes the next global batch
    from it and rank r takes the r-th equal slice, so ranks never share an example in a step.
    """
    per_rank = global_batch_size // world
    first = step * global_batch_size + rank * per_rank
    orders: dict[int, list[int]] = {}
    picked = []
    for pos in range(first, first + per_rank):
        epoch = pos // n_examples
        if epoch not in orders:
            orders[epoch] = _epoch_order(n_examples, seed, epoch)
        picked.append(orders[epoch][pos % n_examples])
    return picked


def step_rng_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of one rank's optimizer step: dropout masks then depend on (seed, step, rank) only,
    so a step repeated after a resume draws the same masks."""
    return random.Random(f"{seed}/{step}/{rank}").getrandbits(63)


def step_micro_batches(
    n_examples: int, step: int, global_batch_size: int, micro_batch_size: int, rank: int, world: int, seed: int
) -> list[list[int]]:
    """This rank's examples of step `step` cut into micro-batches of `micro_batch_size`."""
    picked = step_examples(n_examples, step, global_batch_size, rank, world, seed)
    return [picked[i : i + micro_batch_size] for i in range(0, len(picked), micro_batch_size)]


def eval_micro_batches(n_examples: int, micro_batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's share of the validation set, in the same number of batches on every rank.

    Equal counts matter: under ZeRO-3 every forward is a collective. Missing slots are None.
    """
    shard = list(range(rank, n_examples, world))
    n_batches = math.ceil(math.ceil(n_examples / world) / micro_batch_size)
    shard += [None] * (n_batches * micro_batch_size - len(shard))
    return [shard[i : i + micro_batch_size] for i in range(0, len(shard), micro_batch_size)]


def collate(examples: list[Example], pad_id: int):
    """Right-padded tensors: input_ids, attention_mask, labels (IGNORE on padding)."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
