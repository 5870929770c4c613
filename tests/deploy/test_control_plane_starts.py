"""The Deployment's own command, arguments and environment start a working control plane.

Nothing is retyped from the chart: the container's command/args and its env (ConfigMap + Secrets, as the kubelet
would assemble them) come from the rendered manifest. Only what names the cluster is swapped for loopback: the
bind address, the port, the Ray head (the session's real local Ray head), the S3 endpoint (the real local S3
server) and the callback URL. The database is an external URL, as a platform team would give it (SQLite here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moetune.service.local.embedded import free_port, stop_process, wait_http

# Cluster-side settings that have a loopback stand-in in this test.
CLUSTER_ADDRESSES = ("MOETUNE_RAY_ADDRESS", "MOETUNE_S3_ENDPOINT_URL", "MOETUNE_CALLBACK_URL")


@pytest.fixture
def control_plane(render, ray_head, s3_endpoint, tmp_path):
    """Runs the rendered control-plane container command here; yields (base URL, its environment, the manifest)."""
    rendered = render({
        "database": {"url": f"sqlite:///{tmp_path}/moetune.db", "bundled": {"enabled": False}},
        "s3": {"endpointUrl": "http://minio.storage.svc:9000", "accessKeyId": "moetune-local",
               "secretAccessKey": "moetune-local"},
        "auth": {"apiTokens": "deploy-token:team-a"},
    })
    container = rendered.control_plane
    env = rendered.resolve_env(container)
    assert set(CLUSTER_ADDRESSES) <= env.keys()
    port = free_port()
    env.update(MOETUNE_RAY_ADDRESS=ray_head.dashboard_url, MOETUNE_S3_ENDPOINT_URL=s3_endpoint,
               MOETUNE_CALLBACK_URL=f"http://127.0.0.1:{port}")

    argv = container["command"] + container["args"]
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == str(http_port)
    argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)

    # The image puts its virtual environment first on PATH; here that is this interpreter's.
    path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
    log_path = tmp_path / "control-plane.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env={"PATH": path, "HOME": str(tmp_path), **env}, cwd=tmp_path,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}{container['readinessProbe']['httpGet']['path']}", 60, proc, str(log_path))
        yield url, env, container
    finally:
        stop_process(proc)


def test_rendered_command_and_env_serve_probes_api_and_metrics(control_plane):
    url, env, container = control_plane
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        response = httpx.get(url + container[probe]["httpGet"]["path"], timeout=5)
        assert response.status_code == 200, (probe, response.text)
    assert httpx.get(url + "/readyz", timeout=5).json() == {
        "status": "ready", "dependencies": {"database": "ok", "storage": "ok", "ray": "ok"}}

    token = env["MOETUNE_API_TOKENS"].split(":")[0]
    jobs = httpx.get(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert jobs.status_code == 200 and jobs.json()["data"] == []
    assert httpx.get(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
    assert httpx.get(url + "/metrics", timeout=5).status_code == 200


def _labels_by_sample(metrics_text: str) -> dict[str, set[str]]:
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return exprs + [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_job_overview_dashboard_queries_only_metrics_and_labels_the_control_plane_exports(control_plane, chart_dir):
    url, env, _ = control_plane
    token = env["MOETUNE_API_TOKENS"].split(":")[0]
    httpx.get(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    exported = _labels_by_sample(httpx.get(url + "/metrics", timeout=5).text)
    dashboard = json.loads((chart_dir / "dashboards" / "job-overview.json").read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 8
    for query in queries:
        names = set(re.findall(r"\b(moetune_[a-z0-9_]+)", query))
        assert names, query
        assert names <= exported.keys(), (query, names - exported.keys())
        used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", query))
        for group in re.findall(r"\bby\s*\(([^)]*)\)", query):
            used |= {label.strip() for label in group.split(",")}
        known = set().union(*(exported[n] for n in names))
        # `namespace` is a target label Prometheus adds when it scrapes through the ServiceMonitor.
        assert used - {"namespace"} <= known, (query, used - known)
