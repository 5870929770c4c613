"""Every rendered object is valid for Kubernetes and for KubeRay, and the objects point at each other correctly."""

from __future__ import annotations

import copy
import json

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

KUBE_VERSION = "1.30"
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor"}


def k8s_validate(obj: dict) -> None:
    """Strict: an unknown field is an error, as with `kubectl apply` (server-side field validation)."""
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def ray_pod_templates(cluster: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_chart_lints_clean_for_every_value_set(chart_dir, value_set):
    report = helm.lint(chart_dir, value_set, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_every_builtin_object_validates_against_kubernetes(rendered):
    builtin = [o for o in rendered.objects if o["kind"] not in CUSTOM_KINDS]
    assert {"Deployment", "Service", "ConfigMap"} <= {o["kind"] for o in builtin}
    for obj in builtin:
        k8s_validate(obj)


def test_raycluster_validates_against_kuberay_schema_and_its_pods_against_kubernetes(rendered, raycluster_schema):
    clusters = rendered.find("RayCluster")
    if rendered.values.get("ray", {}).get("enabled", True) is False:
        assert not clusters
        return
    (cluster,) = clusters
    jsonschema.validate(cluster, raycluster_schema, cls=jsonschema.Draft202012Validator)
    for template in ray_pod_templates(cluster):
        k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ray-pod"},
                      "template": template})


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"]["template"]["spec"]["containers"][0].update({"envv": []}),
    lambda d: d["spec"].update({"replicas": "1"}),
], ids=["misspelt-field", "string-replicas"])
def test_kubernetes_validation_rejects_a_broken_deployment(render, break_it):
    deployment = copy.deepcopy(render({}).one("Deployment"))
    break_it(deployment)
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(deployment)


@pytest.mark.parametrize("break_it", [
    lambda c: c["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 4}),
    lambda c: c["spec"]["workerGroupSpecs"][0].pop("groupName"),
    lambda c: c["spec"]["workerGroupSpecs"][0].update({"replicas": "2"}),
    lambda c: c["spec"].update({"workerGroupSpec": []}),
], ids=["number-in-rayStartParams", "no-groupName", "string-replicas", "misspelt-field"])
def test_kuberay_schema_rejects_what_the_operator_would(render, raycluster_schema, break_it):
    cluster = copy.deepcopy(render({}).one("RayCluster"))
    break_it(cluster)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, raycluster_schema, cls=jsonschema.Draft202012Validator)


