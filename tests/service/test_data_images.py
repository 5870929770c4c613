"""Images inside a job's data files, at submission and in the driver: a real control plane reading the files from
the session's S3 server. A tenant's rows cannot make the workers read outside its storage (security), and a model
without image input refuses image rows with a 422 naming the file, row and field."""

import json
import os

import boto3
import pytest

from moetune.api.environment import ENV_IMAGE_LIMITS, ENV_URI_ACCESS
from moetune.service.cluster.scheduler import Scheduler
from moetune.workers.data.images import ImageCheck
from moetune.workers.data.rows import load_rows
from moetune.workers.errors import DatasetError
from moetune.workers.families import REGISTRY
from moetune.workers.settings import WorkerSettings
from moetune.workers.tiny import write_tiny_tokenizer
from tests.support.images import data_url, image_bytes, image_row

URL = "messages[0].content[1].image_url.url"
TEXT_PARTS = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}


@pytest.fixture(scope="module")
def buckets(s3_endpoint, tmp_path_factory):
    """Tenant a's bucket (the configs and tokenizers of a text-only kimi_linear and of a Kimi K3 with its vision
    tower, a PNG) and tenant b's (a PNG)."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    a, b = "images-tenant-a", "images-tenant-b"
    for bucket in (a, b):
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="img/red.png", Body=image_bytes())
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(str(tokenizer))
    for folder, family in (("kimi", "kimi_linear"), ("k3", "kimi_k3")):
        for name in os.listdir(tokenizer):
            s3.put_object(Bucket=a, Key=f"{folder}/{name}", Body=(tokenizer / name).read_bytes())
        s3.put_object(Bucket=a, Key=f"{folder}/config.json", Body=REGISTRY[family].tiny_config().to_json_string())
    return a, b


@pytest.fixture
def submit(start_service, buckets, s3_endpoint):
    """Posts tenant a's job with the given training rows; returns the HTTP reply."""
    a, b = buckets
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    service = start_service(s3_endpoint_url=s3_endpoint, uri_allow_list={"tenant-a": [f"s3://{a}"]},
                            default_output_uri=f"s3://{a}/out")

    def post(rows: list[dict], model: str = "kimi", **fields):
        s3.put_object(Bucket=a, Key="train.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows))
        return service.http("tenant-a").post("/v1/fine_tuning/jobs", json={
            "model": f"s3://{a}/{model}", "training_file": f"s3://{a}/train.jsonl", **fields})

    post.service = service
    return post


def _error(reply) -> tuple[str, str]:
    assert reply.status_code == 422, reply.text
    return reply.json()["error"]["param"], reply.json()["error"]["message"]


def test_images_of_another_tenant_or_the_web_are_refused_at_submission(submit, buckets):
    a, b = buckets
    where = f"training_file s3://{a}/train.jsonl row 2: '{URL}'"
    assert _error(submit([TEXT_PARTS, image_row(f"s3://{b}/img/red.png")])) == ("training_file", (
        f"{where} is refused: s3://{b}/img/red.png is outside this tenant's storage locations (s3://{a})"))
    assert _error(submit([TEXT_PARTS, image_row("https://example.com/red.png")]))[1].startswith(
        f"{where} is a web URL: the workers fetch nothing from the internet")


def test_image_rows_for_a_model_without_image_input_are_422(submit, buckets):
    a, _ = buckets
    assert _error(submit([TEXT_PARTS, image_row(data_url(image_bytes()))])) == ("training_file", (
        f"training_file s3://{a}/train.jsonl row 2: '{URL}' is an image, but moetune trains 'kimi_linear' models on "
        "text only (no image input for this family)"))
    assert submit([TEXT_PARTS]).status_code == 200  # text-only parts train on every family
    # a file that passed is not read again for seconds (a run of creates): new bytes within them are the driver's
    assert submit([TEXT_PARTS, image_row(data_url(image_bytes()))]).status_code == 200


def test_image_rows_of_a_context_parallel_job_are_422(submit, buckets):
    """Kimi K3 takes images, but not when its rows are split over context-parallel ranks: the refusal says why and
    what to change; the same rows at context_parallel_size 1 are accepted."""
    a, _ = buckets
    rows = [TEXT_PARTS, image_row(data_url(image_bytes()))]
    split = {"parallelism": {"num_workers": 2, "context_parallel_size": 2}}
    assert _error(submit(rows, "k3", **split)) == ("training_file", (
        f"training_file s3://{a}/train.jsonl row 2: '{URL}' is an image, but a job with "
        "parallelism.context_parallel_size = 2 trains on text only (context parallelism splits token rows, not "
        "images); use context_parallel_size 1 for image rows"))
    assert submit(rows, "k3").status_code == 200


def test_the_driver_gets_the_tenants_access_and_refuses_what_submission_did_not_scan(start_service, buckets,
                                                                                    s3_endpoint, monkeypatch):
    """A file too large to scan at submission is accepted there; the driver, with the storage access and image limits
    the control plane hands the Ray job, refuses the other tenant's image before any worker starts."""
    a, b = buckets
    service = start_service(s3_endpoint_url=s3_endpoint, uri_allow_list={"tenant-a": [f"s3://{a}"]},
                            default_output_uri=f"s3://{a}/out", submission_scan_max_mb=0,
                            image_limits={"max_images_per_row": 3})
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=a, Key="big.jsonl", Body=json.dumps(image_row(f"s3://{b}/img/red.png")) + "\n")
    job = service.create_job("tenant-a", model=f"s3://{a}/kimi", training_file=f"s3://{a}/big.jsonl")

    env = Scheduler(service.store, service.app.state.settings).job_env(service.store.get_job(job["id"]), "token")
    for name, value in env.items():  # the driver's environment
        monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    assert json.loads(env[ENV_URI_ACCESS]) == {"prefixes": [f"s3://{a}"], "allow_file_uris": False, "file_roots": None}
    assert json.loads(env[ENV_IMAGE_LIMITS])["max_images_per_row"] == settings.image_limits.max_images_per_row == 3
    with pytest.raises(DatasetError) as err:
        load_rows(f"s3://{a}/big.jsonl", "training_file", ImageCheck(settings.uri_access, settings.image_limits, None))
    assert str(err.value) == (f"training_file s3://{a}/big.jsonl row 1: '{URL}' is refused: s3://{b}/img/red.png is "
                              f"outside this tenant's storage locations (s3://{a})")
