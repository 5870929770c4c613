"""Faults on a real multi-node Ray cluster on this machine: a head and two worker nodes, each in its own network
namespace (bench.support.netns_cluster; needs root). A tiny EP=2 job (one worker per worker node) runs once
uninterrupted, then once through a worker node killed mid-step and then a worker node cut off
(bench.support.cluster_job.through_node_faults, what tests/cluster runs), then once through a real control plane
that loses the Ray head mid-step (bench.support.cluster_job.through_head_loss). Where redis-server is installed
the head keeps its state in Redis (Ray's GCS fault tolerance, as the Helm chart runs it), so the run also says
whether the worker nodes survive a head restart. A fault counts as recovered when the job noticed it within the
stated bound, resumed from a complete checkpoint and ended with the uninterrupted run's losses, step for step.

    sudo python bench/cluster_faults.py

Ends with `RESULT nodes=<n> node_loss_recovered=<bool> head_loss_recovered=<bool> head_loss_workers_kept=<bool>
head_loss_resume_s=<s> partition_recovered=<bool> leader_takeover_s=… jobs_lost=<n> duplicate_submissions=<n>
webhook_lost=…`. The control-plane leader takeover and webhook delivery are measured by
tests/service/test_replicas.py and tests/service/test_webhooks.py (their RESULT lines).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

from ray.job_submission import JobStatus

from bench.support.cluster_job import (HEAD_STEPS, JOB_TIMEOUT_S, cluster_stack, ended, gcs_redis_available,
                                       history, messages, repeated_losses_match, run_spec, submit, through_head_loss,
                                       through_node_faults, wait_for, waits_after_requeue)
from bench.support.netns_cluster import DETECTION_BOUND_S, netns_permitted
from bench.support.receiver import ReportReceiver

LOSS_TOLERANCE = 1e-5


def _same_losses(got: list[dict], want: list[dict]) -> bool:
    return [r["step"] for r in got] == [r["step"] for r in want] and all(
        abs(a["train_loss"] - b["train_loss"]) <= LOSS_TOLERANCE for a, b in zip(got, want))


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    # a SIGTERM (a timeout) unwinds like an error: the namespaces, nodes and servers go with the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if reason := netns_permitted():
        print(f"cannot build the cluster: {reason}", file=sys.stderr)
        return 2
    fault_tolerant = gcs_redis_available()
    with tempfile.TemporaryDirectory(prefix="moetune-cluster-faults-") as work, \
            cluster_stack(work, gcs_fault_tolerance=fault_tolerant) as stack:
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
        print(f"head loss ({'GCS in Redis' if fault_tolerant else 'no GCS fault tolerance'}) with step-"
              f"{head['newest_checkpoint']} the newest checkpoint: /readyz named Ray "
              f"{head['down_noticed_s']:.1f}s after the kill; worker nodes kept: {head['workers_kept']}; job "
              f"{job.status}, started {len(started)} times, resumed from steps {head_resumes} "
              f"{head['resumed_s']}s after the kill; the steps run again gave the same losses: {head_same}")
        print(f"between the requeue and the next start: {waits_after_requeue(events)}")
        resumed_s = f"{head['resumed_s']:.0f}" if head["resumed_s"] is not None else "none"
        print(f"RESULT nodes={len(stack.cluster.nodes)} node_loss_recovered={same and len(resumes) >= 1} "
              f"head_loss_recovered={head_ok} head_loss_workers_kept={head['workers_kept']} "
              f"head_loss_resume_s={resumed_s} partition_recovered={same and len(resumes) == 2} "
              f"leader_takeover_s=not_measured(see_tests/service/test_replicas.py) "
              f"jobs_lost={direct_lost + (job.status != 'succeeded')} "
              f"duplicate_submissions={len(direct) - 2 + len(started) - 2} "
              "webhook_lost=not_measured(see_tests/service/test_webhooks.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
