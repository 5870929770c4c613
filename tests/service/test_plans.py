"""The memory planner through the control plane and the CLI: POST /v1/fine_tuning/plans over real HTTP (the planner
in a child process), submission refusing a GPU job that cannot fit MOETUNE_CLUSTER (422, `parallelism`, with the
breakdown and a layout that fits), and `moetune plan` (table and JSON). A tiny kimi_linear checkpoint on file://."""

import json

import httpx
import pytest
import yaml
from click.testing import CliRunner

from moetune.service.cli.main import main
from moetune.workers.families import REGISTRY
from moetune.workers.tiny import write_tiny_tokenizer
from tests.support.control_plane import API_TOKENS, run_service

PLANS, JOBS = "/v1/fine_tuning/plans", "/v1/fine_tuning/jobs"
AUTH = {"Authorization": "Bearer tok-a"}
# one GPU of 6 GB: the tiny model fits at short contexts; 64 sequences of 16K tokens without recomputation do not
CLUSTER = {"nodes": 1, "gpus_per_node": 2, "gpu_memory": "6GB", "nic": "100Gbps"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-kimi")
    (folder / "config.json").write_text(REGISTRY["kimi_linear"].tiny_config().to_json_string())
    write_tiny_tokenizer(str(folder))
    (folder / "train.jsonl").write_text('{"text": "hello"}\n')
    return folder


def _job(model_dir, **training) -> dict:
    return {"model": f"file://{model_dir}", "training_file": f"file://{model_dir}/train.jsonl",
            "training": {"global_batch_size": 128, "seq_len": 16384, **training},
            "parallelism": {"num_workers": 2, "gpus_per_worker": 1, "expert_parallel_size": 1}}


TOO_BIG = {"micro_batch_size": 64, "activation_checkpointing": False}


@pytest.fixture(scope="module")
def service(model_dir):
    from moetune.service.settings import Settings

    cluster = ",".join(f"{k}={v}" for k, v in CLUSTER.items())
    settings = Settings(database_url=f"sqlite:///{model_dir}/moetune.db", api_tokens=API_TOKENS,
                        scheduler_enabled=False, allow_file_uris=True, file_uri_roots=[str(model_dir)],
                        default_output_uri=f"file://{model_dir}/out",
                        cluster=cluster)
    with run_service(settings) as running:
        yield running


def test_plan_endpoint_answers_the_plan(service, model_dir):
    response = httpx.post(service.url + PLANS, json={"job": _job(model_dir, micro_batch_size="auto"),
                                                     "cluster": CLUSTER}, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["model"]["model_type"] == "kimi_linear" and plan["submitted"]["fits"]
    assert plan["recommended"]["tuner_start_micro_batch"] >= 1 and plan["cluster"]["gpu_memory"] == 6e9


def test_a_layout_a_job_cannot_run_is_planned_and_refused_at_submission(service, model_dir):
    """Pipeline stages for a DPO job: the plans route answers for them (not runnable with this job's settings,
    said so), a job asking for them gets a 422 naming the field (a supervised job's run: test_timing)."""
    par = {"num_workers": 2, "gpus_per_worker": 1, "pipeline_parallel_size": 2}
    staged = {**_job(model_dir, micro_batch_size=1), "parallelism": par, "method": {"type": "dpo"}}
    response = httpx.post(service.url + PLANS, json={"job": staged, "cluster": CLUSTER}, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    submitted = response.json()["submitted"]
    assert submitted["parallelism"]["pipeline_parallel_size"] == 2 and submitted["available"] is False
    assert submitted["time"]["bubble_fraction"] > 0
    refused = httpx.post(service.url + JOBS, json=staged, headers=AUTH, timeout=120)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "parallelism.pipeline_parallel_size"


@pytest.mark.parametrize("body, param", [
    (lambda d: {"job": _job(d), "cluster": {**CLUSTER, "gpu_memory": "lots"}}, "cluster.gpu_memory"),
    (lambda d: {"job": {**_job(d), "model": f"file://{d}/missing"}, "cluster": CLUSTER}, "job.model"),
])
def test_plan_endpoint_names_the_bad_field(service, model_dir, body, param):
    response = httpx.post(service.url + PLANS, json=body(model_dir), headers=AUTH, timeout=120)
    assert response.status_code == 422 and response.json()["error"]["param"] == param, response.text


def test_submission_refuses_a_job_that_cannot_fit_the_cluster(service, model_dir):
    response = httpx.post(service.url + JOBS, json=_job(model_dir, **TOO_BIG), headers=AUTH, timeout=120)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "parallelism"
    assert "per GPU" in error["message"] and "activations" in error["message"]
    fitting = httpx.post(service.url + JOBS, json=_job(model_dir, micro_batch_size=1), headers=AUTH, timeout=120)
    assert fitting.status_code == 200, fitting.text


def test_cli_plan_prints_the_table_and_json(model_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job(model_dir, **TOO_BIG)))
    cluster = ",".join(f"{k}={v}" for k, v in CLUSTER.items())
    table = CliRunner().invoke(main, ["plan", str(job), "--cluster", cluster], terminal_width=200)
    assert table.exit_code == 0, table.output
    assert "as submitted" in table.output and "activations (saved)" in table.output and "fits" in table.output
    as_json = CliRunner().invoke(main, ["plan", str(job), "--cluster", cluster, "--json"])
    plan = json.loads(as_json.output)
    assert not plan["submitted"]["fits"] and plan["submitted"]["bytes"]["activations"] > 6e9
    bad = CliRunner().invoke(main, ["plan", str(job), "--cluster", "nodes=1"])
    assert bad.exit_code != 0 and "gpus_per_node" in bad.output


H200 = 140 * 2**30  # an H200's memory as torch and nvidia-smi (143,771 MiB) report it


@pytest.mark.parametrize("text, gib", [("140", 140), ("140G", 140), ("140GiB", 140), ("140 gib", 140),
                                       ("143771MiB", 143771 / 1024), ("141GB", 141e9 / 2**30)])
def test_gpu_memory_is_read_in_gib_as_the_device_reports_it(text, gib):
    from moetune.api.plans import ClusterSpec, parse_cluster

    cluster = parse_cluster(f"nodes=1,gpus_per_node=8,gpu_memory={text}")
    assert cluster.gpu_memory == pytest.approx(gib) and cluster.gpu_memory_bytes == pytest.approx(gib * 2**30)
    assert ClusterSpec.model_validate(cluster.model_dump()) == cluster  # what the planner child is sent


def test_the_api_and_the_cli_read_gpu_memory_alike(service, model_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job(model_dir, micro_batch_size=1)))
    response = httpx.post(service.url + PLANS, json={"job": _job(model_dir, micro_batch_size=1),
                                                     "cluster": {**CLUSTER, "gpu_memory": 140}},
                          headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["cluster"]["gpu_memory"] == H200 and response.json()["cluster"]["gpu_memory_gib"] == 140
    cli = CliRunner().invoke(main, ["plan", str(job), "--cluster", "nodes=1,gpus_per_node=2,gpu_memory=140"],
                             terminal_width=200)
    assert cli.exit_code == 0, cli.output
    assert "GPU memory: 140.00 GiB" in cli.output and "gpu_memory takes GiB" in cli.output
    bytes_as_gib = httpx.post(service.url + PLANS, json={"job": _job(model_dir), "cluster": {**CLUSTER,
                                                                                           "gpu_memory": H200}},
                              headers=AUTH, timeout=120)
    assert bytes_as_gib.status_code == 422 and bytes_as_gib.json()["error"]["param"] == "cluster.gpu_memory"


def test_cli_plan_json_is_the_whole_stdout_without_a_gpu(model_dir, tmp_path):
    """In a fresh process the training stack's import prints on stdout (DeepSpeed: "Setting accelerator to CPU")
    unless the CLI routes it to stderr."""
    import subprocess
    import sys

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job(model_dir, micro_batch_size=1)))
    done = subprocess.run([sys.executable, "-c", "from moetune.service.cli.main import main; main()", "plan",
                           str(job), "--cluster", "nodes=1,gpus_per_node=2,gpu_memory=6GB", "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout)["model"]["model_type"] == "kimi_linear"
