"""Where a worker group starts: the newest COMPLETE checkpoint under `<output_uri>/checkpoints/`, and why.

A checkpoint `step-<N>/` is complete once its manifest `checkpoint.json` exists. The manifest is written last,
after every rank's files are uploaded, so a group killed mid-upload leaves a step directory without one, and
readers (resume here, the control plane's checkpoint list, downloads) ignore it.

Why a group resumes, for the job's events: a marker per driver run (`attempts/<id>`) tells a restart after a
lost worker (the same driver run already started a group) from a resume after pause or a resubmitted job.
Next to it, `attempts/<id>.oom-*.json` records the micro-batch sizes at which a rank ran out of memory where
the tuner could not recover (every later group stays below them).

Retention (`training.keep_checkpoints`): the step directories older than the newest N complete, intact
checkpoints are retired, manifest first.
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
from dataclasses import dataclass

from moetune.api.layout import CHECKPOINT_MANIFEST as MANIFEST
from moetune.api.layout import STEP_DIR_GLOB, checkpoint_uri, checkpoints_uri, manifest_uri, step_of
from moetune.api import storage

TRAINER_STATE = "trainer_state.json"  # step, trained tokens, metrics history, attempt, paused
ATTEMPTS_DIR = "attempts"


def _files(uri: str) -> dict[str, int]:
    """Relative path -> size of every object under `uri` (fresh listing, not fsspec's cache)."""
    fs, root = storage.filesystem(uri)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    return {posixpath.relpath(p, root): info["size"] for p, info in fs.find(root, detail=True).items()}


def write_manifest(uri: str, step: int) -> None:
    """Marks the checkpoint at `uri` complete; call once, after every rank's files are uploaded."""
    files = [{"path": p, "size": size} for p, size in sorted(_files(uri).items()) if p != MANIFEST]
    storage.write_bytes(manifest_uri(uri), json.dumps({"step": step, "files": files}).encode())


def retract_manifest(uri: str) -> None:
    """A step directory about to be written again (its earlier checkpoint lost files) stops being complete first."""
    fs, path = storage.filesystem(manifest_uri(uri))
    if fs.exists(path):
        fs.rm_file(path)


def save_trainer_state(local_dir: str, **state) -> None:
    """What resuming needs besides DeepSpeed's files; the chief writes it into the checkpoint before upload."""
    os.makedirs(local_dir, exist_ok=True)
    with open(os.path.join(local_dir, TRAINER_STATE), "w") as f:
        json.dump(state, f)


def _is_intact(uri: str, manifest: dict) -> bool:
    present = _files(uri)
    return all(present.get(f["path"]) == f["size"] for f in manifest["files"])


@dataclass
class ResumePoint:
    step: int
    uri: str
    state: dict  # TRAINER_STATE of that checkpoint


def _steps(output_uri: str, inside: str = "") -> list[int]:
    """Newest first: the steps of the `step-<N>` directories (only those holding `inside`, when given)."""
    fs, root = storage.filesystem(checkpoints_uri(output_uri))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    steps = set()
    for path in fs.glob(f"{root}/{STEP_DIR_GLOB}" + (f"/{inside}" if inside else "")):
        step = step_of(posixpath.relpath(path, root).split("/")[0])
        if step is not None:
            steps.add(step)
    return sorted(steps, reverse=True)


def _complete(output_uri: str):
    """Newest first: (step, uri) of each complete checkpoint whose listed files are all there."""
    for step in _steps(output_uri, MANIFEST):
        uri = checkpoint_uri(output_uri, step)
        manifest = json.loads(storage.read_text(manifest_uri(uri)))
        if manifest.get("step") == step and _is_intact(uri, manifest):
            yield step, uri


def complete_checkpoints(output_uri: str) -> list[tuple[int, str]]:
    """Newest first: (step, uri) of every complete checkpoint."""
    return list(_complete(output_uri))


def latest_checkpoint(output_uri: str) -> ResumePoint | None:
    """The newest complete checkpoint whose listed files are all there, or None."""
    newest = next(_complete(output_uri), None)
    if newest is None:
        return None
    step, uri = newest
    return ResumePoint(step, uri, json.loads(storage.read_text(storage.join(uri, TRAINER_STATE))))


def retired_checkpoints(output_uri: str, keep: int) -> list[int]:
    """Steps of the checkpoint directories older than the newest `keep` complete ones (complete or not)."""
    kept = [step for step, _ in itertools.islice(_complete(output_uri), keep)]
    if len(kept) < keep:
        return []
    return [step for step in _steps(output_uri) if step < kept[-1]]


def delete_checkpoint(output_uri: str, step: int) -> None:
    uri = checkpoint_uri(output_uri, step)
    retract_manifest(uri)  # incomplete before any file goes: nothing resumes from half of it
    fs, path = storage.filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _attempt_marker(output_uri: str, attempt: str) -> str:
    return storage.join(output_uri, ATTEMPTS_DIR, attempt)


def mark_group_started(output_uri: str, attempt: str) -> bool:
    """Records that this driver run started a worker group; True when one had started before (a restart)."""
    marker = _attempt_marker(output_uri, attempt)
    restarted = storage.exists(marker)
    if not restarted:
        storage.write_bytes(marker, b"")
    return restarted


def record_oom(output_uri: str, attempt: str, rank: int, step: int, micro_batch_size: int) -> None:
    """What a rank leaves before an out-of-memory error the micro-batch tuner cannot recover from takes it down."""
    record = {"rank": rank, "step": step, "micro_batch_size": micro_batch_size}
    storage.write_bytes(storage.join(output_uri, ATTEMPTS_DIR, f"{attempt}.oom-rank{rank}-step{step}.json"),
                        json.dumps(record).encode())


def smallest_oom_size(output_uri: str) -> int | None:
    """The smallest micro-batch size any earlier worker group of this job ran out of memory at, if any."""
    fs, root = storage.filesystem(storage.join(output_uri, ATTEMPTS_DIR))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    sizes = [json.loads(fs.cat_file(path))["micro_batch_size"] for path in fs.glob(f"{root}/*.oom-*.json")]
    return min(sizes, default=None)


def resume_reason(point: ResumePoint, restarted: bool) -> str:
    if restarted:
        return "a worker failure"
    if point.state.get("paused"):
        return "pause"
    return "a restart of the job"


def paused_step(output_uri: str, attempt: str) -> int | None:
    """The step this driver run's worker group paused at, or None when it did not pause."""
    point = latest_checkpoint(output_uri)
    if point and point.state.get("paused") and point.state.get("attempt") == attempt:
        return point.step
    return None