def test_control_plane_talks_to_the_ray_head_jobs_api_and_workers_call_back_to_its_service(rendered):
    env = rendered.resolve_env(rendered.control_plane)
    service = rendered.one("Service", rendered.one("Deployment")["metadata"]["name"])
    port = service["spec"]["ports"][0]["port"]
    assert env["MOETUNE_CALLBACK_URL"] == f"http://{service['metadata']['name']}.{rendered.namespace}.svc:{port}"
    ray = rendered.values.get("ray", {})
    if ray.get("enabled", True) is False:
        assert env["MOETUNE_RAY_ADDRESS"] == ray["externalAddress"]
        return
    cluster = rendered.one("RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    dashboard = next(p["containerPort"] for p in head["ports"] if p["name"] == "dashboard")
    # KubeRay names the head Service "<RayCluster name>-head-svc".
    assert env["MOETUNE_RAY_ADDRESS"] == (
        f"http://{cluster['metadata']['name']}-head-svc.{rendered.namespace}.svc:{dashboard}")
    assert dashboard == 8265
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_every_ray_container_and_the_control_plane_share_the_ray_auth_token(rendered):
    def auth_refs(container):
        env = {v["name"]: v for v in container.get("env", [])}
        if "RAY_AUTH_TOKEN" not in env:
            return None
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        return json.dumps(env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"], sort_keys=True)

    refs = {auth_refs(rendered.control_plane)}
    for cluster in rendered.find("RayCluster"):
        refs |= {auth_refs(c) for t in ray_pod_templates(cluster) for c in t["spec"]["containers"]}
    enabled = rendered.values.get("ray", {}).get("auth", {}).get("enabled", True)
    assert len(refs) == 1 and (None not in refs) == enabled, refs


def test_storage_keys_reach_ray_pods_from_their_secret_never_through_a_jobs_runtime_env(chart, rendered):
    def key_refs(container) -> str:
        env = {v["name"]: v for v in container.get("env", [])}
        return json.dumps([env[k]["valueFrom"] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if k in env],
                          sort_keys=True)

    refs = {key_refs(rendered.control_plane)}
    for cluster in rendered.find("RayCluster"):
        refs |= {key_refs(c) for t in ray_pod_templates(cluster) for c in t["spec"]["containers"]}
    s3 = rendered.values.get("s3", {})
    assert len(refs) == 1 and (refs != {"[]"}) == bool(s3.get("existingSecret") or s3.get("accessKeyId")), refs
    passthrough = chart.merge_values(rendered.values)["controlPlane"]["workerEnvPassthrough"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(passthrough)


def test_ray_groups_get_their_resources_replicas_scheduling_and_a_memory_backed_dev_shm(chart, rendered):
    ray = chart.merge_values(rendered.values)["ray"]
    for cluster in rendered.find("RayCluster"):
        workers = cluster["spec"]["workerGroupSpecs"]
        assert [w["groupName"] for w in workers] == [g["name"] for g in ray["workerGroups"]]
        for spec, group in zip(workers, ray["workerGroups"]):
            assert [spec["replicas"], spec["minReplicas"], spec["maxReplicas"]] == \
                [group["replicas"], group["minReplicas"], group["maxReplicas"]]
            assert spec["rayStartParams"] == group.get("rayStartParams", {})
        for template, group in zip(ray_pod_templates(cluster), [ray["head"]] + ray["workerGroups"]):
            pod = template["spec"]
            (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": group["shmSize"]}
            (container,) = pod["containers"]
            assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
            assert container["resources"] == group["resources"]
            assert pod.get("nodeSelector", {}) == group.get("nodeSelector", {})
            assert pod.get("tolerations", []) == group.get("tolerations", [])
            assert pod.get("serviceAccountName", "") == ray["serviceAccountName"]
            # The weights cache: an emptyDir of the group's size, capped at 90 % of it; off without one.
            env = {e["name"]: e.get("value") for e in container["env"]}
            size = group.get("weightsCacheGiB", 0)
            cache = [v for v in pod["volumes"] if v["name"] == "weights-cache"]
            if size:
                assert cache == [{"name": "weights-cache", "emptyDir": {"sizeLimit": f"{size}Gi"}}]
                assert {"name": "weights-cache", "mountPath": env["MOETUNE_WEIGHTS_CACHE_DIR"]} in \
                    container["volumeMounts"]
                assert int(env["MOETUNE_WEIGHTS_CACHE_MAX_GB"]) == int(size * 2**30 * 0.9 / 1e9)
            else:
                assert not cache and env["MOETUNE_WEIGHTS_CACHE_DIR"] == ""
                assert "MOETUNE_WEIGHTS_CACHE_MAX_GB" not in env


def test_default_cluster_puts_gpus_on_workers_and_none_on_the_head(render):
    cluster = render({}).one("RayCluster")
    (gpu,) = cluster["spec"]["workerGroupSpecs"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_every_secret_and_configmap_the_control_plane_reads_is_rendered_or_named_by_the_user(rendered):
    user_secrets = {rendered.values.get(section, {}).get("existingSecret")
                    for section in ("auth", "s3", "database")} | \
        {rendered.values.get("ray", {}).get("auth", {}).get("existingSecret")}
    rendered_secrets = {s["metadata"]["name"]: s["stringData"] for s in rendered.find("Secret")}
    container = rendered.control_plane
    for var in container["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["name"] not in user_secrets:
            assert ref["key"] in rendered_secrets.get(ref["name"], {}), var
    for source in container["envFrom"]:
        assert rendered.find("ConfigMap", source["configMapRef"]["name"])


def test_service_monitor_scrapes_the_control_plane_metrics_port(render):
    rendered = render({"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    monitor = rendered.one("ServiceMonitor")
    service = rendered.one("Service", rendered.one("Deployment")["metadata"]["name"])
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [rendered.namespace]
    assert not render({}).find("ServiceMonitor")  # needs prometheus-operator: off unless asked for


def test_ray_pod_monitor_hook_selects_this_release_ray_pods_on_their_metrics_port(render):
    rendered = render({"monitoring": {"rayPodMonitor": {"enabled": True}}})
    monitor = rendered.one("PodMonitor")
    cluster = rendered.one("RayCluster")
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert {"metrics", "train-0", "train-7"} <= endpoints  # Ray's metrics + one per training worker of a pod
    for template in ray_pod_templates(cluster):
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert endpoints <= ports.keys() and ports["train-3"] == 9470 + 3
        assert {"name": "MOETUNE_METRICS_PORT", "value": "9470"} in container["env"]


def test_dashboards_ship_as_sidecar_configmaps_one_per_json_file(render, chart_dir):
    files = sorted(p.name for p in (chart_dir / "dashboards").glob("*.json"))
    assert "job-overview.json" in files
    maps = [m for m in render({}).find("ConfigMap") if m["metadata"]["labels"].get("grafana_dashboard") == "1"]
    shipped = sorted(name for m in maps for name in m["data"])
    assert shipped == files
    for m in maps:
        for name, text in m["data"].items():
            assert json.loads(text) == json.loads((chart_dir / "dashboards" / name).read_text())
    assert not render({"monitoring": {"grafanaDashboards": {"enabled": False}}}).find("ConfigMap", maps[0]["metadata"]["name"])


def test_generated_secrets_are_random_and_given_ones_are_used(render):
    first, second = render({}), render({})
    name = next(s["metadata"]["name"] for s in first.find("Secret") if s["metadata"]["name"].endswith("-api-tokens"))
    token = first.secret_value(name, "api-tokens")
    assert token.endswith(":default") and len(token.split(":")[0]) >= 32
    assert token != second.secret_value(name, "api-tokens")
    given = render({"auth": {"apiTokens": "t1:team-a,t2:team-b"}})
    assert given.resolve_env(given.control_plane)["MOETUNE_API_TOKENS"] == "t1:team-a,t2:team-b"


def test_bundled_postgres_url_uses_the_generated_password_and_the_database_service(render):
    rendered = render({})
    env = rendered.resolve_env(rendered.control_plane)
    (statefulset,) = rendered.find("StatefulSet")
    name = statefulset["metadata"]["name"]
    password = rendered.secret_value(name, "password")
    assert env["MOETUNE_DATABASE_URL"] == f"postgresql+psycopg://moetune:{password}@{name}:5432/moetune"
    service = rendered.one("Service", name)
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    external = render({"database": {"url": "postgresql+psycopg://u:p@db:5432/m", "bundled": {"enabled": False}}})
    assert not external.find("StatefulSet")
    assert external.resolve_env(external.control_plane)["MOETUNE_DATABASE_URL"] == "postgresql+psycopg://u:p@db:5432/m"


def test_images_default_to_the_app_version_cpu_for_the_control_plane_cuda_for_ray(render, chart):
    rendered = render({})
    version = chart.metadata["appVersion"]
    assert rendered.control_plane["image"] == f"moetune:{version}"
    for template in ray_pod_templates(rendered.one("RayCluster")):
        assert template["spec"]["containers"][0]["image"] == f"moetune:{version}-cuda"


def test_notes_tell_how_to_reach_the_api_and_read_the_token(rendered):
    assert "MOETUNE_URL" in rendered.notes and "MOETUNE_TOKEN" in rendered.notes


def test_control_plane_env_is_settings_the_service_reads_and_accepts(chart, rendered, monkeypatch):
    from moetune.service.settings import Settings

    env = rendered.resolve_env(rendered.control_plane)
    known = {f"MOETUNE_{name.upper()}" for name in Settings.model_fields}
    assert {name for name in env if name.startswith("MOETUNE_")} <= known
    for name in known:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    control_plane = chart.merge_values(rendered.values)["controlPlane"]
    assert settings.ray_address == env["MOETUNE_RAY_ADDRESS"]
    assert settings.worker_env_passthrough == control_plane["workerEnvPassthrough"]
    assert settings.max_running_jobs == control_plane["maxRunningJobs"]
    assert settings.default_output_uri == control_plane["defaultOutputUri"]
    assert (settings.scheduler_lease_s, settings.scheduler_lease_renew_s) == (
        control_plane["schedulerLease"]["leaseSeconds"], control_plane["schedulerLease"]["renewSeconds"])
    assert {tenant: quota.model_dump(by_alias=True, exclude_none=True)
            for tenant, quota in settings.tenant_quotas.items()} == control_plane["tenantQuotas"]


def test_replicas_roll_one_at_a_time_and_a_disruption_budget_keeps_one_serving(chart, rendered):
    deployment = rendered.one("Deployment")
    replicas = chart.merge_values(rendered.values)["controlPlane"]["replicas"]
    assert deployment["spec"]["replicas"] == replicas
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    budgets = rendered.find("PodDisruptionBudget")
    if replicas < 2:  # a budget for one pod would block every node drain
        assert not budgets
        return
    (budget,) = budgets
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_ray_head_keeps_its_state_in_the_given_redis_only(chart, rendered):
    """GCS fault tolerance (bench/cluster_faults.py measured worker nodes surviving a head restart with it): the
    RayCluster names the Redis and the password's Secret key when ray.gcsFaultTolerance has an address."""
    clusters = rendered.find("RayCluster")
    if not clusters:
        return
    wanted = chart.merge_values(rendered.values)["ray"]["gcsFaultTolerance"]
    options = clusters[0]["spec"].get("gcsFaultToleranceOptions")
    if not wanted["redisAddress"]:
        assert options is None
        return
    assert options["redisAddress"] == wanted["redisAddress"]
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert rendered.secret_value(ref["name"], ref["key"]) == "prod-redis-password"
