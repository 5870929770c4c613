"""The web console end to end, in Debian's headless chromium: a real `moetune server` on the session's Ray head and
S3 server, one real tiny job from the page (upload with a refused row, fixed, plan, submit), the loss chart
growing while it trains, the job succeeding, its adaptation report, deploy and a streamed chat in the playground
beside the base; then another tenant sees none of it. Every request the page makes stays on loopback."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from bench.support.replicas import spawn_control_plane
from moetune.service.cli.serve import wait_until_running
from moetune.service.cluster import serve_deploy
from moetune.service.local.embedded import free_port, stop_process
from tests.support.console_browser import console_session
from tests.support.control_plane import TOKENS, control_plane_env

pytestmark = pytest.mark.ray_job
BASE = "tiny-kimi-linear"
JOB_TIMEOUT_MS = 600_000


@pytest.fixture
def console_server(s3_endpoint, ray_head, serve_url, tiny_assets, tmp_path):
    """A control plane of its own (its database holds only this test's job), with the tiny base registered and the
    Ray head's Serve URL; Serve is shut down afterwards."""
    port = free_port()
    env = {**control_plane_env(s3_endpoint, ray_head, tmp_path, port),
           "MOETUNE_BASE_MODELS": f"{BASE}={tiny_assets['model']}",
           "MOETUNE_SERVE_URL": serve_url}
    proc = spawn_control_plane(env, port, tmp_path / "server.log")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "serve_url": env["MOETUNE_SERVE_URL"], "ray": ray_head.dashboard_url,
               "s3": s3_endpoint, "model": tiny_assets["model"]}
    finally:
        httpx.delete(f"{ray_head.dashboard_url}/api/serve/applications/", timeout=60)
        stop_process(proc)


def _sign_in(page, url: str, tenant: str) -> None:
    page.goto(f"{url}/console/jobs")
    page.wait_for_url(re.compile(r"/console/login"))
    page.fill("#token", TOKENS[tenant])
    page.keyboard.press("Enter")
    page.wait_for_selector("#jobs-count:not(:empty)")


