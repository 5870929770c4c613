"""The Serve app on the session's Ray head, deployed by the control plane's deploy call, against a control plane
where two tenants have tuned models of one tiny kimi_linear base (adapters in the S3 server): the official openai
SDK unmodified, answers equal to the engine's, sampling knobs, tenants, errors and metrics, in one app start."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import boto3
import httpx
import openai
import pytest
from click.testing import CliRunner

from moetune.service.app import create_app
from moetune.service.cli.main import main
from moetune.service.local.embedded import control_plane_in_thread, free_port
from tests.support.control_plane import TOKENS, RunningService, settings_for
from tests.workers.generate.conftest import write_adapter, write_checkpoint

# Ray heavy (Serve's controller, proxy and replicas on the Ray head): left out of `pytest -m "not ray_job"`
pytestmark = pytest.mark.ray_job

BUCKET = "serve-assets"
BASE = "tiny-kimi"
MESSAGES = [{"role": "user", "content": "What colour is the sky?"}]


def _upload(s3, local: Path, prefix: str) -> str:
    for path in local.iterdir():
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def served(s3_endpoint, ray_head, serve_url, tmp_path_factory):
    from moetune.workers.tiny import write_tiny_dataset

    work = tmp_path_factory.mktemp("serve")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    base = _upload(s3, Path(write_checkpoint("kimi_linear", work / "base")), "base")
    adapters = {kind: write_adapter("kimi_linear", work / kind, seed, experts)
                for kind, seed, experts in (("linear", 1, False), ("experts", 2, True))}
    uris = {kind: _upload(s3, Path(path), f"adapters/{kind}") for kind, path in adapters.items()}
    (work / "broken").mkdir()
    (work / "broken" / "adapter_config.json").write_text("{not json")
    uris["broken"] = _upload(s3, work / "broken", "adapters/broken")
    write_tiny_dataset(work / "train.jsonl", n_rows=8, seed=1)
    s3.upload_file(str(work / "train.jsonl"), BUCKET, "train.jsonl")

    port = free_port()
    settings = settings_for(work, ray_address=ray_head.dashboard_url, callback_url=f"http://127.0.0.1:{port}",
                            s3_endpoint_url=s3_endpoint, default_output_uri=f"s3://{BUCKET}/outputs",
                            base_models={BASE: base}, serve_url=serve_url)
    app = create_app(settings)
    with control_plane_in_thread(app, port) as url:
        service = RunningService(url, app)
        names = {}
        for tenant, kind, suffix in (("tenant-a", "linear", "one"), ("tenant-a", "experts", None),
                                     ("tenant-a", "broken", "broken"), ("tenant-b", "linear", None)):
            job = service.create_job(tenant, model=BASE, training_file=f"s3://{BUCKET}/train.jsonl", suffix=suffix)
            service.report(job["id"], service.start_job(job["id"]),
                           {"kind": "result", "status": "succeeded", "fine_tuned_model": uris[kind]})
            names[tenant, kind] = service.http(tenant).get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        first = names["tenant-a", "linear"]
        # the first deploy starts Serve on the cluster (its controller and HTTP proxy): longer than a plain call
        deployed = httpx.post(f"{url}/v1/fine_tuning/jobs/{first['id']}/deploy", timeout=120,
                              headers={"Authorization": f"Bearer {TOKENS['tenant-a']}"})
        assert deployed.status_code == 200, deployed.text
        assert deployed.json()["model"] == first["fine_tuned_model"] == f"ft:{BASE}:one:{first['id']}"
        base_url = deployed.json()["base_url"]
        deadline = time.monotonic() + 180
        while (status := httpx.get(f"{ray_head.dashboard_url}/api/serve/applications/").json()
               ["applications"].get("moetune-serve", {}).get("status")) != "RUNNING":
            assert status != "DEPLOY_FAILED" and time.monotonic() < deadline, status
            time.sleep(0.5)
        try:
            yield {"base_url": base_url, "control_plane": url, "ray": ray_head.dashboard_url, "app": app,
                   "names": {k: v["fine_tuned_model"] for k, v in names.items()},
                   "base": base, "adapters": adapters, "work": work}
        finally:
            httpx.delete(f"{ray_head.dashboard_url}/api/serve/applications/", timeout=60)


def _engine_answers(base_dir: Path, adapters: dict[str, str], max_tokens: int) -> dict[str, str]:
    """The engine in this process, on the same base and adapters: the reference answers of a greedy request."""
    from moetune.workers.generate import Engine, GenerationRequest, SamplingParams
    from moetune.workers.serve.completions import end_of_turn_ids

    engine = Engine.from_uri(str(base_dir))
    tokenizer = engine.tokenizer
    prompt = tokenizer(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, stop_token_ids=end_of_turn_ids(tokenizer))

    async def answer(adapter: str) -> str:
        tokens = [e.token_id async for e in engine.stream(GenerationRequest(prompt, adapter, params))
                  if e.token_id is not None]
        return tokenizer.decode(tokens, skip_special_tokens=True)

    async def all_answers() -> dict[str, str]:
        return {kind: await answer(adapter) for kind, adapter in adapters.items()}

    try:
        return asyncio.run(all_answers())
    finally:
        engine.close()


def test_the_openai_sdk_against_the_serve_app(served):
    a = openai.OpenAI(base_url=served["base_url"], api_key=TOKENS["tenant-a"], max_retries=0)
    names = served["names"]
    listed = {m.id for m in a.models.list()}
    assert {BASE, names["tenant-a", "linear"], names["tenant-a", "experts"]} <= listed
    assert names["tenant-b", "linear"] not in listed

    # greedy answers equal the engine's own, plain and streamed, for a linear and an expert-LoRA adapter
    references = _engine_answers(served["work"] / "base", served["adapters"], 12)
    for kind in ("linear", "experts"):
        answer = a.chat.completions.create(model=names["tenant-a", kind], messages=MESSAGES, max_tokens=12,
                                           temperature=0)
        expected = references[kind]
        assert answer.choices[0].message.content == expected and answer.usage.completion_tokens <= 12
        chunks = list(a.chat.completions.create(model=names["tenant-a", kind], messages=MESSAGES, max_tokens=12,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    text = expected

    # n, max_tokens and stop
    two = a.chat.completions.create(model=names["tenant-a", "experts"], messages=MESSAGES, max_tokens=12,
                                    temperature=0, n=2)
    assert [c.message.content for c in two.choices] == [text, text]
    short = a.chat.completions.create(model=names["tenant-a", "experts"], messages=MESSAGES, max_tokens=3,
                                      temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    stop = text.strip()[2:4]
    stopped = a.chat.completions.create(model=names["tenant-a", "experts"], messages=MESSAGES, max_tokens=12,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    completion = a.completions.create(model=BASE, prompt="The sky is", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4

    # another tenant's model answers exactly as an unknown one
    http = httpx.Client(base_url=served["base_url"], headers={"Authorization": f"Bearer {TOKENS['tenant-b']}"},
                        timeout=60)
    body = {"messages": MESSAGES, "max_tokens": 2}
    theirs = http.post("/chat/completions", json={**body, "model": names["tenant-a", "linear"]})
    unknown = http.post("/chat/completions", json={**body, "model": f"ft:{BASE}:x:ftjob-0"})
    assert theirs.status_code == unknown.status_code == 404 and theirs.json() == unknown.json()
    assert theirs.json()["error"]["code"] == "model_not_found"

    # 400s naming the field
    mine = httpx.Client(base_url=served["base_url"], headers={"Authorization": f"Bearer {TOKENS['tenant-a']}"},
                        timeout=60)
    good = {"model": names["tenant-a", "linear"], "messages": MESSAGES, "max_tokens": 2}
    for change, param in (({"n": 0}, "n"), ({"n": 100}, "n"), ({"max_tokens": 0}, "max_tokens"),
                          ({"messages": [{"role": "user"}]}, "messages.0.content"),
                          ({"messages": []}, "messages"), ({"max_tokens": 5000}, "max_tokens"),
                          ({"messages": [{"role": "user", "content": "x" * 5000}]}, "max_tokens")):
        refused = mine.post("/chat/completions", json={**good, **change})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (change, refused.text)
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        a.chat.completions.create(model=names["tenant-a", "linear"], messages=MESSAGES, max_tokens=5000)

    # an adapter that cannot load: 503 with the cause, and the replica serves the next request
    broken = mine.post("/chat/completions", json={**good, "model": names["tenant-a", "broken"]})
    assert broken.status_code == 503 and broken.json()["error"]["code"] == "adapter_unavailable"
    assert "adapters/broken" in broken.json()["error"]["message"]
    assert mine.post("/chat/completions", json=good).status_code == 200

    # the CLI: download a tuned model's adapter (its config naming the base URI), and chat with it
    cli = ["--url", served["control_plane"], "--token", TOKENS["tenant-a"]]
    target = served["work"] / "downloaded"
    done = CliRunner().invoke(main, [*cli, "models", "download", names["tenant-a", "experts"], str(target)])
    assert done.exit_code == 0, done.output
    assert json.loads((target / "adapter_config.json").read_text())["base_model_name_or_path"] == served["base"]
    assert (target / "adapter_model.safetensors").exists()
    # `moetune serve` for a base already served: the same application, answered at once with the base URL
    again = CliRunner().invoke(main, [*cli, "serve", BASE, "--ray-address", served["ray"],
                                      "--serve-url", served["base_url"].removesuffix("/v1")])
    assert again.exit_code == 0 and served["base_url"] in again.output, again.output
    talk = CliRunner().invoke(main, [*cli, "chat", names["tenant-a", "experts"], "--temperature", "0",
                                     "--max-tokens", "12", "--base-url", served["base_url"].removesuffix("/v1")],
                              input=MESSAGES[0]["content"] + "\n\n")
    assert talk.exit_code == 0, talk.output
    assert "".join(text.split()) in "".join(talk.output.split())

    metrics = httpx.get(served["base_url"].removesuffix("/v1") + "/metrics", timeout=60).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    assert samples['moetune_serve_requests_total{endpoint="chat.completion",status="200"}'] >= 8
    assert samples['moetune_serve_requests_total{endpoint="chat.completion",status="503"}'] == 1
    assert samples['moetune_serve_generated_tokens_total{base="tiny-kimi"}'] > 0
    assert samples['moetune_serve_time_to_first_token_seconds_count{base="tiny-kimi"}'] >= 8
    assert samples[f'moetune_serve_adapter_loads_total{{base="{served["base"]}"}}'] >= 2
    assert samples[f'moetune_serve_adapter_load_failures_total{{base="{served["base"]}"}}'] >= 1
    assert "# TYPE moetune_serve_cache_bytes gauge" in metrics


def test_a_deployment_comes_back_after_serve_lost_it(served):
    """What a Ray head restart (or `moetune down` / `up`) does to Serve, deleting the app through Ray's REST API:
    the control plane's scheduler pass deploys the recorded base again and the tuned model answers, with no new
    deploy call. Before the deployments were recorded (service/cluster/deployments.py) it stayed gone."""
    apps = f"{served['ray']}/api/serve/applications/"
    assert httpx.delete(apps, timeout=60).status_code == 200
    deadline = time.monotonic() + 120
    while "moetune-serve" in httpx.get(apps, timeout=30).json()["applications"]:
        assert time.monotonic() < deadline, "Serve did not delete the app"
        time.sleep(0.5)
    served["app"].state.scheduler.tick()  # what the leader's loop runs (the fixture's control plane has it off)
    while (status := httpx.get(apps, timeout=30).json()["applications"].get("moetune-serve", {}).get("status")) \
            != "RUNNING":
        assert status not in (None, "DEPLOY_FAILED") and time.monotonic() < deadline + 120, status
        time.sleep(0.5)
    a = openai.OpenAI(base_url=served["base_url"], api_key=TOKENS["tenant-a"], max_retries=0)
    answer = a.chat.completions.create(model=served["names"]["tenant-a", "linear"], messages=MESSAGES, max_tokens=2)
    assert answer.usage.completion_tokens >= 1
