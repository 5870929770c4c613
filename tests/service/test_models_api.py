"""GET /v1/models and /v1/models/{model} per tenant, and the deploy call's refusals (no Ray needed for those)."""

from __future__ import annotations

import pytest

from moetune.service.local.embedded import free_port
from tests.support.control_plane import run_service, settings_for

BASE_URI = "s3://models/tiny"


@pytest.fixture(scope="module")
def models_service(tmp_path_factory, s3_endpoint, output_bucket):
    # a Ray address where nothing listens: the deploy call must say Serve is unavailable
    settings = settings_for(tmp_path_factory.mktemp("models"), s3_endpoint_url=s3_endpoint,
                            base_models={"tiny-base": BASE_URI}, ray_address=f"http://127.0.0.1:{free_port()}")
    with run_service(settings) as running:
        yield running


def _succeed(service, tenant: str, **fields) -> dict:
    job = service.create_job(tenant, **fields)
    service.report(job["id"], service.start_job(job["id"]),
                   {"kind": "result", "status": "succeeded", "fine_tuned_model": f"s3://o/{job['id']}/adapter"})
    return service.http(tenant).get(f"/v1/fine_tuning/jobs/{job['id']}").json()


def test_a_tenant_sees_the_bases_and_only_its_own_models(models_service):
    mine = _succeed(models_service, "tenant-a", model="tiny-base", suffix="bot")
    theirs = _succeed(models_service, "tenant-b")
    pending = models_service.create_job("tenant-a")
    assert mine["fine_tuned_model"] == f"ft:tiny-base:bot:{mine['id']}"
    assert mine["fine_tuned_model_uri"] == f"s3://o/{mine['id']}/adapter"
    assert pending["fine_tuned_model"] is None

    listed = models_service.http("tenant-a").get("/v1/models").json()
    assert listed["object"] == "list"
    ids = [m["id"] for m in listed["data"]]
    assert "tiny-base" in ids and mine["fine_tuned_model"] in ids and theirs["fine_tuned_model"] not in ids
    assert all("moetune" not in m for m in listed["data"])  # storage locations only on retrieve

    found = models_service.http("tenant-a").get(f"/v1/models/{mine['fine_tuned_model']}").json()
    assert found["owned_by"] == "tenant-a" and found["moetune"] == {
        "base_model": "tiny-base", "base_model_uri": BASE_URI, "adapter_uri": mine["fine_tuned_model_uri"],
        "fine_tuning_job_id": mine["id"]}
    base = models_service.http("tenant-b").get("/v1/models/tiny-base").json()
    assert base["moetune"]["base_model_uri"] == BASE_URI and base["moetune"]["adapter_uri"] is None

    # another tenant's model, its own job id under a wrong name, made-up names: the same 404
    answers = [models_service.http(tenant).get(f"/v1/models/{name}") for tenant, name in (
        ("tenant-b", mine["fine_tuned_model"]), ("tenant-a", f"ft:tiny-base:other:{mine['id']}"),
        ("tenant-b", "ft:x:y:ftjob-0"), ("tenant-b", "nope"))]
    assert {a.status_code for a in answers} == {404}
    assert all(a.json() == answers[0].json() for a in answers) and answers[0].json()["error"]["code"] == "model_not_found"


def test_deploy_refuses_an_unfinished_job_and_says_when_serve_is_unreachable(models_service):
    pending = models_service.create_job("tenant-a")
    refused = models_service.http().post(f"/v1/fine_tuning/jobs/{pending['id']}/deploy")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "job_not_deployable"
    done = _succeed(models_service, "tenant-a")
    assert models_service.http("tenant-b").post(f"/v1/fine_tuning/jobs/{done['id']}/deploy").status_code == 404
    down = models_service.http().post(f"/v1/fine_tuning/jobs/{done['id']}/deploy")
    assert down.status_code == 503 and down.json()["error"]["code"] == "serve_unavailable"
    assert "did not answer" in down.json()["error"]["message"]


def test_chat_sent_to_the_control_plane_is_told_where_the_serve_app_is(models_service):
    import openai

    from tests.support.control_plane import TOKENS

    client = openai.OpenAI(base_url=f"{models_service.url}/v1", api_key=TOKENS["tenant-a"], max_retries=0)
    serve = models_service.app.state.settings.serve_url.rstrip("/") + "/v1"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny-base", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["message"].startswith(f"The control plane does not run models: send /v1/chat/completions "
                                                f"to the Serve app at {serve}")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-base", prompt="hi")
    assert models_service.http(None).post("/v1/chat/completions", json={}).status_code == 401
