"""Supervised fine-tuning (OpenAI's `supervised` method): rows -> examples -> batches -> loss.

A `{"text": ...}` row trains on every token (plus eos); a `{"messages": [...]}` row is rendered with the tokenizer's
chat template and trains on the assistant turns only.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.chat_content import joined_text
from moetune.api.errors import ErrorCode
from moetune.workers.errors import JobError
from moetune.workers.families.segments import packs_sequences
from moetune.workers.methods.batch import IGNORE, PACKED_OFFSETS, Batch
from moetune.workers.methods.loss_head import install_loss_head

# Used only when the checkpoint's tokenizer has no chat template of its own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss is taken; the model shifts labels itself

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE for label in self.labels)

    def truncated(self, seq_len: int) -> Example:
        """This example within a shorter context (a staged context length's early stage)."""
        return self if len(self.input_ids) <= seq_len else Example(self.input_ids[:seq_len], self.labels[:seq_len])

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


def _assistant_spans(tokenizer, messages: list[dict], first: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant replies from messages[first] on.

    A reply's span starts after its generation prompt (the assistant header) and ends where the
    rendering of the conversation up to that reply ends; this holds for any template whose
    renderings of growing prefixes are prefixes of each other.
    """
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        end_text = _render(tokenizer, messages[: i + 1])
        if not full.startswith(end_text):
            raise JobError(
                ErrorCode.unsupported_chat_template,
                "the model's chat template renders a conversation differently from its prefixes; "
                "assistant turns cannot be located for loss masking",
                "model",
            )
        start_text = _render(tokenizer, messages[:i], generation_prompt=True)
        if not end_text.startswith(start_text):  # a template whose generation prompt differs from its header
            start_text = _render(tokenizer, messages[:i])
        spans.append((len(start_text), len(end_text)))
    return full, spans


def chat_example(tokenizer, messages: list[dict], trained_from: int = 0) -> Example:
    """The conversation rendered by the chat template and tokenized, loss on the assistant replies from
    messages[trained_from] on; untruncated."""
    text, spans = _assistant_spans(tokenizer, messages, trained_from)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if any(lo <= start < hi for lo, hi in spans) else IGNORE
        for token, (start, _) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    return Example(encoded["input_ids"], labels)


def tokenize_row(tokenizer, row: dict, seq_len: int) -> Example:
    if "text" in row:
        ids = tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:seq_len]
        return Example(ids, list(ids))
    # Text-only parts render as the equivalent string would, whether or not the template takes a list of parts.
    example = chat_example(tokenizer, [{**m, "content": joined_text(m["content"])} for m in row["messages"]])
    return Example(example.input_ids[:seq_len], example.labels[:seq_len])


def with_loss(examples: list[Example]) -> tuple[list[Example], int]:
    """The examples that carry loss, and how many were dropped for carrying none."""
    kept = [e for e in examples if e.trained_tokens]
    return kept, len(examples) - len(kept)


def tokenize_rows(tokenizer, rows: list[dict], seq_len: int) -> tuple[list[Example], int]:
    """Tokenized examples that carry loss, and how many rows were dropped for carrying none."""
    return with_loss([tokenize_row(tokenizer, row, seq_len) for row in rows])


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-padded input_ids and labels (IGNORE on padding), and no attention mask, so that
    transformers builds no [B, 1, T, T] one: with the padding after every real token, each real token sees under the
    plain causal mask exactly the tokens the padding mask would let it see, and no real token and no loss reads a
    padding position."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
    return Batch({"input_ids": input_ids}, labels, sum(len(e.input_ids) for e in examples))


def collate_packed(examples: list[Example]) -> Batch:
    """The examples end to end in one row, without padding: position ids restart and `cu_seq_lens_q` marks where
    each sequence starts (for a model whose layers keep packed sequences apart, workers.families.segments); the
    first token of each sequence is no one's target, so no sequence learns from another."""
    import torch

    input_ids = torch.tensor([[t for e in examples for t in e.input_ids]], dtype=torch.long)
    labels = torch.tensor([[label for e in examples for label in (IGNORE, *e.labels[1:])]], dtype=torch.long)
    lengths = torch.tensor([len(e.input_ids) for e in examples])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))  # int64, as fla's kernels take them
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
    return Batch({"input_ids": input_ids, "position_ids": positions, PACKED_OFFSETS: offsets}, labels,
                 int(lengths.sum()))


def token_loss_sum(logits, labels):
    """Cross-entropy summed over the positions that carry loss (labels shifted by one; a context-parallel slice's
    run one token past its logits)."""
    import torch.nn.functional as F

    targets = labels[:, 1:]
    return F.cross_entropy(logits[:, :targets.shape[1]].flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE, reduction="sum")


class SupervisedMethod:
    """The step's view of SFT: examples from rows, micro-batches from examples, the loss of a forward."""

    name = "supervised"
    sequences_per_example = 1  # sequences an example runs (the planner and the tuner count activations per sequence)

    def __init__(self, tokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.head, self.pack = None, False

    def examples(self, rows: list[dict]) -> tuple[list[Example], int]:
        """Examples that carry loss, and how many rows were dropped for carrying none within seq_len."""
        return tokenize_rows(self.tokenizer, rows, self.seq_len)

    def collate(self, examples: list[Example]) -> Batch:
        return collate_packed(examples) if self.pack else collate(examples, self.tokenizer.pad_token_id)

    def prepare(self, model) -> None:
        """Before the engine wraps the model: its output layer computes the loss itself (methods.loss_head), and
        micro-batches are packed where every layer keeps packed sequences apart (the family's kernel swaps)."""
        self.head = install_loss_head(model)
        self.pack = packs_sequences(model)

    def loss_sum(self, model, batch: Batch):
        """The micro-batch's loss summed over its loss tokens (the step divides by the global batch's count)."""
        if self.head is None:
            return token_loss_sum(model(**batch.inputs).logits, batch.labels)
        with self.head.armed(batch.labels):
            return model(**batch.inputs).logits

    def stage_loss(self, output, labels):
        """A pipeline's last stage's loss of a micro-batch, summed over its loss tokens: `output` is the final
        norm's output where the loss head takes it (a stage emits no logits then, workers.families.stage), else the
        logits."""
        if self.head is None:
            return token_loss_sum(output, labels)
        with self.head.armed(labels):
            return self.head(output)

    def figure_sums(self) -> list[float]:
        """Sums over the last forward's examples that the step adds up over a step's micro-batches and ranks into
        `figures`, a method's own metrics (workers.methods.dpo's rewards); SFT reports none."""
        return []

    def figures(self, sums: list[float]) -> dict[str, float]:
        return {}
