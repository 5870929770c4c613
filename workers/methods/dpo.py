"""Direct Preference Optimization (OpenAI's `dpo` method; Rafailov et al., 2023): each row is a prompt with a
preferred and a non-preferred answer (api/data_rows.py `preference_row_problem`), and the loss of a pair is TRL's
"sigmoid" DPO loss

    -logsigmoid(beta * ((log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected))))

where log π(answer) sums the answer's token log-probabilities under the prompt (rendered by the chat template, no
loss on it), π is the model with its LoRA and π_ref the same model with every LoRA off (no second copy), computed
under no_grad. A micro-batch runs its pairs' chosen and rejected sequences together, once with LoRA off and once
with it, on every rank in the same order (an expert-parallel or ZeRO-3 forward is a collective).

Each pair counts as one loss token: the step divides the summed loss by the global batch's count, so the loss and
its gradient are the mean over the global batch's pairs whatever the micro-batching and the ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetune.api.chat_content import joined_text
from moetune.kernels.loss import linear_cross_entropy_sum
from moetune.workers.experts.module import expert_lora_off
from moetune.workers.families.segments import packs_sequences
from moetune.workers.methods.batch import IGNORE, Batch
from moetune.workers.methods.loss_head import LossHead, install_loss_head, logits_token_logprobs
from moetune.workers.methods.sft import Example, chat_example, collate, collate_packed, with_loss

# metric names as TRL logs them; each is the mean over the step's pairs
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@dataclass
class PreferencePair:
    chosen: Example
    rejected: Example

    @property
    def trained_tokens(self) -> int:
        """Zero when either answer has no token within seq_len: the pair then says nothing."""
        return min(self.chosen.loss_tokens, self.rejected.loss_tokens)

    @property
    def loss_tokens(self) -> int:
        return 1  # DPO's loss is a mean over pairs (see the module docstring)

    def truncated(self, seq_len: int) -> PreferencePair:
        return PreferencePair(self.chosen.truncated(seq_len), self.rejected.truncated(seq_len))


def _text(turn: dict) -> dict:
    return {**turn, "content": joined_text(turn["content"])}


def preference_pair(tokenizer, row: dict, seq_len: int) -> PreferencePair:
    """The prompt followed by each answer, rendered by the chat template; loss on the answer's turns only (not on
    assistant turns inside the prompt); cut to seq_len from the end, as TRL's keep_start truncation."""
    prompt = [_text(m) for m in row["input"]["messages"]]

    def sequence(answer: list[dict]) -> Example:
        example = chat_example(tokenizer, prompt + [_text(m) for m in answer], trained_from=len(prompt))
        return example.truncated(seq_len)

    return PreferencePair(sequence(row["preferred_output"]), sequence(row["non_preferred_output"]))


class SequenceLossHead(LossHead):
    """The output layer that, while armed, returns each sequence's summed cross-entropy over its loss tokens, [S]:
    minus the sequence's log-probability (kernels.loss, no [tokens, vocab] tensor)."""

    sequence_of = None  # per target position (labels shifted by one, flattened): its sequence
    per_sequence = True

    def forward(self, hidden):
        if self.labels is None:
            return super().forward(hidden)
        targets = self.labels[:, 1:].flatten()
        rows = hidden[:, :-1].flatten(0, 1)
        kept = targets != IGNORE
        return torch.stack([linear_cross_entropy_sum(rows[mask], self.weight, targets[mask])
                            for mask in (kept & (self.sequence_of == s) for s in range(self.sequences))])

    @contextlib.contextmanager
    def armed_per_sequence(self, labels, sequence_of, sequences: int):
        self.sequence_of, self.sequences = sequence_of, sequences
        with self.armed(labels):
            yield


def _sequence_of(batch: Batch) -> tuple[torch.Tensor, int]:
    """Each target position's sequence: a padded micro-batch's row, a packed one's segment (cu_seq_lens_q)."""
    labels = batch.labels
    offsets = batch.inputs.get("cu_seq_lens_q")
    if offsets is None:
        rows, width = labels.shape
        return torch.arange(rows, device=labels.device).repeat_interleave(width - 1), rows
    lengths = offsets.diff().to(labels.device)
    # output_size: the packed row's width, known on the host (without it CUDA reads the lengths' sum back)
    segment = torch.arange(len(lengths), device=labels.device).repeat_interleave(lengths, output_size=labels.shape[1])
    return segment[1:], len(lengths)  # position t predicts token t + 1: the sequence of t + 1


