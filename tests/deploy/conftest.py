"""The Helm chart rendered offline (helm-python-sdk binds Helm's Go SDK; no cluster, no helm binary)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from tests.support import REPO

CHART_DIR = REPO / "helm" / "moetune"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
RELEASE, NAMESPACE = "mt", "ml-platform"

# Value sets a platform team would plausibly install with; every test that renders runs over all of them.
VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "production": {
        "image": {"repository": "registry.example.internal/ml/moetune", "tag": "0.1.0"},
        "imagePullSecrets": [{"name": "registry-creds"}],
        "controlPlane": {
            "maxRunningJobs": 8,
            "replicas": 3,
            "tenantQuotas": {"*": {"maxRunningJobs": 2, "gpuHours": 500}, "team-a": {"maxWorkers": 64}},
            "defaultOutputUri": "s3://ml-outputs/moetune",
            "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            "ingress": {"enabled": True, "className": "nginx",
                        "hosts": [{"host": "moetune.example.internal", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                        "tls": [{"hosts": ["moetune.example.internal"], "secretName": "moetune-tls"}]},
        },
        "auth": {"existingSecret": "moetune-api-tokens", "existingSecretKey": "tokens"},
        "s3": {"endpointUrl": "https://minio.storage.svc:9000", "existingSecret": "moetune-s3"},
        "database": {"existingSecret": "moetune-db", "bundled": {"enabled": False}},
        "ray": {
            "auth": {"existingSecret": "ray-token"},
            "head": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0",
                                        "object-store-memory": "20000000000"},
                     "nodeSelector": {"node-pool": "cpu"}},
            "workerGroups": [
                {"name": "h200", "replicas": 2, "minReplicas": 1, "maxReplicas": 8,
                 "rayStartParams": {"num-cpus": "64"},
                 "resources": {"limits": {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": 8},
                               "requests": {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": 8}},
                 "shmSize": "128Gi", "weightsCacheGiB": 1000, "nodeSelector": {"node-pool": "h200"},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
                {"name": "a100", "replicas": 0, "minReplicas": 0, "maxReplicas": 2,
                 "resources": {"limits": {"nvidia.com/gpu": 4}}, "shmSize": "32Gi"},
            ],
            "enableInTreeAutoscaling": True,
            "serviceAccountName": "ray-s3-reader",
            "gcsFaultTolerance": {"redisAddress": "redis.ml-platform.svc:6379", "redisPasswordSecret": "ray-redis"},
        },
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "rayPodMonitor": {"enabled": True},
            "grafanaDashboards": {"annotations": {"grafana_folder": "moetune"}},
        },
        "serve": {"enabled": True, "publicUrl": "https://llm.example.internal",
                  "baseModels": {"kimi-linear-48b": "s3://ml-models/Kimi-Linear-48B-A3B-Instruct"}},
    },
    "external-ray": {
        "ray": {"enabled": False, "externalAddress": "http://ray-head.ray.svc:8265",
                "auth": {"token": "a-cluster-token"}},
        "database": {"url": "postgresql+psycopg://moetune:pw@db.example.internal:5432/moetune",
                     "bundled": {"enabled": False}},
        "s3": {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "secret"},
        "auth": {"apiTokens": "tok-a:team-a,tok-b:team-b"},
    },
    "bare": {
        "controlPlane": {"replicas": 1},
        "ray": {"auth": {"enabled": False}},
        "monitoring": {"grafanaDashboards": {"enabled": False}},
        "serviceAccount": {"create": False},
    },
}


# Secrets the "production" platform team created before installing (its values name them as existingSecret).
USER_SECRETS = {
    "moetune-api-tokens": {"tokens": "prod-token:team-a"},
    "moetune-s3": {"AWS_ACCESS_KEY_ID": "AKIAPROD", "AWS_SECRET_ACCESS_KEY": "prod-secret"},
    "moetune-db": {"database-url": "postgresql+psycopg://moetune:pw@pg.db.svc:5432/moetune"},
    "ray-token": {"auth-token": "prod-ray-token"},
    "ray-redis": {"redis-password": "prod-redis-password"},
}


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def chart(chart_dir):
    with helm.Chart.load(chart_dir) as loaded:
        yield loaded


class Rendered:
    """Every Kubernetes object the chart rendered for one set of values (NOTES.txt left out)."""

    namespace = NAMESPACE

    def __init__(self, chart: helm.Chart, values: dict):
        self.values = values
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        self.notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
        self.objects = [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
                        for doc in yaml.safe_load_all(text) if doc]

    def find(self, kind: str, name: str | None = None) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = self.find(kind, name)
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    @property
    def control_plane(self) -> dict:
        """The control plane's container."""
        return self.one("Deployment")["spec"]["template"]["spec"]["containers"][0]

    def secret_value(self, name: str, key: str) -> str:
        """From a Secret the chart rendered, or else from one the user created (USER_SECRETS)."""
        rendered = self.find("Secret", name)
        data = rendered[0].get("stringData", {}) if rendered else USER_SECRETS.get(name, {})
        assert key in data, f"Secret {name} has no key {key}"
        return data[key]

    def resolve_env(self, container: dict) -> dict[str, str]:
        """The container's environment as the kubelet builds it from the rendered ConfigMaps and Secrets.

        envFrom first, then env in order, with `$(NAME)` references to earlier variables expanded.
        """
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.one("ConfigMap", source["configMapRef"]["name"])["data"])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                          lambda m: env.get(m.group(1), m.group(0)), var["value"])
            else:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = self.secret_value(ref["name"], ref["key"])
        return env


@pytest.fixture
def render(chart):
    return lambda values: Rendered(chart, values)


@pytest.fixture(params=list(VALUE_SETS))
def value_set(request) -> dict:
    """Each named value set in turn."""
    return VALUE_SETS[request.param]


@pytest.fixture
def rendered(render, value_set) -> Rendered:
    return render(value_set)


@pytest.fixture(scope="session")
def raycluster_schema() -> dict:
    return json.loads((FIXTURES / "raycluster.schema.json").read_text())
