"""`make demo` runs `moetune demo`: the whole embedded default, in its own S3 server, Ray head and control plane, on
a tiny Kimi K3 (the seed model) in its released format."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.ray_job


def test_demo_command_succeeds_and_learns(tmp_path):
    moetune = Path(sys.executable).with_name("moetune")
    result = subprocess.run([str(moetune), "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=420)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "status: succeeded" in out
    # rich wraps the console's lines at any space
    assert re.search(r"Generated\s+a\s+tiny\s+kimi_k3\s+MoE\s+checkpoint\s+\(routed\s+experts\s+in\s+MXFP4\)", out)
    kept = re.search(r"mxfp4-pack-quantized\s+base:\s+([\d.]+)\s+MiB\s+kept\s+quantized", out)
    assert kept and float(kept[1]) > 0, out[-3000:]  # the job trained on the packed experts
    first, last = map(float, re.search(r"loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < first - 1.0
    adapter = tmp_path / ".moetune" / "demo-adapter"
    weights = load_file(adapter / "adapter_model.safetensors")
    assert any("lora_B" in name and t.abs().sum() > 0 for name, t in weights.items())  # B starts at zero
    # the demo ends by asking the tuned model and its base the same question through the openai SDK
    tuned = re.search(r"chat tuned \((ft:tiny-kimi-k3:demo:ftjob-\w+)\): '(.*)'", out)
    base = re.search(r"chat base \(tiny-kimi-k3\): '(.*)'", out)
    assert tuned and base, out[-3000:]
    assert tuned.group(2) and tuned.group(2) != base.group(1)  # training changed what it answers
