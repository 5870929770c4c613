"""A tiny EP=2 job on the multi-node cluster (netns_cluster), as the control plane starts one (a Ray job through the
head's Jobs API), and the node faults it is put through: a worker node killed mid-step, then one cut off.
tests/cluster and bench/cluster_faults.py run the same thing."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import boto3
from ray.job_submission import JobStatus, JobSubmissionClient

from bench.support.netns_cluster import DETECTION_BOUND_S, NetnsCluster, cluster_network
from bench.support.receiver import ReportReceiver
from moetune.api.environment import ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_RUN_SPEC
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.service.local.embedded import free_port, s3_env, spawn_s3_server, stop_process

BUCKET = "cluster"
# each fault right after a step past a checkpoint: the restarted group runs it again (exact resume: the same loss)
STEPS, CHECKPOINT_EVERY, KILL_AFTER, CUT_AFTER = 8, 2, 3, 7
JOB_TIMEOUT_S = 600


@dataclass
class ClusterStack:
    cluster: NetnsCluster
    s3_url: str
    assets: str  # s3:// base of models/tiny and data/{train,valid}.jsonl

    def s3(self):
        env = s3_env(self.s3_url)
        return boto3.client("s3", endpoint_url=self.s3_url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


@contextmanager
def cluster_stack(work: str, worker_nodes: int = 2):
    """A head and `worker_nodes` worker nodes, each in its own network namespace, and their S3 server on the
    bridge address (durable in `work`) holding a tiny checkpoint and datasets."""
    from moetune.workers.tiny import write_tiny_checkpoint, write_tiny_dataset

    model = write_tiny_checkpoint(os.path.join(work, "tiny"), seed=0)
    with cluster_network(worker_nodes=worker_nodes) as cluster:
        port = free_port()
        s3 = spawn_s3_server(port, os.path.join(work, "s3.log"), data_dir=os.path.join(work, "objects"),
                             host=cluster.host_address)
        try:
            stack = ClusterStack(cluster, f"http://{cluster.host_address}:{port}", f"s3://{BUCKET}")
            client = stack.s3()
            client.create_bucket(Bucket=BUCKET)
            for name in os.listdir(model):
                client.upload_file(os.path.join(model, name), BUCKET, f"models/tiny/{name}")
            for name, rows, seed in (("train.jsonl", 160, 0), ("valid.jsonl", 16, 1)):
                write_tiny_dataset(os.path.join(work, name), rows, seed)
                client.upload_file(os.path.join(work, name), BUCKET, f"data/{name}")
            cluster.start(s3_env(stack.s3_url))
            yield stack
        finally:
            stop_process(s3)


def run_spec(stack: ClusterStack, job_id: str) -> JobRunSpec:
    spec = JobCreate(model=f"{stack.assets}/models/tiny", training_file=f"{stack.assets}/data/train.jsonl",
                     validation_file=f"{stack.assets}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    return JobRunSpec(job_id=job_id, spec=spec, seed=5, output_uri=f"{stack.assets}/out/{job_id}")


def submit(stack: ClusterStack, run: JobRunSpec, receiver: ReportReceiver) -> tuple[JobSubmissionClient, str]:
    """The driver as the control plane starts it: a Ray job through the head's Jobs API, reporting to
    `receiver`."""
    jobs = JobSubmissionClient(stack.cluster.dashboard_url)
    env = {ENV_RUN_SPEC: run.model_dump_json(), ENV_CALLBACK_URL: receiver.url, ENV_JOB_TOKEN: "tok",
           "HF_HUB_OFFLINE": "1"}
    return jobs, jobs.submit_job(entrypoint=f"{sys.executable} -m moetune.workers.entry.driver",
                                 runtime_env={"env_vars": env})


def wait_for(what: str, predicate, timeout: float, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
    return value


def ended(jobs: JobSubmissionClient, sid: str) -> JobStatus | None:
    status = jobs.get_job_status(sid)
    return status if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None


def history(stack: ClusterStack, run: JobRunSpec) -> list[dict]:
    """The job's metrics.jsonl: one record per step, across restarts."""
    key = f"{run.output_uri.removeprefix(f'{stack.assets}/')}/metrics.jsonl"
    body = stack.s3().get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines()]


def messages(receiver: ReportReceiver, prefix: str) -> list:
    return [e for e in receiver.of_kind("event") if e.type == "message" and e.message.startswith(prefix)]


def through_node_faults(stack: ClusterStack, receiver: ReportReceiver, jobs: JobSubmissionClient, sid: str) -> dict:
    """Puts the running job through (1) worker node 2 killed after step KILL_AFTER, left waiting for capacity
    until a fresh node takes its place, then (2) worker node 1 cut off after step CUT_AFTER of the resumed run,
    replaced once noticed; returns the job's final Ray status and the seconds until each fault was noticed.
    Raises TimeoutError if a fault is not noticed within DETECTION_BOUND_S (a hang on a dead peer)."""
    cluster = stack.cluster

    def reached(step: int, after: int = 0):
        return lambda: any(m["step"] >= step for m in receiver.metrics()[after:])

    def failures(n: int):
        return lambda: len(messages(receiver, "Worker failure")) >= n

    wait_for(f"step {KILL_AFTER}", reached(KILL_AFTER), JOB_TIMEOUT_S)
    killed = cluster.workers[1]
    assert cluster.kill_node(killed) > 0
    start = time.monotonic()
    wait_for("the node loss's failure event", failures(1), DETECTION_BOUND_S)
    kill_noticed_s = time.monotonic() - start
    cluster.wait_dead(killed.address, DETECTION_BOUND_S)
    cluster.replace_node(killed)  # capacity returns: the job had waited for it
    wait_for("a resume after the node loss", lambda: messages(receiver, "Resumed from checkpoint"), 180)

    seen = len(receiver.metrics())
    wait_for(f"step {CUT_AFTER} after the resume", reached(CUT_AFTER, after=seen), JOB_TIMEOUT_S)
    cut = cluster.workers[0]
    cluster.cut(cut)
    try:
        start = time.monotonic()
        wait_for("the cut-off node's failure event", failures(2), DETECTION_BOUND_S)
        cut_noticed_s = time.monotonic() - start
    finally:
        cluster.replace_node(cut)
    status = wait_for("the job", lambda: ended(jobs, sid), JOB_TIMEOUT_S, poll=0.5)
    return {"status": status, "kill_noticed_s": kill_noticed_s, "cut_noticed_s": cut_noticed_s}

