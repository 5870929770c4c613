"""The web console (/console) in Debian's headless chromium against a real control plane (scheduler off: the test
moves the job along with worker reports, as tests/service do): sign-in, the upload's refused row, field errors next
to their fields, the live chart, actions, compare, the playground without a Serve app, and another tenant seeing
none of it. Every request the page makes stays on loopback; no console errors."""

from __future__ import annotations

import re
import time

import pytest

from tests.support.console_browser import console_session, tick_labels
from tests.support.control_plane import TOKENS, run_service, settings_for

BASE = "tiny-base"
STEPS = 30
GOOD_ROWS = [
    '{"text": "the sky is blue"}',
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    '{"text": "grass is green"}',
]


@pytest.fixture(scope="module")
def console(tmp_path_factory, s3_endpoint, output_bucket):
    settings = settings_for(tmp_path_factory.mktemp("console"), s3_endpoint_url=s3_endpoint,
                            base_models={BASE: "s3://models/tiny"})
    with run_service(settings) as running:
        yield running


def _sign_in(s, url: str, tenant: str) -> None:
    s.page.goto(f"{url}/console/jobs")
    s.page.wait_for_url(re.compile(r"/console/login\?next="))
    s.page.keyboard.type(TOKENS[tenant])  # the token field has the focus
    s.page.keyboard.press("Enter")
    s.page.wait_for_url(f"{url}/console/jobs")
    s.page.wait_for_selector("#jobs-count:not(:empty)")


def _points(s, series: str) -> int:
    line = s.page.query_selector(f'#chart polyline[data-series="{series}"]')
    return int(line.get_attribute("data-points")) if line else 0


