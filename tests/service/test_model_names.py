"""OpenAI-shaped model names and the base-model registry's parsing."""

import pytest

from moetune.api.model_names import FineTunedName, derive_base_name, fine_tuned_name, parse_fine_tuned_name
from moetune.service.base_models import BaseModels, parse_base_models


def test_fine_tuned_names_round_trip():
    name = fine_tuned_name("kimi-linear-48b", "support bot", "team-a", "ftjob-abc123")
    assert name == "ft:kimi-linear-48b:support-bot:ftjob-abc123"
    assert parse_fine_tuned_name(name) == FineTunedName("kimi-linear-48b", "support-bot", "ftjob-abc123")
    assert fine_tuned_name("b", None, "team-a", "ftjob-1") == "ft:b:team-a:ftjob-1"  # no suffix: the tenant
    for not_ours in ("kimi-linear-48b", "ft:a:b", "ft:a::ftjob-1", "ft:a:b:c:d"):
        assert parse_fine_tuned_name(not_ours) is None


def test_base_names_come_from_the_registry_else_the_uri():
    assert derive_base_name("s3://bucket/models/Kimi-Linear-48B/") == "Kimi-Linear-48B"
    assert derive_base_name("file:///data/my model:v2") == "my-model-v2"
    bases = BaseModels({"kimi": "s3://models/Kimi-Linear-48B"})
    assert bases.name("s3://models/Kimi-Linear-48B/") == "kimi" and bases.name("s3://other/Qwen3") == "Qwen3"
    assert bases.name("kimi") == "kimi"  # a job created with the registered name keeps it
    assert bases.uri("kimi") == "s3://models/Kimi-Linear-48B" and bases.uri("nope") is None
    assert bases.uri("s3://x/y") == "s3://x/y"


def test_the_registry_setting_takes_json_or_pairs_and_refuses_bad_entries():
    assert parse_base_models('{"a": "s3://m/a"}') == {"a": "s3://m/a"}
    assert parse_base_models("a=s3://m/a, b.2=file:///m/b") == {"a": "s3://m/a", "b.2": "file:///m/b"}
    with pytest.raises(ValueError, match="name=uri"):
        parse_base_models("a")
    with pytest.raises(ValueError, match="may only contain"):
        parse_base_models("a:b=s3://m/a")
    with pytest.raises(ValueError, match="must be a URI"):
        parse_base_models("a=models/a")
