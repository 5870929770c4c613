"""On the multi-node cluster (tests/cluster/conftest.py): one tiny EP=2 job whose two workers sit on the two worker
nodes (its expert-parallel group crosses the node boundary) runs through a worker node killed mid-step (every
process of its namespace) and then a worker node cut off (its link down, its processes alive:
bench.support.cluster_job.through_node_faults). It resumes from its newest complete checkpoint each time; every
step a restarted group runs again gives the loss it gave before the fault (bench/cluster_faults.py also compares
the whole run with an uninterrupted one)."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from ray.job_submission import JobStatus

from bench.support.cluster_job import (CHECKPOINT_EVERY, CUT_AFTER, KILL_AFTER, STEPS, history, messages, run_spec,
                                       submit, through_node_faults)
from bench.support.netns_cluster import DETECTION_BOUND_S, NIC
from bench.support.receiver import ReportReceiver

pytestmark = pytest.mark.ray_job
JOB_ID = "ftjob-faults"


def _node_series(address: str) -> str | None:
    """A worker node's exporter page, once it carries the node's series."""
    try:
        text = httpx.get(f"http://{address}:9470/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    return text if "moetune_node_network_sent_bytes_total{" in text else None


def _cache_bytes(node) -> int:
    folder = os.path.join(node.temp_dir, "moetune", "weights-cache")
    return sum(os.path.getsize(os.path.join(parent, name)) for parent, _, names in os.walk(folder)
               for name in names if not name.startswith("."))


@pytest.fixture(scope="module")
def faulted(netns_stack):
    """The job through both faults: its outcome, history and reports, and each worker node's exporter page seen
    while it ran."""
    receiver = ReportReceiver(host=netns_stack.cluster.host_address)
    run = run_spec(netns_stack, JOB_ID)
    pages, done = {}, threading.Event()

    def watch_pages():
        while not done.wait(0.5) and len(pages) < len(netns_stack.cluster.workers):
            for node in netns_stack.cluster.workers:
                if node.address not in pages and (page := _node_series(node.address)):
                    pages[node.address] = page

    watcher = threading.Thread(target=watch_pages, daemon=True)
    watcher.start()
    jobs, sid = submit(netns_stack, run, receiver)
    try:
        outcome = through_node_faults(netns_stack, receiver, jobs, sid)
    finally:
        done.set()
        receiver.server.shutdown()
    assert outcome["status"] == JobStatus.SUCCEEDED, jobs.get_job_logs(sid)[-3000:]
    watcher.join()
    return {**outcome, "pages": pages, "receiver": receiver, "history": history(netns_stack, run.output_uri)}


def test_a_job_spreads_over_nodes_with_node_caches_and_node_metrics(netns_stack, faulted):
    cluster = netns_stack.cluster
    # Each worker node served its own node series: its hostname, its address, its NIC's bytes (not loopback's).
    assert sorted(faulted["pages"]) == sorted(n.address for n in cluster.workers)
    for node in cluster.workers:
        page = faulted["pages"][node.address]
        labels = f'address="{node.address}",device="{NIC}",job_id="{JOB_ID}",node="{node.name}"'
        sent = next(line for line in page.splitlines() if line.startswith("moetune_node_network_sent_bytes_total{")
                    and labels in line)
        assert float(sent.rsplit(" ", 1)[1]) > 0
    # Each worker node streamed its rank's share into its own node-local cache; the head (no workers) none.
    cached = {node.name: _cache_bytes(node) for node in cluster.nodes}
    assert cached["head"] == 0 and all(cached[n.name] > 0 for n in cluster.workers), cached
    print(f"node caches: {cached}")


def test_a_job_survives_a_killed_node_then_a_cut_off_node_with_exact_resumes(faulted):
    assert max(faulted["kill_noticed_s"], faulted["cut_noticed_s"]) < DETECTION_BOUND_S
    receiver = faulted["receiver"]
    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    first, second = messages(receiver, "Worker failure")
    assert "restarting the worker group from the newest complete checkpoint" in first.message
    resumes = messages(receiver, "Resumed from checkpoint")
    assert len(resumes) == 2 and all(e.message.endswith("after a worker failure") for e in resumes)
    resumed = [e.data["step"] for e in resumes]
    assert all(step % CHECKPOINT_EVERY == 0 for step in resumed)
    # Exact resume: each fault came after a step past a checkpoint, which the restarted group ran again with the
    # same loss; the history holds every step once, with the losses of the group that finished it.
    runs = receiver.metric_runs()
    assert len(runs) == 3 and [m["step"] for m in runs[-1]] == list(range(resumed[1] + 1, STEPS + 1))
    repeated = receiver.repeated_steps()
    assert {KILL_AFTER, CUT_AFTER} <= {once["step"] for once, _ in repeated}
    for once, again in repeated:
        assert again["train_loss"] == pytest.approx(once["train_loss"], abs=1e-5), once["step"]
    assert [r["step"] for r in faulted["history"]] == list(range(1, STEPS + 1))
    last_seen = {m["step"]: m["train_loss"] for run in runs for m in run}
    assert all(r["train_loss"] == pytest.approx(last_seen[r["step"]], abs=1e-6) for r in faulted["history"])
    print(f"resumed from {resumed}; node loss noticed in {faulted['kill_noticed_s']:.1f}s, cut-off node in "
          f"{faulted['cut_noticed_s']:.1f}s")
