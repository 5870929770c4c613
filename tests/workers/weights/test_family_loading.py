"""Every supported family's checkpoint, as transformers' own `save_pretrained` writes it, streams into exactly the
model `from_pretrained` builds: the name mapper against transformers' loader, whole and as one EP rank's share."""

import json
import shutil

import pytest
import torch

from moetune.workers.families import REGISTRY, auto_model_class
from moetune.workers.experts.placement import placement_at
from moetune.workers.weights.loader import expert_shares, stream_model
from bench.support.tiny_models import batch, plain_model
from tests.support.families import kimi_k2_release_config


def _streams_into(uri: str, reference, config: dict):
    """The checkpoint at `uri` streams into exactly `reference`'s state, whole and as EP rank 1 of 2 (the fused
    [E, ...] expert parameters: that rank's rows); returns the whole model."""
    expected = reference.state_dict()
    rank_1 = placement_at(config, 2, 1)
    assert rank_1.count < rank_1.num_experts  # the config's expert count was read
    for placement in (rank_1, None):
        streamed = stream_model(uri, torch.device("cpu"), torch.float32, placement, cache_dir="")
        assert type(streamed.model) is type(reference) and not streamed.plan.unexpected
        shares = expert_shares(reference, placement)
        got = streamed.model.state_dict()
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            want = expected[name][shares[name].local] if name in shares else expected[name]
            assert torch.equal(tensor, want), name
    return streamed.model


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_streamed_model_equals_from_pretrained(family, tmp_path):
    fam = REGISTRY[family]
    plain_model(fam).save_pretrained(str(tmp_path), max_shard_size="200KB")
    reference = auto_model_class(fam.tiny_config()).from_pretrained(str(tmp_path), dtype=torch.float32)
    _streams_into(f"file://{tmp_path}", reference, reference.config.to_dict())


def test_a_kimi_k2_release_streams_into_transformers_deepseek_v3(tmp_path):
    """Kimi-K2 / K2-Thinking say model_type "kimi_k2" (DeepSeek-V3's architecture, which transformers builds only
    as deepseek_v3) and carry the release's other fields: streamed as released, the model equals transformers'
    DeepseekV3ForCausalLM on the same files with the model_type Moonshot tells other frameworks to write; the
    control plane's checks and `models inspect` accept it."""
    from transformers import DeepseekV3ForCausalLM

    from moetune.api.families import check_model_spec
    from moetune.api.models.job_create import JobCreate
    from moetune.api.models.run_config import resolve_run_config
    from moetune.workers.weights.push import inspect

    release, renamed = tmp_path / "kimi-k2", tmp_path / "as-deepseek-v3"
    plain_model(REGISTRY["deepseek_v3"]).save_pretrained(str(release), max_shard_size="200KB")
    config = kimi_k2_release_config(json.loads((release / "config.json").read_text()))
    (release / "config.json").write_text(json.dumps(config))
    shutil.copytree(release, renamed)
    (renamed / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    reference = DeepseekV3ForCausalLM.from_pretrained(str(renamed), dtype=torch.float32).eval()
    model = _streams_into(f"file://{release}", reference, config)
    ids = batch(0, 0, vocab=config["vocab_size"])["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)

    spec = resolve_run_config(JobCreate(model=f"file://{release}", training_file="file:///t.jsonl",
                                        lora={"target_modules": ["q_a_proj", "kv_b_proj"]},
                                        parallelism={"num_workers": 2, "expert_parallel_size": 2}), 0)
    check_model_spec(config, spec.lora, spec.parallelism)
    report = inspect(f"file://{release}", ep=2)
    assert report["model_type"] == "kimi_k2" and report["experts_per_layer"] == config["n_routed_experts"]
