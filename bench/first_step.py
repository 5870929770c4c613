"""Submit -> first training step for the demo job on a fresh `moetune up` stack: the first job, then a second
one on the same stack (Ray, the S3 server and the control plane already warm), with each job's phases read from
its events. The stack lives in a temporary state directory and is stopped at the end.

    python bench/first_step.py

Last line: RESULT first_job_first_step_s=... second_job_first_step_s=... total_s=...
(total_s: submit -> succeeded of the first job).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from moetune.api.client import Client
from moetune.api.models.responses import JobStatus
from moetune.service.local import stack as local_stack
from moetune.service.local.demo import BUCKET, MODELS, demo_job_spec, make_demo_assets

# (label, how the event's message starts): the path of a job from the Ray submission to its first step
PHASES = [
    ("ray job started", "Job started"),
    ("driver checked files", "Files validated"),
    ("worker group starting", "Starting "),
    ("workers loading weights", "Loading model"),
    ("model loaded", "Model loaded"),
    ("training started", "Training started"),
]


def _first_step(client: Client, job_id: str, submitted: float, timeout: float = 900) -> float:
    """Seconds from submission to the first metrics event (step 1 done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = client.jobs.events_since(job_id)
        if any(e.type == "metrics" and (e.data or {}).get("step") == 1 for e in events):
            return time.time() - submitted
        job = client.jobs.retrieve(job_id)
        if JobStatus(job.status).terminal:
            raise RuntimeError(f"{job_id} ended {job.status} before its first step: {job.error}")
        time.sleep(0.25)
    raise TimeoutError(f"{job_id} made no step in {timeout:.0f}s")


def _phases(client: Client, job_id: str, submitted: float) -> str:
    events = client.jobs.events_since(job_id)
    marks = []
    for label, prefix in PHASES:
        at = next((e.created_at for e in events if e.message.startswith(prefix)), None)
        if at is not None:
            marks.append(f"{label} +{at - submitted:.0f}s")
    step1 = next((e.created_at for e in events if e.type == "metrics" and (e.data or {}).get("step") == 1), None)
    if step1 is not None:
        marks.append(f"step 1 +{step1 - submitted:.0f}s")
    return ", ".join(marks)


def _run_job(client: Client) -> tuple[str, float, float]:
    spec = demo_job_spec().model_copy(update={"model": MODELS[False], "output_uri": None})
    submitted = time.time()
    job = client.jobs.create(spec)
    first_step = _first_step(client, job.id, submitted)
    print(f"{job.id}: first step after {first_step:.1f}s ({_phases(client, job.id, submitted)})", flush=True)
    return job.id, submitted, first_step


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="moetune-bench-") as tmp:
        state_dir = Path(tmp) / ".moetune"
        started = time.monotonic()
        stack = local_stack.up(state_dir, base_models={MODELS[False]: f"s3://{BUCKET}/models/{MODELS[False]}"})
        try:
            print(f"stack up in {time.monotonic() - started:.1f}s", flush=True)
            make_demo_assets(Path(tmp), stack.s3_endpoint, images=False)
            client = Client(stack.url, stack.token)
            first_id, first_submitted, first = _run_job(client)
            job = client.jobs.wait(first_id, timeout=900)
            total = time.time() - first_submitted
            print(f"{first_id}: {job.status} after {total:.1f}s", flush=True)
            _, _, second = _run_job(client)
        finally:
            local_stack.down(state_dir)
    print(f"RESULT first_job_first_step_s={first:.1f} second_job_first_step_s={second:.1f} total_s={total:.1f}")


if __name__ == "__main__":
    main()
