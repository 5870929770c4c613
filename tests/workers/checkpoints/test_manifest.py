"""Checkpoint completeness on the real S3 server: only a step directory whose manifest (written last) is there and
whose listed files are all present is offered for resume."""

import json

from moetune.api import storage
from moetune.workers.checkpoints.run_state import (
    MANIFEST,
    TRAINER_STATE,
    checkpoint_uri,
    delete_checkpoint,
    latest_checkpoint,
    mark_group_started,
    paused_step,
    retired_checkpoints,
    retract_manifest,
    write_manifest,
)


def _write_checkpoint(output_uri: str, step: int, complete: bool = True, **state) -> str:
    uri = checkpoint_uri(output_uri, step)
    storage.write_bytes(f"{uri}/deepspeed/latest", b"global_step%d" % step)
    storage.write_bytes(f"{uri}/deepspeed/global_step{step}/mp_rank_00_model_states.pt", b"x" * (100 + step))
    storage.write_bytes(f"{uri}/{TRAINER_STATE}", json.dumps({"step": step, **state}).encode())
    if complete:
        write_manifest(uri, step)
    return uri


def test_resume_takes_the_newest_complete_checkpoint(s3_bucket):
    out = f"s3://{s3_bucket}/out/ftjob-1"
    assert latest_checkpoint(out) is None  # nothing written yet
    _write_checkpoint(out, 4)
    uri8 = _write_checkpoint(out, 8, attempt="a", paused=True)
    _write_checkpoint(out, 12, complete=False)  # a group killed while uploading step 12
    storage.write_bytes(f"{out}/checkpoints/step-16/deepspeed/latest", b"global_step16")  # only started
    storage.write_bytes(f"{out}/checkpoints/notes.txt", b"not a step directory")

    manifest = json.loads(storage.read_text(f"{uri8}/{MANIFEST}"))
    assert manifest == {"step": 8, "files": [
        {"path": "deepspeed/global_step8/mp_rank_00_model_states.pt", "size": 108},
        {"path": "deepspeed/latest", "size": len("global_step8")},
        {"path": TRAINER_STATE, "size": len(json.dumps({"step": 8, "attempt": "a", "paused": True}))}]}
    point = latest_checkpoint(out)
    assert (point.step, point.uri, point.state["paused"]) == (8, uri8, True)
    assert paused_step(out, "a") == 8 and paused_step(out, "another driver run") is None

    # a file the manifest lists went missing (or was cut short): that checkpoint is not offered either
    storage.write_bytes(f"{uri8}/deepspeed/global_step8/mp_rank_00_model_states.pt", b"short")
    assert latest_checkpoint(out).step == 4
    # and while step 8 is written again its old manifest no longer vouches for it
    retract_manifest(uri8)
    assert not storage.exists(f"{uri8}/{MANIFEST}")
    retract_manifest(uri8)  # nothing to retract: no error
    write_manifest(uri8, 8)
    assert latest_checkpoint(out).step == 8


def test_group_start_marker_tells_a_restart_from_a_first_start(s3_bucket):
    out = f"s3://{s3_bucket}/out/ftjob-2"
    assert mark_group_started(out, "run-1") is False
    assert mark_group_started(out, "run-1") is True  # Ray Train restarted the group within the same driver run
    assert mark_group_started(out, "run-2") is False  # a new driver run (resume after pause, resubmission)


def test_retention_keeps_the_newest_intact_checkpoints_and_retires_everything_older(s3_bucket):
    out = f"s3://{s3_bucket}/out/ftjob-keep"
    for step in (2, 4, 6, 8):
        _write_checkpoint(out, step)
    _write_checkpoint(out, 3, complete=False)  # a killed group's leftovers, older than what is kept
    _write_checkpoint(out, 10, complete=False)  # being written now: never retired
    assert retired_checkpoints(out, keep=5) == []  # fewer complete checkpoints than asked to keep
    assert retired_checkpoints(out, keep=2) == [4, 3, 2]
    # A damaged checkpoint does not count as kept: the older intact one stays, resume can still use it.
    storage.write_bytes(f"{checkpoint_uri(out, 8)}/deepspeed/global_step8/mp_rank_00_model_states.pt", b"short")
    assert retired_checkpoints(out, keep=2) == [3, 2]

    for step in retired_checkpoints(out, keep=2):
        delete_checkpoint(out, step)
    assert not any(storage.exists(checkpoint_uri(out, s)) for s in (2, 3))
    assert latest_checkpoint(out).step == 6 and storage.exists(f"{checkpoint_uri(out, 10)}/{TRAINER_STATE}")
    delete_checkpoint(out, 2)  # already gone: no error
