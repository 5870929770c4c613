"""The adaptation report as the control plane serves it and the CLI downloads and compares it: reports written by
the driver's own writer (workers.reporting.adaptation_report) into two jobs' outputs, from step records shaped as
the workers log them."""

from __future__ import annotations

import html
import json
import math
import re

import pytest
from click.testing import CliRunner
from moetune.api import storage
from moetune.api.layout import metrics_uri, report_html_uri
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.api.models.run_config import RunConfig, resolve_run_config
from moetune.service.cli.main import main
from moetune.workers.reporting.adaptation_report import write_report
from PIL import Image

from tests.support.browser import PAGE_URL, open_page
from tests.support.control_plane import TOKENS

ALIGNMENT = [{"op": "kda", "rmse_ratio": 2e-7, "tolerance": 1e-3, "ok": True},
             {"op": "first loss", "loss": 5.5, "reference_loss": 5.5, "relative_diff": 0.0, "tolerance": 1e-4,
              "ok": True}]


def _history(steps: int, start_loss: float, context: bool, staged: bool) -> list[dict]:
    """Step records with every figure the workers log (two ranks, two MoE layers, checkpoints every 4; `context`:
    the context-parallel share of a CP job; `staged`: the two stages' figures of a pipelined job)."""
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "total_steps": steps, "train_loss": start_loss * math.exp(-step / 5),
                  "learning_rate": 1e-3, "tokens_per_second": 900.0 + step, "trained_tokens": 256 * step,
                  "train_seconds": 0.5, "eval_seconds": 0.1 if step % 4 == 0 else 0.0, "alltoall_share": 0.2,
                  "memory_peak_mb": [1000.0 + step, 1100.0], "memory_budget_mb": 4000.0,
                  "expert_imbalance": {"1": 1.0 + step / 10, "2": 2.0 - step / 20},
                  **({"context_share": 0.1} if context else {}),
                  **({"pipeline_idle_share": [0.3, 0.15], "pipeline_idle_seconds": [0.1, 0.05],
                      "pipeline_sent_mb": [2.0, 1.0], "pipeline_received_mb": [1.0, 2.0]} if staged else {})}
        if step % 4 == 0:
            record |= {"valid_loss": record["train_loss"] + 0.1, "checkpoint": f"step-{step}",
                       "eval_exact_match": step / steps, "eval_chrf": 0.5}
        records.append(record)
    return records


def _write(service, steps: int, start_loss: float, context: bool = False,
           staged: bool = False) -> tuple[str, JobRunSpec]:
    evaluation = {"file": "s3://outputs/eval.jsonl", "metrics": ["exact_match", "chrf"]}
    row = service.store.get_job(service.create_job(evaluation=evaluation)["id"])
    run = JobRunSpec(job_id=row.id, config=RunConfig.model_validate(row.run_config), output_uri=row.output_uri)
    storage.write_bytes(metrics_uri(run.output_uri),
                        "".join(json.dumps(r) + "\n" for r in _history(steps, start_loss, context, staged)).encode())
    summary = {"alignment": ALIGNMENT, "base_evaluation": {"eval_exact_match": 0.0, "eval_chrf": 0.25},
               "selected_step": steps}
    write_report(run, [{"layer_type": "linear attention", "layers": 2}], summary, kept_steps={steps - steps % 4})
    return row.id, run


@pytest.fixture(scope="module")
def two_reports(service):
    return _write(service, 12, 3.0, context=True), _write(service, 8, 4.0, staged=True)


def test_a_job_without_report_is_a_404_naming_it(service):
    job_id = service.create_job()["id"]
    for path in ("report", "report.html"):
        reply = service.http().get(f"/v1/fine_tuning/jobs/{job_id}/{path}")
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "report_not_found"
        assert job_id in reply.json()["error"]["message"]
    assert service.http("tenant-b").get(f"/v1/fine_tuning/jobs/{job_id}/report").status_code == 404  # not theirs


