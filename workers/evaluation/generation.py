"""Generation-based evaluation on the training workers (`evaluation`): the model answers each row's prompt with the
serving engine's batched generation (workers.generate.generate_batch), each answer is scored against the row's
reference by the metrics asked for (workers.evaluation.metrics), and the scores are averaged over all rows.

Each rank answers its share of the rows. Under expert parallelism every forward exchanges tokens between ranks, so
ranks generate in lockstep (a fixed number of forwards) over equally many prompts: a short share is padded with
copies of its first row, whose scores are not counted.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.models import EvaluationSpec
from moetune.workers.errors import JobError
from moetune.workers.evaluation.metrics import METRICS
from moetune.workers.generate import SamplingParams, generate_batch
from moetune.workers.methods.sft import FALLBACK_CHAT_TEMPLATE

PARAM = "evaluation.file"


@dataclass(frozen=True)
class EvalRow:
    prompt_ids: list[int]
    reference: str


def _row_problem(row) -> str | None:
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        return "expected {\"messages\": [...], \"reference\": \"...\"}"
    if any(not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in
           ("system", "user", "assistant") for m in messages):
        return "every message needs a role (system, user or assistant) and a text content"
    if "reference" in row and not isinstance(row["reference"], str):
        return "reference must be a string"
    if "reference" not in row and (messages[-1]["role"] != "assistant" or len(messages) < 2):
        return "no reference: give \"reference\" or end the messages with the assistant's answer"
    return None


def _pattern_problem(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        return f"not a regular expression ({e})"
    return None


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered up to the assistant's turn, as the training rows are rendered."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=None if tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_eval_rows(uri: str, tokenizer, metrics: list[str]) -> list[EvalRow]:
    """Every row of the evaluation file as (prompt tokens, reference); a JobError naming the file and row (also
    for a reference that is no regular expression, when `metrics` has "regex")."""
    try:
        lines = storage.read_text(uri).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(ErrorCode.invalid_request, f"{PARAM} {uri} cannot be read ({e})", PARAM) from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise JobError(ErrorCode.invalid_request, f"{PARAM} {uri} row {number}: not valid JSON ({e.msg})",
                           PARAM) from None
        if problem := _row_problem(row):
            raise JobError(ErrorCode.invalid_request, f"{PARAM} {uri} row {number}: {problem}", PARAM)
        messages = row["messages"] if "reference" in row else row["messages"][:-1]
        reference = row["reference"] if "reference" in row else row["messages"][-1]["content"]
        if "regex" in metrics and (problem := _pattern_problem(reference)):
            raise JobError(ErrorCode.invalid_request, f"{PARAM} {uri} row {number}: the reference is the regex "
                                                      f"metric's pattern: {problem}", PARAM)
        rows.append(EvalRow(prompt_ids(tokenizer, messages), reference))
    if not rows:
        raise JobError(ErrorCode.invalid_request, f"{PARAM} {uri} holds no rows", PARAM)
    return rows


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
