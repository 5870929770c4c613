"""On the multi-node cluster (tests/cluster/conftest.py): the Ray head killed, every process of its namespace, under
a tiny EP=2 job that a real control plane runs (bench.support.cluster_job.through_head_loss). /readyz names Ray
while the head is gone; once it is back (and its worker nodes, which a head without Redis does not keep, are
replaced), the scheduler resubmits the job once, and the new attempt resumes from its newest complete checkpoint,
no older than the newest at the kill, and runs every step again with the loss it gave before."""

from __future__ import annotations

import pytest

from bench.support.cluster_job import HEAD_STEPS, history, repeated_losses_match, through_head_loss
from moetune.service.local.embedded import s3_env

pytestmark = pytest.mark.ray_job


def test_a_killed_head_is_named_on_readyz_and_the_job_resumes_once_from_its_last_checkpoint(
        netns_stack, tmp_path, monkeypatch):
    for name, value in s3_env(netns_stack.s3_url).items():  # the control plane's storage calls; restored after
        monkeypatch.setenv(name, value)
    head = through_head_loss(netns_stack, str(tmp_path))  # raises when /readyz does not name Ray in time
    job, events = head["job"], head["events"]
    assert job.status == "succeeded", [e.message for e in events][-12:]
    assert [e.message for e in events].count("Job started") == 2  # resubmitted once: no duplicate, none lost
    resumes = [e.data["step"] for e in events if e.message.startswith("Resumed from checkpoint")]
    # at most one checkpoint interval lost: from a checkpoint no older than the newest at the kill (the old attempt's
    # workers, on the worker nodes, may save more before their nodes go: a complete one counts)
    assert len(resumes) == 1 and resumes[0] >= head["newest_checkpoint"]
    assert repeated_losses_match(events, 1e-5)
    assert [r["step"] for r in history(netns_stack, job.output_uri)] == list(range(1, HEAD_STEPS + 1))
    print(f"head loss named on /readyz after {head['down_noticed_s']:.1f}s; worker nodes kept: "
          f"{head['workers_kept']}; resumed from step {resumes[0]} {head['resumed_s']:.0f}s after the kill")
