"""Per-tenant storage allow-lists and the operator's file:// switch: a refused URI is a 422 naming its field."""

import pytest

pytestmark = pytest.mark.usefixtures("output_bucket")

ALLOW = {"tenant-a": ["s3://data-a/", "s3://models"], "*": ["s3://shared/base-models/"]}
GOOD = {"model": "s3://models/tiny", "training_file": "s3://data-a/train.jsonl"}


@pytest.fixture
def policed(start_service, s3_endpoint):
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if "data-a" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket="data-a")  # the jobs' output location
    return start_service(uri_allow_list=ALLOW)


def _refusal(service, tenant: str, **fields) -> tuple[str, str]:
    reply = service.http(tenant).post("/v1/fine_tuning/jobs", json={**GOOD, **fields})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    return error["param"], error["message"]


def test_each_tenant_only_reaches_its_own_buckets(policed):
    assert policed.create_job("tenant-a", **GOOD, validation_file="s3://data-a/sub/valid.jsonl",
                              output_uri="s3://data-a/out")["status"] == "validating_files"
    assert policed.create_job("tenant-b", model="s3://shared/base-models/tiny",
                              training_file="s3://shared/base-models/t.jsonl")  # "*" applies to everyone

    param, message = _refusal(policed, "tenant-b")
    assert param == "model" and message == ("model: s3://models/tiny is outside this tenant's storage locations "
                                            "(s3://shared/base-models/)")  # never another tenant's buckets
    assert _refusal(policed, "tenant-a", training_file="s3://data-ab/train.jsonl")[0] == "training_file"
    assert _refusal(policed, "tenant-a", validation_file="s3://shared/other/v.jsonl")[0] == "validation_file"
    assert _refusal(policed, "tenant-a", output_uri="s3://data-b/out")[0] == "output_uri"
    assert _refusal(policed, "tenant-a", training_file="s3://data-a/../data-b/t.jsonl") == (
        "training_file", "training_file: '..' path segments are not allowed")


def test_file_uris_only_when_the_operator_enables_them(start_service):
    local = {"model": "file:///srv/models/tiny"}
    param, message = _refusal(start_service(), "tenant-a", **local)
    assert param == "model" and "file:// URIs are disabled on this server" in message
    enabled = start_service(allow_file_uris=True, file_uri_roots=["/srv/models", "/data/"])
    assert enabled.create_job(**local)["model"] == local["model"]
    assert _refusal(enabled, "tenant-a", model="file:///srv/models-b/tiny") == (  # whole path segments
        "model", "model: file:///srv/models-b/tiny is outside the directories file:// may name on this server "
                 "(/srv/models, /data)")
    assert _refusal(enabled, "tenant-a", training_file="file:///etc/passwd")[0] == "training_file"


def test_file_uris_need_the_directories_they_may_name(monkeypatch):
    from moetune.service.settings import Settings

    monkeypatch.setenv("MOETUNE_ALLOW_FILE_URIS", "true")
    with pytest.raises(ValueError, match="allow_file_uris needs file_uri_roots"):
        Settings()
    monkeypatch.setenv("MOETUNE_FILE_URI_ROOTS", "/data,srv")
    with pytest.raises(ValueError, match="'srv' must be an absolute directory"):
        Settings()


def test_an_unknown_scheme_names_only_the_schemes_this_server_reads(service):
    assert _refusal(service, "tenant-a", model="hf://org/model") == (
        "model", "model: hf:// is no storage this server reads; use s3://")  # file:// is off here
    assert _refusal(service, "tenant-a", training_file="gs://b/t.jsonl")[1] == (
        "training_file: gs:// is no storage this server reads; use s3://")


def test_a_malformed_allow_list_stops_the_server_from_starting(monkeypatch):
    from moetune.service.settings import Settings

    monkeypatch.setenv("MOETUNE_URI_ALLOW_LIST", '{"tenant-a": ["data-a"]}')
    with pytest.raises(ValueError, match=r"uri_allow_list\['tenant-a'\]: 'data-a' must be a URI"):
        Settings()
