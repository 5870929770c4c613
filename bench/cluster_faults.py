"""Faults on a real multi-node Ray cluster on this machine, and on a control plane of two replicas: the cluster part
is a head and two worker nodes, each in its own network namespace (bench.support.netns_cluster; needs root). A tiny
EP=2 job (one worker per worker node) runs once uninterrupted, then once through a worker node killed mid-step and
then a worker node cut off (bench.support.cluster_job.through_node_faults, what tests/cluster runs), then once through
a real control plane that loses the Ray head mid-step (bench.support.cluster_job.through_head_loss). Where
redis-server is installed the head keeps its state in Redis (Ray's GCS fault tolerance, as the Helm chart runs it),
so the run also says whether the worker nodes survive a head restart. A fault counts as recovered when the job
noticed it within the stated bound, resumed from a complete checkpoint and ended with the uninterrupted run's
losses, step for step.

The control-plane part runs first, on loopback (no namespaces; a real PostgreSQL, run as the `postgres` user when
root: bench.support.postgres), as tests/service/test_replicas.py and tests/service/test_webhooks.py do:
- leader takeover: two `moetune server` replicas on one database and a recording stand-in for the Ray Jobs API
  (bench.support.replicas, bench.support.ray_jobs_api); jobs are queued through the standby, the leader is killed
  (SIGKILL) once it submitted one of them, while a client keeps calling the standby. `leader_takeover_s` is the time
  from the kill until the standby leads; a job never submitted counts in `jobs_lost`, one submitted more than once
  (refused repeats included) in `duplicate_submissions`; `switch_requests_failed` counts the calls to the standby
  answered other than 200 or a 503 with Retry-After. Throughout the switch the first submitted job's Reporter (the
  workers' outbox) reports a step every STEP_S through one address in front of both replicas (ServiceAddress, as a
  Kubernetes Service is); its lost events count in `events_lost`.
- webhook delivery: an in-process control plane on its own database, one webhook endpoint on a real receiver that
  verifies each delivery with the `openai` SDK and refuses each event's first 3 tries (bench.support.webhook_receiver);
  jobs are created and cancelled (one `fine_tuning.job.cancelled` event each); once every event was tried (and
  refused) once the control plane is stopped and a new one started on the same database, which has to finish the
  deliveries from the outbox. `webhook_lost` counts the events never accepted plus every acceptance past the first
  of a job's event.
- worker reports through an outage: an in-process control plane on its own database and a job's Reporter (the
  workers' outbox, workers/reporting/outbox.py) reporting a step every STEP_S; the control plane is stopped for
  REPORT_OUTAGE_S (60 s) and a new one started on the same database and port. `events_lost` counts the steps whose
  event is not stored exactly once, plus one for any stored out of order, here and through the takeover.

    sudo python bench/cluster_faults.py
    python bench/cluster_faults.py --control-plane-only   # the control-plane part alone: no root, about 2 minutes

Ends with `RESULT nodes=<n> node_loss_recovered=<bool> head_loss_recovered=<bool> head_loss_workers_kept=<bool>
head_loss_resume_s=<s> partition_recovered=<bool> leader_takeover_s=<s> jobs_lost=<n> duplicate_submissions=<n>
switch_requests_failed=<n> webhook_lost=<n> events_lost=<n>`: `jobs_lost` and `duplicate_submissions` add the
cluster part's jobs (its driver submissions and the head-loss job) to the takeover's; with --control-plane-only the
cluster keys are `not_run` and those two count the takeover's jobs alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import boto3
from ray.job_submission import JobStatus

from bench.support import waiting
from bench.support.cluster_job import (HEAD_STEPS, JOB_TIMEOUT_S, cluster_stack, ended, gcs_redis_available,
                                       history, messages, repeated_losses_match, run_spec, submit, through_head_loss,
                                       through_node_faults, wait_for, waits_after_requeue)
from bench.support.netns_cluster import DETECTION_BOUND_S, netns_permitted
from bench.support.postgres import fresh_database, postgres_bin, running_postgres
from bench.support.receiver import ReportReceiver
from bench.support.replicas import LEASE_S, RENEW_S, ServiceAddress, all_running, replica_set, stub_inputs, takeover
from bench.support.webhook_receiver import Route, receiving
from moetune.api.client import Client
from moetune.api.environment import ENV_JOB_TOKEN
from moetune.api.models.job_run import ResultReport
from moetune.api.models.responses import JobStatus as Status
from moetune.service.app import create_app
from moetune.service.cluster.scheduler import submission_id
from moetune.service.local.embedded import control_plane_in_thread, free_port, local_s3_server, s3_env
from moetune.service.auth import hash_token, new_job_token
from moetune.service.settings import Settings
from moetune.service.store import Store
from moetune.workers.reporting.reporter import Reporter

LOSS_TOLERANCE = 1e-5
TENANT, TOKEN = "bench", "bench-token"
INPUTS, OUTPUTS = "inputs", "outputs"
TAKEOVER_JOBS = 8  # queued through the standby before the leader is killed (the test queues 6)
WEBHOOK_JOBS, WEBHOOK_FAIL_FIRST = 20, 3
# Slower retries than the test's, so that the restart lands between each event's refused tries (about 0.25-0.5 s,
# 0.5-1 s and 1-2 s after the first): the second control plane has every delivery still to finish.
WEBHOOK_RETRIES = {"webhook_retry_base_s": 0.5, "webhook_retry_max_s": 2.0, "webhook_poll_interval_s": 0.05}
NOT_RUN = "not_run"
REPORT_OUTAGE_S, STEP_S = 60.0, 0.1  # the outage: the Reporter's backoff reaches its 30 s cap


def _same_losses(got: list[dict], want: list[dict]) -> bool:
    return [r["step"] for r in got] == [r["step"] for r in want] and all(
        abs(a["train_loss"] - b["train_loss"]) <= LOSS_TOLERANCE for a, b in zip(got, want))


class _StepReports:
    """A job's Reporter reporting one step's metrics every STEP_S, as a training loop does."""

    def __init__(self, reporter: Reporter):
        self.reporter, self.step = reporter, 0

    def report(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP_S)):
            self._next()

    def until(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._next()

    def _next(self) -> None:
        self.step += 1
        self.reporter.metrics(self.step, train_loss=1.0 / self.step)
        time.sleep(STEP_S)

    def lost(self, events) -> int:
        """Steps whose event is not stored exactly once, plus one if any is stored out of order."""
        stored = [e.data["step"] for e in events if e.type == "metrics"]
        once = Counter(stored)
        return sum(once[s] != 1 for s in range(1, self.step + 1)) + (stored != sorted(stored))


def _leader_takeover(database_url: str, s3_url: str, inputs: dict, log_dir: Path) -> dict:
    """Two replicas; the leader killed mid-queue while a client calls the standby (tests/service/test_replicas.py's
    second switch), and while the first submitted job's Reporter reports a step every STEP_S through one address in
    front of both replicas (what MOETUNE_CALLBACK_URL names where replicas run: their Service)."""
    with replica_set(database_url, s3_url, f"s3://{OUTPUTS}/runs", f"{TOKEN}:{TENANT}", TOKEN, log_dir) as (
            start, ray_api):
        leader = start()
        waiting.wait_for(leader.leads, 10, "the first replica to take the scheduler lease", interval=0.1)
        standby = start()
        queued = [standby.create_job(inputs) for _ in range(TAKEOVER_JOBS)]  # through the standby: both serve the API
        jobs, answers = list(queued), []  # the client's creates during the switch join `jobs`
        waiting.wait_for(lambda: any(ray_api.submitters(submission_id(j, 1)) for j in queued), 30,
                         "the leader's first submission", interval=0.05)
        reported = next(j for j in queued if ray_api.submitters(submission_id(j, 1)))
        address = ServiceAddress([leader, standby])
        steps = _StepReports(Reporter(reported, address.url, ray_api.env_vars[submission_id(reported, 1)][
            ENV_JOB_TOKEN], directory=str(log_dir / "takeover-outbox")))
        stop = threading.Event()
        reporting = threading.Thread(target=steps.until, args=(stop,))
        reporting.start()
        takeover_s = None
        try:
            takeover_s = takeover(ray_api, leader, signal.SIGKILL, standby, jobs, inputs, answers)
            waiting.wait_for(lambda: all_running(standby, jobs), 30, "every job to run")
        except AssertionError as timed_out:  # counted below: the jobs not submitted are lost
            print(f"leader takeover: {timed_out}")
        finally:
            stop.set()
            reporting.join()
        delivered = steps.reporter.send(ResultReport(status="succeeded", fine_tuned_model=f"s3://{OUTPUTS}/adapter"))
        address.close()
        submitters = {j: ray_api.submitters(submission_id(j, 1)) for j in jobs}
    events, _ = Store(database_url).list_events(reported, 10 * steps.step)
    events_lost = steps.lost(events)
    lost = sum(not by for by in submitters.values())
    duplicated = sum(len(by) > 1 for by in submitters.values())
    failed = [(status, retry) for status, retry in answers if not (status == 200 or (status == 503 and retry))]
    mid_queue = {by[0] for j, by in submitters.items() if by and j in queued} == {leader.url, standby.url}
    took = f"{takeover_s:.2f}s" if takeover_s is not None else "never (15 s bound)"
    print(f"leader takeover (lease {LEASE_S:.1f}s, renewed every {RENEW_S:.1f}s): the leader killed (SIGKILL) "
          f"{'mid-queue (both replicas submitted queued jobs)' if mid_queue else 'NOT mid-queue'}; the standby led "
          f"{took} later; {len(submitters)} jobs: {lost} never submitted, {duplicated} submitted more than once; "
          f"{len(answers)} calls to the standby during the switch, {len(failed)} answered other than 200 or a "
          f"retryable 503{f' {Counter(failed)}' if failed else ''}; a running job's {steps.step} steps reported "
          f"through the switch: {steps.step - events_lost} stored exactly once, in order, the result delivered "
          f"{delivered}")
    return {"leader_takeover_s": f"{takeover_s:.2f}" if takeover_s is not None else "none", "jobs_lost": lost,
            "duplicate_submissions": duplicated, "switch_requests_failed": len(failed),
            "takeover_events_lost": events_lost}


def _webhook_delivery(database_url: str, s3_url: str, inputs: dict) -> dict:
    """Cancelled jobs' events delivered to a receiver that refuses each event's first tries, across a control-plane
    restart (tests/service/test_webhooks.py's first and last tests in one)."""
    settings = Settings(database_url=database_url, api_tokens=f"{TOKEN}:{TENANT}", scheduler_enabled=False,
                        default_output_uri=f"s3://{OUTPUTS}/runs", s3_endpoint_url=s3_url, **WEBHOOK_RETRIES)
    route = Route(fail_first=WEBHOOK_FAIL_FIRST)
    with receiving() as receiver:
        receiver.routes["/hook"] = route
        with control_plane_in_thread(create_app(settings), free_port()) as url:
            client = Client(url, TOKEN, timeout=10)
            route.secret = client.webhooks.create(receiver.url + "/hook").signing_secret
            jobs = [client.jobs.create(inputs).id for _ in range(WEBHOOK_JOBS)]
            started = time.monotonic()
            for job_id in jobs:
                client.jobs.cancel(job_id)
            with receiver.changed:  # every event tried once: the control plane stops between refused tries
                receiver.changed.wait_for(lambda: len(route.tries) >= len(jobs), 30)
        accepted_before = len(route.accepted)
        with control_plane_in_thread(create_app(settings), free_port()):
            with receiver.changed:
                receiver.changed.wait_for(lambda: len(route.accepted) >= len(jobs), 60)
            delivered_s = time.monotonic() - started
            time.sleep(2 * WEBHOOK_RETRIES["webhook_retry_max_s"])  # a repeat would have come by now
    per_job = Counter(e["data"]["id"] for events in route.accepted.values() for e in events
                      if e["type"] == "fine_tuning.job.cancelled")
    lost = sum(abs(per_job[j] - 1) for j in jobs)  # never accepted, or accepted again
    print(f"webhooks: {len(jobs)} cancelled jobs' events, each refused {WEBHOOK_FAIL_FIRST} times, the control plane "
          f"restarted after every event's first try ({accepted_before} accepted before it): "
          f"{sum(per_job[j] == 1 for j in jobs)} accepted exactly once, {len(route.accepted)} event ids accepted, "
          f"the last {delivered_s:.1f}s after the first cancel; tries per event {dict(Counter(route.tries.values()))}; "
          f"deliveries failing the openai SDK's verification: {route.forged}")
    return {"webhook_lost": lost}


def _report_outage(database_url: str, s3_url: str, inputs: dict, work: str) -> dict:
    """A job's step events reported before, during and after a control-plane outage."""
    settings = Settings(database_url=database_url, api_tokens=f"{TOKEN}:{TENANT}", scheduler_enabled=False,
                        default_output_uri=f"s3://{OUTPUTS}/runs", s3_endpoint_url=s3_url)
    port = free_port()
    app = create_app(settings)
    with control_plane_in_thread(app, port) as url:
        job_id = Client(url, TOKEN, timeout=10).jobs.create(inputs).id
        token, store = new_job_token(), app.state.store  # what the scheduler does around a Ray submission
        store.transition(job_id, [Status.validating_files], Status.queued, "Job queued")
        store.update_job(job_id, job_token_hash=hash_token(token))
        store.transition(job_id, [Status.queued], Status.running, "Job started")
        steps = _StepReports(Reporter(job_id, url, token, directory=os.path.join(work, "outbox")))
        steps.report(2.0)
    steps.report(REPORT_OUTAGE_S)
    app = create_app(settings)
    with control_plane_in_thread(app, port):
        back = time.monotonic()
        steps.report(2.0)
        delivered = steps.reporter.send(ResultReport(status="succeeded", fine_tuned_model=f"s3://{OUTPUTS}/adapter"))
        caught_up_s = time.monotonic() - back
        events, _ = app.state.store.list_events(job_id, 10 * steps.step)
    lost = steps.lost(events)
    print(f"worker reports: {steps.step} steps' events, the control plane stopped for {REPORT_OUTAGE_S:.0f}s after "
          f"the first 2 s; {steps.step - lost} stored exactly once, in order; the result delivered {delivered}, "
          f"{caught_up_s:.1f}s after the control plane came back")
    return {"events_lost": lost}


def _control_plane_faults(work: str) -> dict:
    with local_s3_server() as s3_url, running_postgres() as postgres, \
            patch.dict(os.environ, s3_env(s3_url)):  # boto3's keys, here and in the in-process control plane
        s3 = boto3.client("s3", endpoint_url=s3_url)
        for bucket in (INPUTS, OUTPUTS):
            s3.create_bucket(Bucket=bucket)
        inputs = stub_inputs(s3_url, INPUTS)
        return {**_leader_takeover(fresh_database(postgres), s3_url, inputs, Path(work)),
                **_webhook_delivery(fresh_database(postgres), s3_url, inputs),
                **_report_outage(fresh_database(postgres), s3_url, inputs, work)}


def _cluster_faults(work: str) -> dict:
    fault_tolerant = gcs_redis_available()
    with cluster_stack(work, gcs_fault_tolerance=fault_tolerant) as stack:
        receivers = [ReportReceiver(host=stack.cluster.host_address) for _ in range(2)]
        reference, faulted = run_spec(stack, "ftjob-reference"), run_spec(stack, "ftjob-faults")
        jobs, sid = submit(stack, reference, receivers[0])
        reference_ok = wait_for("the reference job", lambda: ended(jobs, sid), JOB_TIMEOUT_S) == JobStatus.SUCCEEDED
        want = history(stack, reference.output_uri)
        jobs, sid = submit(stack, faulted, receivers[1])
        outcome = through_node_faults(stack, receivers[1], jobs, sid)
        for receiver in receivers:
            receiver.server.shutdown()
        resumes = [e.data["step"] for e in messages(receivers[1], "Resumed from checkpoint")]
        same = reference_ok and outcome["status"] == JobStatus.SUCCEEDED and _same_losses(
            history(stack, faulted.output_uri), want)
        # the two driver submissions before the head went (a head without Redis forgets them)
        direct = [j for j in jobs.list_jobs() if j.entrypoint.endswith("moetune.workers.entry.driver")]
        direct_lost = sum(ended(jobs, j.submission_id) != JobStatus.SUCCEEDED for j in direct)

        head = through_head_loss(stack, work)
        job, events = head["job"], head["events"]
        head_resumes = [e.data["step"] for e in events if e.message.startswith("Resumed from checkpoint")]
        started = [e for e in events if e.message == "Job started"]
        # a longer job than the reference: its own steps before the kill are the reference of the ones run again
        head_same = job.status == "succeeded" and repeated_losses_match(events, LOSS_TOLERANCE) and [
            r["step"] for r in history(stack, job.output_uri)] == list(range(1, HEAD_STEPS + 1))
        # at most one checkpoint interval lost: one resume, from a checkpoint no older than the newest at the kill (the
        # old attempt's workers, on the worker nodes, may save more before their nodes go: a complete one counts)
        head_ok = head_same and len(head_resumes) == 1 and head_resumes[0] >= head["newest_checkpoint"]
        print(f"reference succeeded: {reference_ok}; faulted run resumed from steps {resumes}; node loss noticed "
              f"in {outcome['kill_noticed_s']:.1f}s, cut-off node in {outcome['cut_noticed_s']:.1f}s "
              f"(bound {DETECTION_BOUND_S:.0f}s); same losses as the reference: {same}")
        resumed_s = f"{head['resumed_s']:.0f}" if head["resumed_s"] is not None else "none"
        print(f"head loss ({'GCS in Redis' if fault_tolerant else 'no GCS fault tolerance'}) with step-"
              f"{head['newest_checkpoint']} the newest checkpoint: /readyz named Ray "
              f"{head['down_noticed_s']:.1f}s after the kill; worker nodes kept: {head['workers_kept']}; job "
              f"{job.status}, started {len(started)} times, resumed from steps {head_resumes} "
              f"{resumed_s}s after the kill; the steps run again gave the same losses: {head_same}")
        print(f"between the requeue and the next start: {waits_after_requeue(events)}")
        return {"nodes": len(stack.cluster.nodes), "node_loss_recovered": same and len(resumes) >= 1,
                "head_loss_recovered": head_ok, "head_loss_workers_kept": head["workers_kept"],
                "head_loss_resume_s": resumed_s, "partition_recovered": same and len(resumes) == 2,
                "jobs_lost": direct_lost + (job.status != "succeeded"),
                "duplicate_submissions": len(direct) - 2 + len(started) - 2}


CLUSTER_KEYS = ("nodes", "node_loss_recovered", "head_loss_recovered", "head_loss_workers_kept", "head_loss_resume_s",
                "partition_recovered")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control-plane-only", action="store_true",
                        help="only the leader takeover, webhook delivery and reports through an outage (no root, "
                             "namespaces or Ray cluster); the cluster keys print as not_run")
    args = parser.parse_args()
    # a SIGTERM (a timeout) unwinds like an error: the namespaces, nodes and servers go with the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.control_plane_only and (reason := netns_permitted()):
        print(f"cannot build the cluster: {reason}", file=sys.stderr)
        return 2
    if postgres_bin() is None:
        print("cannot run the control-plane replicas: PostgreSQL server binaries are not installed (Debian package "
              "postgresql)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="moetune-cluster-faults-") as work:
        control = _control_plane_faults(work)
        cluster = dict.fromkeys(CLUSTER_KEYS, NOT_RUN) | {"jobs_lost": 0, "duplicate_submissions": 0}
        if not args.control_plane_only:
            cluster = _cluster_faults(work)
    result = {**{key: cluster[key] for key in CLUSTER_KEYS}, "leader_takeover_s": control["leader_takeover_s"],
              "jobs_lost": cluster["jobs_lost"] + control["jobs_lost"],
              "duplicate_submissions": cluster["duplicate_submissions"] + control["duplicate_submissions"],
              "switch_requests_failed": control["switch_requests_failed"], "webhook_lost": control["webhook_lost"],
              "events_lost": control["events_lost"] + control["takeover_events_lost"]}
    print("RESULT " + " ".join(f"{key}={value}" for key, value in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
