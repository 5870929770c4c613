"""The chart's `serve:` block: off by default; on, the Serve HTTP proxy's port on the Ray head, a Service to it,
the control plane told where clients reach it and which bases are registered, and its /metrics scraped."""

from __future__ import annotations

import json
import re

from tests.deploy.test_manifests import k8s_validate


def _serve_services(rendered) -> list[dict]:
    return [s for s in rendered.find("Service") if s["metadata"]["name"].endswith("-serve")]


def test_serve_is_off_by_default(render):
    off = render({})
    assert not _serve_services(off)
    assert "MOETUNE_SERVE_URL" not in off.resolve_env(off.control_plane)
    head = off.one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "serve" not in {p["name"] for p in head["ports"]}


def test_serve_on_exposes_the_app_and_tells_the_control_plane(render):
    bases = {"kimi-linear-48b": "s3://ml-models/Kimi-Linear-48B-A3B-Instruct"}
    on = render({"serve": {"enabled": True, "port": 8101, "baseModels": bases},
                 "monitoring": {"rayPodMonitor": {"enabled": True}}})
    (service,) = _serve_services(on)
    k8s_validate(service)
    cluster = on.one("RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": 8101} in head["ports"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8101, "targetPort": "serve"}]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    env = on.resolve_env(on.control_plane)
    assert env["MOETUNE_SERVE_URL"] == f"http://{service['metadata']['name']}.{on.namespace}.svc:8101"
    assert json.loads(env["MOETUNE_BASE_MODELS"]) == bases
    endpoints = on.one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert {"port": "serve", "path": "/metrics", "interval": "30s"} in endpoints
    public = render({"serve": {"enabled": True, "publicUrl": "https://llm.example.internal"}})
    assert public.resolve_env(public.control_plane)["MOETUNE_SERVE_URL"] == "https://llm.example.internal"


def test_serving_dashboard_queries_only_metrics_and_labels_the_serve_app_exports(chart_dir):
    from moetune.workers.serve.metrics import ServeMetrics
    from tests.deploy.test_control_plane_starts import _labels_by_sample, _queries

    metrics = ServeMetrics()
    metrics.requests.labels("chat.completion", "200").inc()
    metrics.tokens.labels("tiny").inc(3)
    metrics.ttft.labels("tiny").observe(0.2)
    stats = {"adapter_loads": 2, "adapter_evictions": 1, "adapter_load_failures": 0, "adapters_loaded": 1,
             "cache_bytes": {"linear_attention": 4096, "full_attention": 8192}}
    exported = _labels_by_sample(metrics.render({"s3://models/tiny": stats}).decode())
    dashboard = json.loads((chart_dir / "dashboards" / "moetune-serving.json").read_text())
    for query in _queries(dashboard):
        names = set(re.findall(r"\b(moetune_[a-z0-9_]+)", query))
        assert names and names <= exported.keys(), (query, names - exported.keys())
        used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", query))
        for group in re.findall(r"\bby\s*\(([^)]*)\)", query):
            used |= {label.strip() for label in group.split(",")}
        known = set().union(*(exported[n] for n in names))
        assert used - {"namespace"} <= known, (query, used - known)  # namespace: added by the PodMonitor scrape
