"""A tiny EP=2 job on the multi-node cluster (netns_cluster), as the control plane starts one (a Ray job through the
head's Jobs API), and the node faults it is put through: a worker node killed mid-step, then one cut off.
tests/cluster and bench/cluster_faults.py run the same thing. The Ray head killed needs the control plane in the
loop (it resubmits the job): `through_head_loss` runs a real one against the cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import boto3
import httpx
from ray.job_submission import JobStatus, JobSubmissionClient

from bench.support.netns_cluster import DETECTION_BOUND_S, NetnsCluster, NodeExited, cluster_network
from bench.support.receiver import ReportReceiver
from moetune.api.client import Client
from moetune.api.environment import ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_RUN_SPEC
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.models.job_run import JobRunSpec
from moetune.service.local.embedded import (control_plane_in_thread, free_port, s3_env, spawn_s3_server,
                                            stop_process, wait_http)

BUCKET = "cluster"
# each fault right after a step past a checkpoint: the restarted group runs it again (exact resume: the same loss)
STEPS, CHECKPOINT_EVERY, KILL_AFTER, CUT_AFTER = 8, 2, 3, 7
# The head goes once step HEAD_KILL_AFTER is reported; the job is longer than the others (steps take 0.1 s and are
# reported in batches): the kill lands mid-training, and the next attempt resumes from the newest checkpoint.
HEAD_KILL_AFTER, HEAD_STEPS = 3, 40
JOB_TIMEOUT_S = 600
SEED = 5
_TENANT_TOKEN = "cluster-token"


@dataclass
class ClusterStack:
    cluster: NetnsCluster
    s3_url: str
    assets: str  # s3:// base of models/tiny and data/{train,valid}.jsonl

    def s3(self):
        env = s3_env(self.s3_url)
        return boto3.client("s3", endpoint_url=self.s3_url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


def gcs_redis_available() -> bool:
    return shutil.which("redis-server") is not None


@contextmanager
def _redis(host: str, log_path: str):
    """A Redis for the head's GCS state (in memory: it outlives the head, as KubeRay's external Redis does)."""
    port = free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(["redis-server", "--bind", host, "--port", str(port), "--save", "", "--appendonly",
                                 "no", "--protected-mode", "no"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for("Redis", lambda: subprocess.run(["redis-cli", "-h", host, "-p", str(port), "ping"],
                                                 capture_output=True, text=True).stdout.strip() == "PONG", 30)
        yield f"{host}:{port}"
    finally:
        stop_process(proc)


@contextmanager
def cluster_stack(work: str, worker_nodes: int = 2, gcs_fault_tolerance: bool = False):
    """A head and `worker_nodes` worker nodes, each in its own network namespace, and their S3 server on the
    bridge address (durable in `work`) holding a tiny checkpoint and datasets; with `gcs_fault_tolerance` the
    head keeps the cluster's state in a Redis on the bridge address (needs redis-server)."""
    from moetune.workers.tiny import write_tiny_checkpoint, write_tiny_dataset

    model = write_tiny_checkpoint(os.path.join(work, "tiny"), seed=0)
    with cluster_network(worker_nodes=worker_nodes) as cluster, ExitStack() as servers:
        port = free_port()
        s3 = spawn_s3_server(port, os.path.join(work, "s3.log"), data_dir=os.path.join(work, "objects"),
                             host=cluster.host_address)
        servers.callback(stop_process, s3)
        if gcs_fault_tolerance:
            cluster.gcs_redis = servers.enter_context(_redis(cluster.host_address, os.path.join(work, "redis.log")))
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


