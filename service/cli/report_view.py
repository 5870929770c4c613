"""Two adaptation reports side by side (`moetune jobs compare A B`): the loss at the steps both ran, the last
validation loss and evaluation figures, throughput and memory."""

from __future__ import annotations

from rich.table import Column, Table

from moetune.api.report import AdaptationReport

COMPARED_STEPS = 5  # loss rows: this many steps both reports have, spread from the first to the last


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _loss_rows(a: AdaptationReport, b: AdaptationReport) -> list[tuple[str, object, object]]:
    losses_a, losses_b = ({s.step: s.train_loss for s in r.steps} for r in (a, b))
    common = sorted(losses_a.keys() & losses_b.keys())
    if len(common) > COMPARED_STEPS:
        common = [common[round(i * (len(common) - 1) / (COMPARED_STEPS - 1))] for i in range(COMPARED_STEPS)]
    return [(f"train loss @ step {step}", losses_a[step], losses_b[step]) for step in common]


def _eval_figures(report: AdaptationReport) -> dict[str, float]:
    """The last score of each evaluation metric, and the base model's (step 0)."""
    if report.evaluation is None:
        return {}
    found = {f"{m} @ step 0": v for m, v in (report.evaluation.base or {}).items()}
    found |= {f"{m} (last)": scores[-1] for m, scores in report.evaluation.scores.items() if scores}
    return found


def compare_rows(a: AdaptationReport, b: AdaptationReport) -> list[tuple[str, object, object]]:
    evals_a, evals_b = _eval_figures(a), _eval_figures(b)
    return [
        ("model", a.model, b.model),
        ("steps", len(a.steps), len(b.steps)),
        *_loss_rows(a, b),
        ("last valid loss", a.last_valid_loss, b.last_valid_loss),
        *[(name, evals_a.get(name), evals_b.get(name)) for name in sorted(evals_a.keys() | evals_b.keys())],
        ("tokens/s", a.throughput.tokens_per_second, b.throughput.tokens_per_second),
        ("seconds per step", a.throughput.step_seconds, b.throughput.step_seconds),
        ("all-to-all share", a.throughput.alltoall_share, b.throughput.alltoall_share),
        ("context-parallel share", a.throughput.context_share, b.throughput.context_share),
        ("pipeline idle share (most idle stage)", max(a.throughput.pipeline_idle_share or [], default=None),
         max(b.throughput.pipeline_idle_share or [], default=None)),
        ("peak memory MB (max rank)", max(a.memory.peak_mb_per_rank, default=None),
         max(b.memory.peak_mb_per_rank, default=None)),
        ("alignment", _alignment(a), _alignment(b)),
    ]


def _alignment(report: AdaptationReport) -> str:
    if report.alignment is None:
        return "not checked"
    failed = [r.op for r in report.alignment if not r.ok]
    return f"failed: {', '.join(failed)}" if failed else "passed"


def compare_table(a: AdaptationReport, b: AdaptationReport) -> Table:
    # ids stay whole and copy-pasteable, whatever the console width
    table = Table(Column("", no_wrap=True),
                  *(Column(job_id, no_wrap=True, min_width=len(job_id)) for job_id in (a.job_id, b.job_id)))
    for name, left, right in compare_rows(a, b):
        table.add_row(name, _fmt(left), _fmt(right))
    return table