def test_report_is_served_and_downloaded_by_the_cli(service, two_reports, tmp_path):
    (job_id, run), _ = two_reports
    report = service.sdk().jobs.report(job_id)
    assert [c.name for c in report.checkpoints] == ["step-4", "step-8", "step-12"]
    assert [c.kept for c in report.checkpoints] == [False, False, True]
    assert report.expert_imbalance.layers == ["1", "2"] and len(report.expert_imbalance.ratio[0]) == 12
    assert report.memory.peak_mb_per_rank == [1012.0, 1100.0]
    assert report.throughput.alltoall_share == pytest.approx(0.2)
    assert report.throughput.context_share == pytest.approx(0.1) and report.steps[0].context_share == 0.1
    assert report.evaluation.steps == [4, 8, 12] and report.evaluation.base == {"exact_match": 0.0, "chrf": 0.25}
    assert report.evaluation.scores["exact_match"] == [4 / 12, 8 / 12, 1.0] and report.selected_step == 12

    cli = CliRunner().invoke(main, ["--url", service.url, "--token", TOKENS["tenant-a"], "jobs", "report", job_id,
                                    "--output", str(tmp_path / "out")])
    assert cli.exit_code == 0, cli.output
    assert (tmp_path / "out" / "report.html").read_bytes() == storage.read_bytes(report_html_uri(run.output_uri))
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report.model_dump(mode="json")


def test_compare_prints_both_reports_figures_side_by_side(service, two_reports):
    (a, _), (b, _) = two_reports
    sdk = service.sdk()
    left, right = sdk.jobs.report(a), sdk.jobs.report(b)
    cli = CliRunner().invoke(main, ["--url", service.url, "--token", TOKENS["tenant-a"], "jobs", "compare", a, b],
                             terminal_width=200)
    assert cli.exit_code == 0, cli.output
    lines = cli.output.splitlines()
    assert [c.strip() for c in lines[1].split("┃")][2:4] == [a, b]  # the header: A left, B right
    rows = {cells[1]: cells[2:4] for cells in ([c.strip() for c in line.split("│")] for line in lines)
            if len(cells) == 5}
    for step in (1, 8):  # the first and last step both ran
        assert rows[f"train loss @ step {step}"] == [f"{r.steps[step - 1].train_loss:.4g}" for r in (left, right)]
    assert "train loss @ step 12" not in rows
    assert rows["last valid loss"] == [f"{r.last_valid_loss:.4g}" for r in (left, right)]
    assert rows["exact_match @ step 0"] == ["0", "0"] and rows["exact_match (last)"] == ["1", "1"]
    assert rows["tokens/s"] == [f"{r.throughput.tokens_per_second:.4g}" for r in (left, right)]
    assert rows["context-parallel share"] == ["0.1", "-"] and right.throughput.context_share is None
    # the pipelined job's stages: idle seconds over training time, per stage
    assert right.throughput.pipeline_idle_share == pytest.approx([0.2, 0.1])
    assert right.throughput.pipeline_sent_mb == [2.0, 1.0] and left.throughput.pipeline_idle_share is None
    assert rows["pipeline idle share (most idle stage)"] == ["-", "0.2"]


def test_the_report_page_draws_every_plot_in_chromium_without_any_request(service, two_reports, tmp_path):
    (job_id, run), _ = two_reports
    page = service.sdk().jobs.report_html(job_id)
    opened = open_page(page.encode(), tmp_path)

    assert opened.of_page() == [PAGE_URL, PAGE_URL]  # once per run (screenshot, DOM)
    assert opened.from_page() == [], opened.requests  # the page itself requests nothing
    assert not re.search(r'(src|href)="(?!data:|#)', opened.dom)  # and names nothing it could fetch (#: in-page)
    plots = dict(re.findall(r'<figure class="plot" id="([\w-]+)">(.*?)</figure>', opened.dom, re.S))
    assert set(plots) == {"plot-loss", "plot-throughput", "plot-memory", "plot-expert-load", "plot-evaluation"}
    for name, figure in plots.items():
        assert figure.startswith("<svg") and figure.count("<path") > 10, name  # axes, ticks and the drawn data
    assert "<image" in plots["plot-expert-load"]  # the heatmap: a raster embedded as a data: URI
    assert "all-to-all 20.0% of training time, context-parallel exchanges 10.0%; loss" in opened.dom
    reproduce = re.search(r'<pre id="reproduce">(.*?)</pre>', opened.dom, re.S).group(1)
    body = json.loads(html.unescape(reproduce))  # posted again, it is the same run
    assert resolve_run_config(JobCreate.model_validate(body), body["seed"]) == run.config

    image = Image.open(opened.screenshot).convert("L")
    histogram = image.histogram()
    assert histogram[255] < 0.9 * sum(histogram), "the screenshot is blank"
