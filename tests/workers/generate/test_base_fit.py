"""Serving refuses a base its device cannot hold before reading a weight (workers.planner.serving): Kimi K3 as
released (examples/kimi-k3/config.json, ~1.5 TB of weights at EP=1) whose checkpoint index names 96 shards that were
never written, so any attempt to read one would fail otherwise; the refusal names both sizes."""

import json
import re
from pathlib import Path

import pytest
import torch

from moetune.workers.lora.row_slots import RowSelection
from moetune.workers.generate.loading import load_base
from moetune.workers.model import load_dtype
from moetune.workers.planner.serving import BaseTooLargeError, served_base_bytes
from moetune.workers.reporting.step_figures import memory_budget_bytes

RELEASE = Path(__file__).parents[3] / "examples" / "kimi-k3" / "config.json"


def _k3_without_weights(folder: Path) -> dict:
    config = json.loads(RELEASE.read_text())
    (folder / "config.json").write_text(json.dumps(config))
    shards = [f"model-{i:05d}-of-00096.safetensors" for i in range(1, 97)]
    index = {"metadata": {"total_size": 1_450_000_000_000},
             "weight_map": {f"language_model.model.layers.{i}.weight": shard for i, shard in enumerate(shards)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return config


def test_a_base_larger_than_the_device_is_refused_naming_the_sizes(tmp_path):
    config = _k3_without_weights(tmp_path)
    device = torch.device("cpu")
    with pytest.raises(BaseTooLargeError) as refused:
        load_base(str(tmp_path), device, RowSelection(), 2)
    needed = served_base_bytes(config, load_dtype(device)) / 2**30
    assert needed > 1000  # the release's ~1.45 TB
    sizes = [float(s.replace(",", "")) for s in re.findall(r"([\d,]+\.\d) GiB", str(refused.value))]
    assert sizes == [round(needed, 1), round(0.9 * memory_budget_bytes(device, None) / 2**30, 1),
                     round(memory_budget_bytes(device, None) / 2**30, 1)]
    assert "EP=1" in str(refused.value) and str(tmp_path) in str(refused.value)
