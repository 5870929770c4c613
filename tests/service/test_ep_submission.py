"""Job specs that the model's files or the output location make invalid: 422 at submission with the field (the
control plane reads config.json and lists the checkpoint folder on S3, and probes the output bucket), and the same
rules in the driver's fail-fast check."""

import json
import os
import uuid

import boto3
import httpx
import pytest

from moetune.api.models.job_create import JobCreate
from moetune.workers.errors import JobError
from moetune.workers.model_config import check_supported
from moetune.workers.families import REGISTRY
from moetune.workers.tiny import write_tiny_tokenizer
from tests.support.control_plane import API_TOKENS, run_service

JOBS = "/v1/fine_tuning/jobs"
_DEEPSEEK = REGISTRY["deepseek_v3"].tiny_config().to_dict()
# config.json fields the control plane reads, malformed: (config, the 422's words naming the field)
MALFORMED = {
    "fp8-string": ({**_DEEPSEEK, "quantization_config": "fp8"},
                   "config.json field 'quantization_config' must be an object, not a string 'fp8'"),
    "no-quant-method": ({**_DEEPSEEK, "quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 128]}},
                        "config.json field 'quantization_config.quant_method' is missing"),
    "block-not-a-list": ({**_DEEPSEEK, "quantization_config": {"quant_method": "fp8", "weight_block_size": 128}},
                         "config.json field 'quantization_config.weight_block_size' must be a list, not an integer"),
    "groups-not-objects": ({**_DEEPSEEK, "quantization_config": {"quant_method": "compressed-tensors",
                                                                 "format": "pack-quantized", "config_groups": [4]}},
                           "config.json field 'quantization_config.config_groups' must be an object, not a list"),
    "type-a-list": ({**_DEEPSEEK, "model_type": ["deepseek_v3"]}, "config.json field 'model_type' must be a string"),
    "text-config-a-string": ({"model_type": "kimi_k25", "text_config": "deepseek_v3"},
                             "config.json field 'text_config' must be an object, not a string 'deepseek_v3'"),
    "experts-a-string": ({**_DEEPSEEK, "n_routed_experts": "8"},
                         "config.json field 'n_routed_experts' must be an integer, not a string '8'"),
    "vocab-a-string": ({**_DEEPSEEK, "vocab_size": "272"}, "config.json field 'vocab_size' must be an integer"),
}


@pytest.fixture(scope="module")
def control_plane(s3_endpoint, tmp_path_factory):
    """A real control plane that reads model configs from the session's S3 server; a bucket with the seed
    family's tiny checkpoint files (config.json with 8 routed experts, the tokenizer), the same without its
    tokenizer, a config.json that is not JSON, and models whose config the checks refuse."""
    from moetune.service.settings import Settings

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp("ep-service")
    write_tiny_tokenizer(str(tmp / "tokenizer"))
    for name in os.listdir(tmp / "tokenizer"):
        s3.put_object(Bucket=bucket, Key=f"kimi/{name}", Body=(tmp / "tokenizer" / name).read_bytes())
    configs = {"kimi": REGISTRY["kimi_linear"].tiny_config().to_json_string(),
               "no-tokenizer": REGISTRY["kimi_linear"].tiny_config().to_json_string(),
               "llama": json.dumps({"model_type": "llama"}), "not-json": "{'model_type': 'kimi_linear'",
               "awq": json.dumps({**REGISTRY["deepseek_v3"].tiny_config().to_dict(),
                                  "quantization_config": {"quant_method": "awq"}})}
    configs.update({name: json.dumps(config) for name, (config, _) in MALFORMED.items()})
    configs.update({family: REGISTRY[family].tiny_config().to_json_string() for family in ("qwen3_moe", "kimi_k25")})
    for model, config in configs.items():
        s3.put_object(Bucket=bucket, Key=f"{model}/config.json", Body=config)
    settings = Settings(database_url=f"sqlite:///{tmp}/moetune.db", api_tokens=API_TOKENS, scheduler_enabled=False,
                        default_output_uri=f"s3://{bucket}/out", s3_endpoint_url=s3_endpoint)
    with run_service(settings) as running:
        yield running, bucket


def _post(control_plane, model: str, **fields) -> httpx.Response:
    running, bucket = control_plane
    body = {"model": f"s3://{bucket}/{model}", "training_file": f"s3://{bucket}/train.jsonl", **fields}
    return httpx.post(running.url + JOBS, json=body, headers={"Authorization": "Bearer tok-a"}, timeout=30)


EP3_OF_6 = {"parallelism": {"num_workers": 6, "expert_parallel_size": 3}, "training": {"global_batch_size": 6}}


@pytest.mark.parametrize("model, fields, param, words", [
    ("kimi", EP3_OF_6, "parallelism.expert_parallel_size", "8 routed experts"),
    ("kimi", {"lora": {"target_modules": ["q_proj", "wq"]}}, "lora.target_modules", "'wq'"),
    ("kimi", {"output_uri": "s3://no-such-bucket-here/out"}, "output_uri", "its bucket does not exist"),
    ("kimi", {"lora": {"vision": "projector"}}, "lora.vision",
     "'projector' puts LoRA on the model's vision tower, but moetune trains 'kimi_linear' models on text only"),
    ("llama", {}, "model",
     "model_type 'llama' is not supported; supported: deepseek_v3, deepseek_v32, deepseek_v4, glm5_next"),
    ("not-json", {}, "model", "config.json is not JSON"),
    ("no-tokenizer", {}, "model", "has no tokenizer files (one of tokenizer.json, tokenizer.model"),
    ("awq", {}, "model", "quant_method 'awq' is not supported; supported: fp8 (block scales), compressed-tensors"),
    *((name, {}, "model", words) for name, (_, words) in MALFORMED.items()),
    # names the family has in other configs, not in this one (the driver refused them once the job had started):
    # qwen3_moe without a dense layer has no MLP projections (no shared experts), K2.5's MLA has a q_lora_rank
    ("qwen3_moe", {"lora": {"target_modules": ["q_proj", "gate_proj"]}}, "lora.target_modules",
     "no linear module named 'gate_proj' in this qwen3_moe model; its linear modules: k_proj, o_proj, q_proj, v_proj"),
    ("kimi_k25", {"lora": {"target_modules": ["q_proj"]}}, "lora.target_modules",
     "no linear module named 'q_proj' in this kimi_k25 model; its linear modules: down_proj, gate_proj, "
     "kv_a_proj_with_mqa, kv_b_proj, o_proj, q_a_proj, q_b_proj, up_proj"),
])
def test_config_dependent_rules_are_422_at_submission(control_plane, model, fields, param, words):
    response = _post(control_plane, model, **fields)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_valid_expert_parallel_job_is_accepted(control_plane):
    response = _post(control_plane, "kimi", lora={"train_experts": True, "target_modules": ["q_proj", "o_proj"]},
                     parallelism={"num_workers": 4, "expert_parallel_size": 4}, training={"global_batch_size": 4})
    assert response.status_code == 200, response.text


def test_unreadable_config_defers_to_the_driver(control_plane):
    """No config.json readable at submission (a bucket storage cannot vouch for: a missing folder in a bucket it
    lists is a 422): the job is accepted; the driver applies the same rule later."""
    running, bucket = control_plane
    body = {"model": "s3://no-such-bucket-ep3/model", "training_file": f"s3://{bucket}/train.jsonl", **EP3_OF_6}
    accepted = httpx.post(running.url + JOBS, json=body, headers={"Authorization": "Bearer tok-a"}, timeout=30)
    assert accepted.status_code == 200, accepted.text
    spec = JobCreate(model="s3://b/m", training_file="s3://b/t.jsonl", **EP3_OF_6)
    with pytest.raises(JobError) as err:
        check_supported(REGISTRY["kimi_linear"].tiny_config().to_dict(), spec.lora, spec.parallelism)
    assert err.value.param == "parallelism.expert_parallel_size" and "8 routed experts" in err.value.message


@pytest.mark.parametrize("model_type, refused", [("kimi_linear", True), ("kimi_k25", True), ("qwen3_5_moe", False)])
def test_the_driver_refuses_lora_vision_without_a_vision_tower_it_trains(model_type, refused):
    """The same rule in the driver's check: a text-only family, and kimi_k25 (a vision tower moetune feeds no
    image), refuse lora.vision="all"; qwen3_5_moe takes it."""
    spec = JobCreate(model="s3://b/m", training_file="s3://b/t.jsonl", lora={"vision": "all"})
    config = REGISTRY[model_type].tiny_config().to_dict()
    try:
        check_supported(config, spec.lora, spec.parallelism)
    except JobError as err:
        assert refused and err.param == "lora.vision", err
        assert "'all' puts LoRA on the model's vision tower, but moetune trains" in err.message
    else:
        assert not refused


def test_the_driver_checks_the_tokenizer_and_the_output_again(control_plane, tmp_path):
    """What storage did not answer at submission, the driver's checks refuse before any worker starts: a checkpoint
    without a tokenizer, a tokenizer that is not the model's (vocab_size 4x its size), an output bucket that is
    not there."""
    from moetune.workers.entry.checks import check_output, check_tokenizer

    _, bucket = control_plane
    config = REGISTRY["kimi_linear"].tiny_config().to_dict()
    check_tokenizer(f"s3://{bucket}/kimi", config, str(tmp_path / "a"))
    check_output(f"s3://{bucket}/out/ftjob-1")
    cases = [(lambda: check_tokenizer(f"s3://{bucket}/no-tokenizer", config, str(tmp_path / "b")), "model",
              "has no tokenizer files"),
             (lambda: check_tokenizer(f"s3://{bucket}/kimi", {**config, "vocab_size": 4 * config["vocab_size"]},
                                     str(tmp_path / "c")),
              "model", "it is not this model's tokenizer"),
             (lambda: check_output("s3://no-such-bucket-here/out"), "output_uri", "is not writable")]
    for check, param, words in cases:
        with pytest.raises(JobError) as err:
            check()
        assert err.value.param == param and words in err.value.message


def test_the_driver_names_a_malformed_config_field_as_submission_does(control_plane):
    """The driver reads config.json again before any worker starts (the control plane skips what storage cannot
    answer): the same words, not transformers' validation error or a traceback."""
    from moetune.workers.model_config import read_remote_config

    _, bucket = control_plane
    for name, (_, words) in MALFORMED.items():
        with pytest.raises(JobError) as err:
            read_remote_config(f"s3://{bucket}/{name}")
        assert (err.value.code, err.value.param) == ("invalid_model", "model") and words in err.value.message, name
