"""The built-in evaluation metrics, each a score in [0, 1] of one answer against its reference.

exact_match and token_f1 compare SQuAD-normalised text (lower case, no punctuation, no articles, single spaces);
contains: the normalised reference appears in the normalised answer; regex: the reference is a regular expression
found in the answer; rouge_l: ROUGE-L F1 (Google's rouge-score); chrf: chrF (sacrebleu) / 100. Nothing is downloaded.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(answer: str, reference: str) -> float:
    return float(normalise(answer) == normalise(reference))


def contains(answer: str, reference: str) -> float:
    return float(normalise(reference) in normalise(answer))


def regex(answer: str, reference: str) -> float:
    return float(re.search(reference, answer) is not None)


def token_f1(answer: str, reference: str) -> float:
    got, want = normalise(answer).split(), normalise(reference).split()
    if not got or not want:
        return float(got == want)
    common = sum((collections.Counter(got) & collections.Counter(want)).values())
    if not common:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def rouge_l(answer: str, reference: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, answer)["rougeL"].fmeasure


def chrf(answer: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_chrf(answer, [reference]).score / 100


METRICS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match, "contains": contains, "regex": regex, "token_f1": token_f1, "rouge_l": rouge_l,
    "chrf": chrf}