def _logits_nll(logits, labels, sequence_of, sequences: int):
    """Each sequence's summed cross-entropy from the logits (a model whose output layer is no plain linear), a
    chunk of tokens in fp32 at a time (methods.loss_head)."""
    targets = labels.roll(-1, dims=1)  # position t predicts label t + 1; the last position's target is cut below
    kept = targets != IGNORE
    nll = -logits_token_logprobs(logits, targets.where(kept, 0)) * kept
    return nll.new_zeros(sequences).index_add(0, sequence_of, nll[:, :-1].flatten())


@contextlib.contextmanager
def lora_off(model):
    """The reference policy: the model with PEFT's adapters disabled and the routed experts' own LoRA (the
    expert-parallel module, outside PEFT) off."""
    peft_model = getattr(model, "module", model)  # under DeepSpeed, the engine's module
    with peft_model.disable_adapter(), expert_lora_off(peft_model):
        yield


class DpoMethod:
    """The step's view of DPO: pairs from rows, a micro-batch of both answers from pairs, the summed pair loss."""

    name = "dpo"
    sequences_per_example = 2  # a pair runs its chosen and rejected answers in the same micro-batch (collate)

    def __init__(self, tokenizer, seq_len: int, beta: float):
        self.tokenizer, self.seq_len, self.beta = tokenizer, seq_len, beta
        self.head, self.pack = None, False
        self.last = torch.zeros(len(FIGURES) + 1)

    def examples(self, rows: list[dict]) -> tuple[list[PreferencePair], int]:
        """Pairs whose two answers both have a token within seq_len, and how many rows were dropped."""
        return with_loss([preference_pair(self.tokenizer, row, self.seq_len) for row in rows])

    def collate(self, pairs: list[PreferencePair]) -> Batch:
        """The chosen sequences, then the rejected ones, in one micro-batch (padded, or packed where the family
        packs)."""
        sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        return collate_packed(sequences) if self.pack else collate(sequences, self.tokenizer.pad_token_id)

    def prepare(self, model) -> None:
        """As SFT's: the output layer sums the loss itself, per sequence here; packing where the family packs."""
        self.head = install_loss_head(model, SequenceLossHead)
        self.pack = packs_sequences(model)

    def log_probs(self, model, batch: Batch):
        """Each sequence's summed log-probability of its loss tokens, [S] (the chosen sequences, then the rejected)."""
        sequence_of, sequences = _sequence_of(batch)
        if self.head is None:
            return -_logits_nll(model(**batch.inputs).logits, batch.labels, sequence_of, sequences)
        with self.head.armed_per_sequence(batch.labels, sequence_of, sequences):
            return -model(**batch.inputs).logits

    def loss_sum(self, model, batch: Batch):
        """The micro-batch's pair losses summed (the step divides by the global batch's pair count)."""
        with torch.no_grad(), lora_off(model):
            reference = self.log_probs(model, batch)
        chosen, rejected = (self.log_probs(model, batch) - reference).chunk(2)
        logits = self.beta * (chosen - rejected)
        with torch.no_grad():
            rewards = self.beta * torch.stack((chosen, rejected))
            self.last = torch.stack((rewards[0].sum(), rewards[1].sum(), logits.sum(),
                                     (logits > 0).sum().to(logits.dtype), logits.new_tensor(len(logits))))
        return -F.logsigmoid(logits).sum()

    def figure_sums(self) -> list[float]:
        """The last forward's sums of FIGURES and its pair count (the step adds them up over micro-batches and
        ranks)."""
        return self.last.tolist()

    def figures(self, sums: list[float]) -> dict[str, float]:
        *totals, pairs = sums
        return {name: total / max(pairs, 1) for name, total in zip(FIGURES, totals)}