def test_a_job_from_upload_to_playground_in_the_browser(console_server, tiny_assets, tmp_path):
    url = console_server["url"]
    started = time.monotonic()
    train_rows = tiny_assets["local_train"].read_text().splitlines()
    with console_session(tmp_path / "screenshots") as s:
        page = s.page
        _sign_in(page, url, "tenant-a")
        s.shot("jobs-empty")

        # the upload: row 5 refused (marked on its row), then the fixed file, and a validation file
        page.click("a[data-nav=new]")
        broken = tmp_path / "train.jsonl"
        broken.write_text("\n".join(train_rows[:4] + ['{"messages": "not a list"}'] + train_rows[5:]) + "\n")
        page.set_input_files("#upload-file", str(broken))
        page.click("#upload")
        page.wait_for_selector("#rows-table tr.bad-row[data-row='5']")
        s.shot("new-job-refused-row")
        page.set_input_files("#upload-file", str(tiny_assets["local_train"]))
        page.click("#upload")
        page.wait_for_selector(f"#upload-status:has-text('{len(train_rows)} rows')")
        train_file = page.input_value("#field-training_file")
        valid = tmp_path / "valid.jsonl"
        valid.write_text("\n".join(train_rows[:16]) + "\n")
        page.set_input_files("#upload-file", str(valid))
        page.click("#upload")
        page.wait_for_selector("#upload-status:has-text('16 rows')")
        page.select_option("#field-validation_file", page.input_value("#field-training_file"))
        page.select_option("#field-training_file", train_file)

        # the demo job's shape; the planner's answer for one node of two 6 GB GPUs
        for name, value in (("training.max_steps", "12"), ("training.global_batch_size", "4"),
                            ("training.seq_len", "96"), ("training.eval_every", "4"),
                            ("training.checkpoint_every", "6"), ("parallelism.num_workers", "2"), ("suffix", "console"),
                            ("gpu_memory", "6GB")):
            page.fill("#field-" + name.replace(".", "\\."), value)
        page.click("#plan")
        page.wait_for_selector("#plan-verdict, #form-error:not(:empty), .field-error:not(:empty)", timeout=180_000)
        refused = [el.inner_text() for el in page.query_selector_all("#form-error, .field-error") if el.inner_text()]
        assert not refused and page.inner_text("#plan-verdict").startswith("Fits"), refused
        # the planner's cluster is the job's: two workers, planned as two devices; whatever it recommends is offered
        assert (page.input_value("#field-nodes"), page.input_value("#field-gpus_per_node")) == ("1", "2")
        stages = [o.get_attribute("value") for o in page.query_selector_all("#field-parallelism\\.zero_stage option")]
        recommended = re.findall(r"ZeRO-(\d)", page.inner_text("#plan-table thead"))
        assert recommended and set(recommended) <= set(stages), (recommended, stages)
        # the estimated steps of the layouts that fit, the recommended one among them
        rows = [row.inner_text() for row in page.query_selector_all("#plan-tradeoffs tr")]
        assert f"ZeRO-{recommended[1]}" in next(row for row in rows if "recommended" in row), rows
        s.both_widths("new-job-plan")
        page.click("#submit")
        page.wait_for_url(re.compile(r"/console/jobs/ftjob-"))
        job_id = page.url.rsplit("/", 1)[1]

        # meanwhile the Serve app starts for the base (as `moetune demo` does), so Deploy finds it up
        serve_deploy.deploy(console_server["ray"], console_server["serve_url"], url,
                            {BASE: console_server["model"]}, console_server["s3"])

        # the chart grows without a reload while the job trains, until it succeeds
        counts, deadline = [], time.monotonic() + JOB_TIMEOUT_MS / 1000
        while not page.query_selector("#summary [data-status=succeeded]"):
            assert not page.query_selector("#summary [data-status=failed]"), page.inner_text("#summary")
            assert time.monotonic() < deadline, f"job {job_id} did not succeed: {page.inner_text('#summary')}"
            line = page.query_selector('#chart polyline[data-series="train loss"]')
            count = int(line.get_attribute("data-points")) if line else 0
            if count and (not counts or counts[-1] != count):
                counts.append(count)
                if count == 6:
                    s.shot("job-running")
            time.sleep(0.2)
        page.wait_for_selector('#chart polyline[data-series="train loss"][data-points="12"]', state="attached")
        assert len(counts) >= 3 and counts == sorted(counts), counts  # seen at several sizes, only growing
        page.wait_for_selector("#checkpoints-table")
        page.wait_for_selector("#coverage-table")
        # the base by its registered name; the expert load of every step the report holds
        assert page.inner_text("#base-model") == BASE
        report = httpx.get(f"{url}/v1/fine_tuning/jobs/{job_id}/report",
                           headers={"Authorization": f"Bearer {TOKENS['tenant-a']}"}, timeout=30).json()
        if report.get("expert_imbalance"):
            page.wait_for_selector("#expert-load-table")
            heading = [el.inner_text() for el in page.query_selector_all("#expert-load-table thead th")][1:]
            assert heading == [str(step) for step in report["expert_imbalance"]["steps"]], heading
        s.both_widths("job-succeeded")

        # the adaptation report, framed from the API
        page.click("#open-report")
        frame = page.frame_locator("#report-frame")
        frame.locator("body").wait_for()
        assert job_id in frame.locator("body").inner_text()
        s.shot("report")

        # deploy from the job's page, then chat with the tuned model beside its base, streamed
        page.go_back()
        page.click("#deploy")
        page.wait_for_selector("#action-status:has-text('Serving')", timeout=240_000)
        assert wait_until_running(console_server["ray"], 240) == "RUNNING"
        page.click("#open-playground")
        page.wait_for_selector("#answers section")
        page.fill("#message", "What colour is the sky?")
        page.keyboard.press("Control+Enter")
        page.wait_for_selector("#send:not([disabled])", timeout=240_000)  # both answers have ended
        answers = {el.get_attribute("data-model"): el.inner_text()
                   for el in page.query_selector_all("#answers .assistant")}
        assert set(answers) == {f"ft:{BASE}:console:{job_id}", BASE}, answers
        assert all(answers.values()) and not page.query_selector("#answers .error"), answers
        s.shot("playground")

        # another tenant: no job, no file, no tuned model; the job's and its report's pages as for an unknown id
        page.click("#sign-out")
        _sign_in(page, url, "tenant-b")
        assert "No jobs yet" in page.inner_text("#jobs-count")
        for path in (f"/console/jobs/{job_id}", f"/console/jobs/{job_id}/report"):
            page.goto(url + path)
            page.wait_for_selector("#not-found")
        for path in ("/console/jobs", "/console/new", "/console/playground", "/console/compare"):
            page.goto(url + path)
            page.wait_for_load_state("networkidle")
            text = page.inner_text("body")
            assert job_id not in text and train_file not in text and "console:" not in text, path
        s.shot("tenant-b-playground")

    assert s.errors == []
    assert set(s.failed_statuses) <= {401, 404, 422}, s.failed_statuses
    assert s.requests and s.off_loopback() == []
    print(f"console end-to-end browser test: {time.monotonic() - started:.0f} s, {len(s.requests)} requests on "
          f"loopback; chart sizes seen while training: {counts}")