def job_fields(stack: ClusterStack, steps: int = STEPS) -> dict:
    """The tiny job, as a user's create request."""
    return {"model": f"{stack.assets}/models/tiny", "training_file": f"{stack.assets}/data/train.jsonl",
            "validation_file": f"{stack.assets}/data/valid.jsonl",
            "lora": {"rank": 4, "alpha": 8, "train_experts": True},
            "training": {"max_steps": steps, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                         "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
            "parallelism": {"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2}}


def run_spec(stack: ClusterStack, job_id: str) -> JobRunSpec:
    return JobRunSpec(job_id=job_id, config=resolve_run_config(JobCreate.model_validate(job_fields(stack)), SEED),
                      output_uri=f"{stack.assets}/out/{job_id}")


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


def history(stack: ClusterStack, output_uri: str) -> list[dict]:
    """The job's metrics.jsonl: one record per step, across restarts."""
    key = f"{output_uri.removeprefix(f'{stack.assets}/')}/metrics.jsonl"
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



def _ray_named_down(url: str) -> bool:
    ready = httpx.get(f"{url}/readyz", timeout=30)
    return ready.status_code == 503 and "ray" in ready.json()["error"]["message"]


@contextmanager
def control_plane(stack: ClusterStack, work: str):
    """A real control plane (API and scheduler, in this process) on the bridge address, where the nodes' drivers
    report; yields its URL and a client of its one tenant."""
    from moetune.service.app import create_app
    from moetune.service.settings import Settings

    cluster, port = stack.cluster, free_port()
    os.environ.update(s3_env(stack.s3_url))  # the control plane's own storage calls (file checks, /readyz)
    settings = Settings(database_url=f"sqlite:///{work}/control-plane.db", api_tokens=f"{_TENANT_TOKEN}:cluster",
                        scheduler_enabled=True, scheduler_interval_s=0.5, ray_address=cluster.dashboard_url,
                        callback_url=f"http://{cluster.host_address}:{port}", s3_endpoint_url=stack.s3_url,
                        default_output_uri=f"{stack.assets}/out")
    with control_plane_in_thread(create_app(settings), port, host=cluster.host_address) as url:
        yield url, Client(url, _TENANT_TOKEN, timeout=30)


def through_head_loss(stack: ClusterStack, work: str) -> dict:
    """The tiny job, created through a real control plane, loses the Ray head (every process of its namespace)
    after step HEAD_KILL_AFTER; /readyz must name Ray while it is gone. The head comes back at its address; the
    worker nodes rejoin by themselves where the head keeps its state in Redis (GCS fault tolerance), else they are
    replaced. The scheduler resubmits the job, which resumes from its newest complete checkpoint. Returns the
    final job, its events, whether the worker nodes' Ray processes survived, and the seconds from the kill until
    /readyz said so and until the resumed attempt reported its resume, and the newest checkpoint at the kill."""
    cluster = stack.cluster
    with control_plane(stack, work) as (url, client):
        job_id = client.jobs.create({**job_fields(stack, HEAD_STEPS), "seed": SEED}).id
        wait_for(f"step {HEAD_KILL_AFTER}", lambda: (client.jobs.retrieve(job_id).progress.step or 0)
                 >= HEAD_KILL_AFTER, JOB_TIMEOUT_S, poll=0.1)
        raylets = {node.name: node.proc.pid for node in cluster.workers}
        cluster.kill_node(cluster.head)
        killed_at, start = time.time(), time.monotonic()
        newest = max((c.step_number for c in client.jobs.checkpoints(job_id).data), default=0)
        wait_for("/readyz to name Ray", lambda: _ray_named_down(url), DETECTION_BOUND_S)
        down_noticed_s = time.monotonic() - start
        cluster.restart_head()
        try:  # a worker node's raylet reconnects to a head that kept the cluster's state
            cluster.wait_alive({node.address for node in cluster.workers}, 60 if cluster.gcs_redis else 5)
            workers_kept = all(node.proc.poll() is None and node.proc.pid == raylets[node.name]
                               for node in cluster.workers)
        except (TimeoutError, NodeExited):
            workers_kept = False
        if not workers_kept:
            for node in cluster.workers:
                cluster.replace_node(node)
        wait_for("/readyz", lambda: httpx.get(f"{url}/readyz", timeout=30).status_code == 200, 60)
        job = client.jobs.wait(job_id, JOB_TIMEOUT_S, poll_interval=1)
        events = client.jobs.events_since(job_id)
    resumed = [e for e in events if e.message.startswith("Resumed from checkpoint")]
    return {"job": job, "events": events, "newest_checkpoint": newest, "workers_kept": workers_kept,
            "down_noticed_s": down_noticed_s,
            "resumed_s": resumed[-1].created_at - killed_at if resumed else None}


def _requeued_at(events: list) -> int:
    return next(i for i, e in enumerate(events) if e.message.startswith("Job requeued"))


def repeated_losses_match(events: list, tolerance: float) -> bool:
    """Every step the resumed attempt ran again (it started after the requeue) gave the loss it gave before."""
    requeue = _requeued_at(events)
    before = {e.data["step"]: e.data["train_loss"] for e in events[:requeue] if e.type == "metrics"}
    again = [(e.data["step"], e.data["train_loss"]) for e in events[requeue:] if e.type == "metrics"]
    return all(abs(loss - before[step]) <= tolerance for step, loss in again if step in before)


def waits_after_requeue(events: list) -> list[str]:
    """The messages the requeued job got before it started again: what it waited for (Ray's resource report
    lags the nodes rejoining a restarted head)."""
    requeue = _requeued_at(events)
    start = next((i for i in range(requeue, len(events)) if events[i].message == "Job started"), len(events))
    return [e.message for e in events[requeue + 1:start] if e.type == "message"]
