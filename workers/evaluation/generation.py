"""Generation-based evaluation on the training workers (`evaluation`): the model answers each row's prompt with the
serving engine's batched generation (workers.generate.generate_batch), each answer is scored against the row's
reference by the metrics asked for (workers.evaluation.metrics), and the scores are averaged over all rows.

Each rank answers its share of the rows, all of its prompts prefilled in one forward and every decode step one
forward for all of them: under ZeRO-3 each forward gathers every layer's weights, once per batch rather than once
per prompt. Where every forward runs collectives (expert parallelism, ZeRO-3) ranks generate in lockstep (one
prefill, then a fixed number of steps) over equally many prompts: a short share is padded with copies of its first
row, whose scores are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from moetune.api.data_rows import evaluation_row_problem, evaluation_turns
from moetune.api.models.evaluation import EvaluationSpec
from moetune.workers.data.rows import load_rows
from moetune.workers.evaluation.metrics import METRICS
from moetune.workers.generate import SamplingParams, generate_batch
from moetune.workers.methods.sft import FALLBACK_CHAT_TEMPLATE

PARAM = "evaluation.file"


@dataclass(frozen=True)
class EvalRow:
    prompt_ids: list[int]
    reference: str


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered up to the assistant's turn, as the training rows are rendered."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=None if tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_eval_rows(uri: str, tokenizer, metrics: list[str]) -> list[EvalRow]:
    """Every row of the evaluation file as (prompt tokens, reference); a DatasetError naming the file and row (the
    driver ran the same check, api/data_rows.evaluation_row_problem, before any worker started)."""
    rows = load_rows(uri, PARAM, problem=partial(evaluation_row_problem, metrics=metrics))
    return [EvalRow(prompt_ids(tokenizer, messages), reference)
            for messages, reference in map(evaluation_turns, rows)]


def answers(model, tokenizer, rows: list[EvalRow], spec: EvaluationSpec, seed: int, lockstep: bool) -> list[str]:
    outputs = generate_batch(model, [r.prompt_ids for r in rows],
                             SamplingParams(spec.max_new_tokens, temperature=spec.temperature, seed=seed),
                             eos_token_id=tokenizer.eos_token_id, lockstep=lockstep)
    return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs]


def evaluate_generation(model, tokenizer, rows: list[EvalRow], spec: EvaluationSpec, rank: int, world: int,
                        all_sum: Callable[..., list[float]], seed: int, lockstep: bool) -> dict[str, float]:
    """{metric: mean score over every row} (a collective: every rank calls it with the same rows)."""
    share = rows[rank::world]
    padded = share + [rows[0]] * (math.ceil(len(rows) / world) - len(share)) if lockstep else share
    # generate_batch seeds row i with seed + i: every row of the job its own seed
    texts = answers(model, tokenizer, padded, spec, seed + rank * len(padded), lockstep)[:len(share)] if padded else []
    sums = [sum(METRICS[m](text, row.reference) for text, row in zip(texts, share)) for m in spec.metrics]
    *sums, count = all_sum(*sums, len(share))
    return {metric: total / count for metric, total in zip(spec.metrics, sums)}
