"""Bearer tokens map to tenants; a tenant can neither see nor touch another tenant's jobs."""

import pytest

JOBS = "/v1/fine_tuning/jobs"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic tok-a"}])
def test_missing_or_wrong_token_is_401(service, headers):
    response = service.http(None).get(JOBS, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_tenants_are_isolated(service):
    job_id = service.create_job("tenant-a")["id"]
    token = service.start_job(job_id)
    service.report_checkpoint(job_id, token, 1)
    a, b = service.http("tenant-a"), service.http("tenant-b")

    for method, path in [("GET", "{}"), ("GET", "{}/events"), ("GET", "{}/checkpoints"), ("POST", "{}/cancel"),
                         ("POST", "{}/pause"), ("POST", "{}/resume"), ("GET", "{}/events?stream=true")]:
        response = b.request(method, f"{JOBS}/" + path.format(job_id))
        assert response.status_code == 404, path
        # Exactly what an unknown id gets: the answer does not tell whether the id exists.
        unknown = b.request(method, f"{JOBS}/" + path.format("ftjob-000000000000000000000000")).json()
        assert response.json() == {"error": {**unknown["error"], "message": unknown["error"]["message"].replace(
            "ftjob-000000000000000000000000", job_id)}}, path
    assert b.get(JOBS, params={"after": job_id}).status_code == 404  # nor may a cursor name A's job
    assert job_id not in [j["id"] for j in b.get(JOBS, params={"limit": 100}).json()["data"]]
    assert job_id in [j["id"] for j in a.get(JOBS, params={"limit": 100}).json()["data"]]
    assert a.get(f"{JOBS}/{job_id}/checkpoints").json()["data"][0]["step_number"] == 1
    assert a.get(f"{JOBS}/{job_id}").json()["status"] == "running"  # B's cancel did nothing
