"""values.schema.json and the chart's own checks refuse values that could not work, with the key in the message."""

from __future__ import annotations

import re

import helm_python as helm
import kubernetes_validate
import pytest


def test_the_schema_accepts_the_defaults_and_every_value_set(chart, value_set):
    chart.validate_schema(chart.merge_values(value_set))


@pytest.mark.parametrize(("values", "where"), [
    ({"ray": {"head": {"rayStartParams": {"num-cpus": 4}}}}, "/ray/head/rayStartParams/num-cpus"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
                                "resources": {}, "shmSize": "8Gi", "rayStartParams": {"num-gpus": 8}}]}},
     "/ray/workerGroups/0/rayStartParams/num-gpus"),
    ({"ray": {"workerGroups": [{"name": "GPU_Group", "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
                                "resources": {}, "shmSize": "8Gi"}]}}, "/ray/workerGroups/0/name"),
    ({"ray": {"workerGroups": []}}, "/ray/workerGroups"),
    ({"ray": {"head": {"shmSize": "8 GB"}}}, "/ray/head/shmSize"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "resources": {},
                                "shmSize": "8Gi", "weightsCacheGiB": "400Gi"}]}}, "/ray/workerGroups/0/weightsCacheGiB"),
    ({"controlPlane": {"replicas": -1}}, "/controlPlane/replicas"),
    ({"controlPlane": {"schedulerLease": {"leaseSeconds": 0, "renewSeconds": 1}}},
     "/controlPlane/schedulerLease/leaseSeconds"),
    ({"controlPlane": {"tenantQuotas": {"team-a": {"gpuHour": 10}}}}, "/controlPlane/tenantQuotas/team-a"),
    ({"controlPlane": {"replcas": 1}}, "/controlPlane"),
    ({"controlPlane": {"maxRunningJobs": -1}}, "/controlPlane/maxRunningJobs"),
    ({"controlPlane": {"schedulerIntervalSeconds": 0}}, "/controlPlane/schedulerIntervalSeconds"),
    ({"controlPlane": {"defaultOutputUri": "outputs/"}}, "/controlPlane/defaultOutputUri"),
    ({"controlPlane": {"callbackUrl": "moetune:8000"}}, "/controlPlane/callbackUrl"),
    ({"controlPlane": {"workerEnvPassthrough": ["AWS KEY"]}}, "/controlPlane/workerEnvPassthrough/0"),
    ({"auth": {"apiTokens": "just-a-token"}}, "/auth/apiTokens"),
    ({"s3": {"endpointUrl": "minio:9000"}}, "/s3/endpointUrl"),
    ({"database": {"bundled": {"password": "p@ss/word"}}}, "/database/bundled/password"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"monitoring": {"serviceMonitor": {"interval": "30"}}}, "/monitoring/serviceMonitor/interval"),
    ({"rayy": {}}, "rayy"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_schema_rejects_bad_values_naming_the_key(chart, values, where):
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(chart.merge_values(values))
    with pytest.raises(helm.HelmValuesError):  # an install would stop here too
        chart.render(values, name="mt", namespace="ml")


@pytest.mark.parametrize(("values", "message"), [
    ({"database": {"url": "postgresql+psycopg://u:p@db/m"}}, "set database.bundled.enabled=false"),
    ({"database": {"bundled": {"enabled": False}}}, "give database.url or database.existingSecret"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 5, "minReplicas": 0, "maxReplicas": 4,
                                "resources": {}, "shmSize": "8Gi"}]}}, r"ray.workerGroups\[gpu\]"),
    ({"ray": {"enabled": False}}, "ray.externalAddress is required"),
    ({"ray": {"enabled": False, "externalAddress": "http://ray:8265"}}, "give its token"),
    ({"s3": {"accessKeyId": "AKIA"}}, "s3.accessKeyId needs s3.secretAccessKey"),
    ({"controlPlane": {"schedulerLease": {"leaseSeconds": 3, "renewSeconds": 3}}},
     "renewSeconds must be below leaseSeconds"),
], ids=["two-databases", "no-database", "replicas-over-max", "no-ray-address", "external-ray-no-token",
        "half-s3-keys", "lease-renewed-too-rarely"])
def test_impossible_combinations_fail_the_render_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="mt", namespace="ml")


def test_the_readme_install_command_renders_valid_objects(chart, chart_dir, render):
    readme = (chart_dir.parents[1] / "docs" / "kubernetes.md").read_text()  # the install walk-through
    command = re.search(r"helm install moetune \./helm/moetune.*?(?<!\\)\n", readme, re.DOTALL).group(0)
    values = helm.parse_set_string(",".join(re.findall(r"--set (\S+)", command)))
    assert values["database"]["bundled"]["enabled"] is False and values["monitoring"]["serviceMonitor"]["enabled"]
    chart.validate_schema(chart.merge_values(values))
    rendered = render(values)
    for obj in rendered.objects:
        if obj["kind"] not in {"RayCluster", "ServiceMonitor", "PodMonitor"}:
            kubernetes_validate.validate(obj, "1.30", strict=True)
    # The secrets the README creates by hand are the ones the Deployment reads, under the same keys.
    created = {(name, key) for name, literals in re.findall(r"create secret generic (\S+)(.*)", readme)
               for key in re.findall(r"--from-literal=([\w-]+)=", literals)}
    refs = {(v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
            for v in rendered.control_plane["env"] if "secretKeyRef" in v.get("valueFrom", {})}
    assert len(created) == 4 and created <= refs, created - refs
