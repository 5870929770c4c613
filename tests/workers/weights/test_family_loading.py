"""Every supported family's checkpoint, as transformers' own `save_pretrained` writes it, streams into exactly the
model `from_pretrained` builds: the name mapper against transformers' loader, whole and as one EP rank's share."""

import pytest
import torch

from moetune.workers.families import REGISTRY, auto_model_class
from moetune.workers.parallel.placement import placement_at
from moetune.workers.weights.loader import expert_shares, stream_model
from tests.support.families import plain_model


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_streamed_model_equals_from_pretrained(family, tmp_path):
    fam = REGISTRY[family]
    plain_model(fam).save_pretrained(str(tmp_path), max_shard_size="200KB")
    reference = auto_model_class(fam.tiny_config()).from_pretrained(str(tmp_path), dtype=torch.float32)
    expected = reference.state_dict()
    config = reference.config.to_dict()
    for placement in (None, placement_at(config, 2, 1)):
        streamed = stream_model(f"file://{tmp_path}", torch.device("cpu"), torch.float32, placement, cache_dir="")
        assert type(streamed.model) is type(reference) and not streamed.plan.unexpected
        shares = expert_shares(reference, placement)  # fused [E, ...] parameters, of which this rank holds its rows
        got = streamed.model.state_dict()
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            want = expected[name][shares[name].local] if name in shares else expected[name]
            assert torch.equal(tensor, want), name
