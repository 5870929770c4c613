"""/metrics in the Prometheus text format: jobs by status, queue depth, request latency by route template, and
every metric the control plane's alert rules name."""

import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ALERTS = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml"


def scrape(service) -> dict[str, list]:
    text = service.http(None).get("/metrics").text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_count_jobs_and_time_requests(service):
    job_id = service.create_job()["id"]
    service.http().get(f"/v1/fine_tuning/jobs/{job_id}")
    service.http().post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    service.create_job()
    service.http().get("/v1/fine_tuning/jobs/ftjob-unknown")

    families = scrape(service)
    jobs = {s.labels["status"]: s.value for s in families["moetune_jobs"]}
    assert jobs["cancelled"] >= 1 and jobs["validating_files"] >= 1 and set(jobs) == {
        "validating_files", "queued", "running", "pausing", "paused", "succeeded", "failed", "cancelled"}
    assert families["moetune_queue_depth"][0].value == jobs["queued"]

    latency = {(s.labels["method"], s.labels["route"], s.labels["status_code"])
               for s in families["moetune_http_request_duration_seconds"] if s.name.endswith("_count")}
    assert ("POST", "/v1/fine_tuning/jobs", "200") in latency
    assert ("GET", "/v1/fine_tuning/jobs/{job_id}", "200") in latency
    assert ("GET", "/v1/fine_tuning/jobs/{job_id}", "404") in latency  # templates, not job ids
    assert ("POST", "/v1/fine_tuning/jobs/{job_id}/cancel", "200") in latency


def test_the_control_plane_alerts_name_metrics_it_exports(service):
    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "moetune-control-plane"]
    named = {name for rule in group["rules"] for name in re.findall(r"moetune_[a-z_]+", rule["expr"])}
    exported = {sample.name for samples in scrape(service).values() for sample in samples}
    assert named and named <= exported, named - exported
