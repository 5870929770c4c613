"""POST /v1/files streams (service/routes/files.py): bytes that cannot be UTF-8 JSONL are refused as soon as they
arrive, before the client has sent the rest, and nothing is left in storage; a valid upload larger than a storage
part round-trips byte for byte, whichever of `purpose` and `file` comes first. And a job naming a model folder that
storage says does not exist is refused at create, naming `model`."""

from __future__ import annotations

import json
import os
import socket

import boto3
import pytest

from moetune.api.client import APIError
from moetune.service.cluster.scheduler import Scheduler
from moetune.service.local.embedded import free_port
from tests.support.control_plane import OUTPUT_BUCKET, TOKENS

BOUNDARY = "moetune-test-boundary"
JOBS = "/v1/fine_tuning/jobs"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def _body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def _tenant_objects(service) -> tuple[set[str], list]:
    """The tenant's stored files and the bucket's unfinished multipart uploads."""
    s3 = boto3.client("s3", endpoint_url=service.app.state.settings.s3_endpoint_url)
    listed = s3.list_objects_v2(Bucket=OUTPUT_BUCKET, Prefix="files/tenant-a/")
    uploads = s3.list_multipart_uploads(Bucket=OUTPUT_BUCKET, Prefix="files/tenant-a/")
    return {o["Key"] for o in listed.get("Contents", [])}, uploads.get("Uploads", [])


def test_bytes_that_are_not_utf8_are_refused_before_the_rest_is_sent(service):
    """A 200 MB body whose 4th line is random bytes: the client sends 3 MB of it and then only listens; the answer
    (a 422 naming row 4) comes while 197 MB are still unsent, and neither an object nor a multipart upload is left."""
    stored_before, _ = _tenant_objects(service)
    head = _part("purpose", b"fine-tune") + (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="noise.jsonl"\r\n\r\n'.encode())
    sent = head + b'{"text": "a"}\n' * 3 + os.urandom(3 * 2**20)
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKENS['tenant-a']}\r\n"
                     f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                     f"Content-Length: {200 * 10**6}\r\n\r\n".encode() + sent)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)  # times out (the test fails) if the server waits for the whole body
            if not piece:
                break
            answer += piece
    status, _, rest = answer.partition(b"\r\n")
    assert status.split()[1] == b"422", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["param"] == "file" and error["message"] == "file: noise.jsonl row 4 is not UTF-8 text", error
    assert _tenant_objects(service) == (stored_before, [])


def _rows(n_bytes: int) -> bytes:
    """Valid rows of both kinds, with multi-byte characters (split across pieces somewhere) and CRLF line ends."""
    row = (json.dumps({"text": "naïve 漢字 🙂 " * 8}, ensure_ascii=False) + "\r\n").encode()
    chat = (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
            + "\n").encode()
    pair = row + chat
    return pair * (n_bytes // len(pair))


def test_a_valid_upload_larger_than_a_storage_part_round_trips_byte_for_byte(service):
    data = _rows(12 * 2**20)  # more than one 8 MiB part of the multipart upload
    uploaded = service.sdk().files.create(data, "big.jsonl")
    assert uploaded.bytes == len(data) and uploaded.rows == data.count(b"\n")
    assert service.http().get(f"/v1/files/{uploaded.id}/content").content == data


@pytest.mark.parametrize(("rows", "refusal"), [
    (b'{"messages": [{"role": "user", "content": "2+2?"}], "reference": "4"}\n', None),
    (b'{"text": "a fine-tune row"}\n', 'eval.jsonl row 1: expected {"messages": [...], "reference": "..."}'),
])
def test_a_purpose_after_the_file_checks_the_stored_copy_by_its_rules(service, rows, refusal):
    stored_before, _ = _tenant_objects(service)
    body = _body(_part("file", rows, "eval.jsonl"), _part("purpose", b"evaluation"))
    response = service.http().post("/v1/files", content=body,
                                   headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    if refusal is None:
        assert response.status_code == 200 and response.json()["purpose"] == "evaluation", response.text
        assert service.http().get(f"/v1/files/{response.json()['id']}/content").content == rows
    else:
        assert response.status_code == 422 and response.json()["error"]["message"] == f"file: {refusal}"
        assert _tenant_objects(service) == (stored_before, [])


def test_a_model_folder_that_does_not_exist_is_refused_at_create(service, inputs, s3_bucket):
    response = service.http().post(JOBS, json={**inputs, "model": f"s3://{s3_bucket}/no-such-model"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and f"s3://{s3_bucket}/no-such-model does not exist" in error["message"]


def test_a_missing_model_storage_cannot_vouch_for_fails_before_any_worker(start_service, s3_endpoint, s3_bucket,
                                                                          inputs):
    """Storage unreachable at create: the job is accepted, and the check before queueing fails it, naming `model`."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    offline = start_service(s3_endpoint_url=nowhere, ray_address=nowhere)
    job_id = offline.create_job(**{**inputs, "model": f"s3://{s3_bucket}/no-such-model"})["id"]

    online = offline.app.state.settings.model_copy(update={"s3_endpoint_url": s3_endpoint})
    Scheduler(offline.store, online).tick()

    job = offline.http().get(f"{JOBS}/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "file_not_found"
    assert job["error"]["param"] == "model"


def test_a_file_over_the_limit_is_refused_with_nothing_stored(start_service, s3_endpoint, output_bucket):
    """Declared larger (Content-Length): refused before reading; sent chunked (no length): refused as it crosses."""
    service = start_service(s3_endpoint_url=s3_endpoint, max_upload_mb=1)
    stored_before, _ = _tenant_objects(service)
    with pytest.raises(APIError) as err:
        service.sdk().files.create(_rows(3 * 10**6), "big.jsonl")
    assert err.value.status_code == 413 and err.value.param == "file" and "limit of 1 MB" in err.value.message
    body = _body(_part("purpose", b"fine-tune"), _part("file", _rows(3 * 10**6), "big.jsonl"))
    chunked = service.http().post("/v1/files", content=iter([body[i:i + 2**16] for i in range(0, len(body), 2**16)]),
                                  headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert chunked.status_code == 413 and "limit of 1 MB" in chunked.json()["error"]["message"], chunked.text
    assert _tenant_objects(service) == (stored_before, [])