def test_the_console_drives_a_job_and_keeps_tenants_apart(console, tmp_path):
    url = console.url
    started = time.monotonic()
    with console_session(tmp_path / "screenshots") as s:
        page = s.page
        # a wrong token is refused on the sign-in page
        page.goto(f"{url}/console/login")
        page.fill("#token", "not-a-token")
        page.click("#sign-in")
        page.wait_for_selector("#login-error:has-text('not valid')")
        s.shot("login")
        _sign_in(s, url, "tenant-a")
        assert "No jobs yet" in page.inner_text("#jobs-count")

        # upload: the refused row is marked with its problem, then the fixed file is taken
        page.click("a[data-nav=new]")
        page.wait_for_selector("#upload-file")
        bad = tmp_path / "train.jsonl"
        bad.write_text("\n".join([GOOD_ROWS[0], '{"txt": "no text field"}', GOOD_ROWS[2]]) + "\n")
        page.set_input_files("#upload-file", str(bad))
        page.click("#upload")
        page.wait_for_selector("#rows-table tr.bad-row")
        assert page.get_attribute("#rows-table tr.bad-row", "data-row") == "2"
        assert page.inner_text("#rows-table tr[data-row='1'] td:last-child") == "ok"
        assert "row 2" in page.inner_text("#upload-status")
        s.shot("new-job-refused-row")
        bad.write_text("\n".join(GOOD_ROWS) + "\n")
        page.set_input_files("#upload-file", str(bad))
        page.click("#upload")
        page.wait_for_selector("#upload-status:has-text('3 rows')")
        file_id = page.input_value("#field-training_file")
        assert file_id.startswith("file-")
        assert page.input_value("#field-model") == BASE
        # the ZeRO menu offers every stage the planner may recommend; the planner's cluster follows the job's workers
        assert [o.get_attribute("value") for o in page.query_selector_all("#field-parallelism\\.zero_stage option")] \
            == ["1", "2", "3"]
        assert (page.input_value("#field-nodes"), page.input_value("#field-gpus_per_node")) == ("1", "2")
        page.fill("#field-parallelism\\.num_workers", "3")
        assert page.input_value("#field-gpus_per_node") == "3"
        page.fill("#field-parallelism\\.num_workers", "2")
        s.both_widths("new-job")

        # a plan request's bad field, and a submission's, are shown next to their fields
        page.fill("#field-gpu_memory", "lots")
        page.focus("#plan")
        page.keyboard.press("Enter")
        page.wait_for_selector("#error-gpu_memory:not(:empty)")
        page.fill("#field-gpu_memory", "80GB")
        page.fill("#field-training\\.global_batch_size", "3")
        page.click("#submit")
        page.wait_for_selector("#error-training\\.global_batch_size:not(:empty)")
        assert "multiple of micro_batch_size" in page.inner_text("#error-training\\.global_batch_size")
        assert page.get_attribute("#field-training\\.global_batch_size", "aria-invalid") == "true"
        s.shot("new-job-field-error")
        page.fill("#field-training\\.global_batch_size", "4")
        page.fill("#field-suffix", "console")
        page.click("#submit")
        page.wait_for_url(re.compile(r"/console/jobs/ftjob-"))
        job_id = page.url.rsplit("/", 1)[1]

        # the job moves on as its workers report: the chart grows without a reload
        page.wait_for_selector("#events li")
        token = console.start_job(job_id)
        console.report(job_id, token, {"kind": "event", "message": "LoRA coverage: ...", "data": {"lora_coverage": [
            {"layer_type": "linear attention", "layers": 2, "adapted_layers": 2, "adapted": ["q_proj"],
             "not_adapted": ["o_proj"], "trainable_parameters": 1024}]}})
        for step in range(1, STEPS):  # the message as the workers' reporter writes it: the figures' Python reprs
            load = {"1": 1.0 + step / 20, "2": 1.64 - step / 100}
            console.report(job_id, token, {"kind": "event", "type": "metrics",
                                           "message": f"Step {step}: train_loss={6.9 / step:.4g}, expert_imbalance={load}",
                                           "data": {"step": step, "total_steps": STEPS, "train_loss": 6.9 / step,
                                                    "expert_imbalance": load}})
            page.wait_for_selector(f'#chart polyline[data-series="train loss"][data-points="{step}"]', state="attached")
        assert console.report_checkpoint(job_id, token, 2, train_loss=1.5, valid_loss=1.6).status_code == 200
        page.wait_for_selector("#checkpoints-table td:has-text('1.6')")
        page.wait_for_selector("#coverage-table td:has-text('q_proj')")
        page.wait_for_selector("#expert-load-table")
        page.wait_for_selector("#summary [data-status=running]")
        # step events in words; the expert load of every step so far; round chart ticks; the base by its name
        events = page.inner_text("#events")
        assert "{'" not in events and "expert imbalance: layer 1 1.05, layer 2 1.63" in events, events[:400]
        heading = [el.inner_text() for el in page.query_selector_all("#expert-load-table thead th")][1:]
        assert heading == [str(step) for step in range(1, STEPS)], heading
        assert tick_labels(page, "#chart", "y") == ["0", "2", "4", "6", "8"]
        assert tick_labels(page, "#chart", "x")[-1] == "30"
        assert page.inner_text("#base-model") == BASE
        s.both_widths("job-running")
        console.report(job_id, token, {"kind": "event", "type": "metrics", "message": f"Step {STEPS}", "data": {
            "step": STEPS, "total_steps": STEPS, "train_loss": 0.7, "valid_loss": 0.9}})
        console.report(job_id, token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/adapter"})
        page.wait_for_selector("#summary [data-status=succeeded]")
        assert _points(s, "train loss") == STEPS and _points(s, "valid loss") == 1
        # a week-long job's chart draws at most 2000 points per series (every k-th step, the newest included)
        assert page.evaluate("""async () => { const { thinned } = await import('/console/static/chart.js');
            const drawn = thinned(Array.from({ length: 100001 }, (_, i) => [i, 1]), 2000);
            return [drawn.length <= 2001, drawn[0][0], drawn.at(-1)[0]]; }""") == [True, 0, 100000]
        assert page.inner_text("#tuned-model") == f"ft:{BASE}:console:{job_id}"
        assert page.is_enabled("#deploy") and page.is_disabled("#cancel")
        page.click("#open-report")  # this job's driver wrote no report: the API's answer says so
        page.wait_for_selector("main .error:has-text('no adaptation report')")

        # a second job, paused, resumed and cancelled from its page; both compared
        other = console.create_job("tenant-a", model=BASE, training_file=file_id)["id"]
        page.goto(f"{url}/console/jobs/{other}")
        for action, status in (("pause", "paused"), ("resume", "queued"), ("cancel", "cancelled")):
            page.click(f"#{action}")
            page.wait_for_selector(f"#summary [data-status={status}]")
            assert page.inner_text("#action-status") == f"{action}: the job is now {status}."
        page.goto(f"{url}/console/jobs")
        page.wait_for_selector(f"tr[data-job='{other}']")
        page.select_option("#status-filter", "succeeded")
        assert page.query_selector_all("#jobs-body tr") and not page.query_selector(f"tr[data-job='{other}']")
        page.select_option("#status-filter", "")
        assert {el.inner_text() for el in page.query_selector_all("#jobs-body td[data-base]")} == {BASE}
        s.both_widths("jobs")
        for job in (job_id, other):
            page.check(f"tr[data-job='{job}'] input[type=checkbox]")
        page.click("#compare-selected")
        page.wait_for_selector(f'#compare-chart polyline[data-series="{job_id} train"][data-points="{STEPS}"]')
        heading = page.inner_text("#compare-table thead")
        assert job_id in heading and other in heading
        s.both_widths("compare")

        # the playground lists the tuned model beside its base; without a Serve app it says so in the answer
        page.goto(f"{url}/console/playground")
        page.wait_for_selector("#answers section")
        assert page.input_value("#model") == f"ft:{BASE}:console:{job_id}"
        assert len(page.query_selector_all("#answers section")) == 2
        page.fill("#message", "What colour is the sky?")
        page.keyboard.press("Control+Enter")
        page.wait_for_selector("#answers .error:has-text('deploy a succeeded job first')")
        s.shot("playground-no-serve")

        # tenant B sees none of it: no job, no file, no model, the job's page as for an unknown id
        page.click("#sign-out")
        _sign_in(s, url, "tenant-b")
        assert "No jobs yet" in page.inner_text("#jobs-count")
        page.goto(f"{url}/console/jobs/{job_id}")
        page.wait_for_selector("#not-found")
        page.goto(f"{url}/console/new")
        page.wait_for_selector("#field-training_file")
        page.goto(f"{url}/console/playground")
        page.wait_for_selector("#answers section")
        page.goto(f"{url}/console/compare?jobs={job_id},{other}")
        page.wait_for_selector("#comparison .error")
        assert job_id not in page.inner_text("#comparison").replace(f"No such job: {job_id}", "")
        for path in ("/console/jobs", "/console/new", "/console/playground"):
            page.goto(url + path)
            page.wait_for_selector("#main h1")
            page.wait_for_load_state("networkidle")
            text = page.inner_text("body")
            assert job_id not in text and other not in text and file_id not in text and "console:" not in text, path
        s.shot("tenant-b-jobs")

    assert s.errors == []
    assert set(s.failed_statuses) <= {401, 404, 422, 503}, s.failed_statuses
    assert s.requests and s.off_loopback() == []
    print(f"console browser test: {time.monotonic() - started:.1f} s, {len(s.requests)} requests, all on loopback")
