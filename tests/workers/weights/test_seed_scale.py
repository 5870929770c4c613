"""The seed-scale model (examples/seed-model.config.json: kimi_linear shape, 2.78T parameters, 896 experts, top-16)
without seed-scale memory: its empty model is built on the meta device, and `moetune models inspect` of a
header-only sparse checkpoint of it (every tensor's bytes a hole in the file) reports it in < 2 GiB, with what the
seed's own LoRA recipe adapts on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from moetune.workers.weights.loader import empty_model
from tests.support import REPO

SEED_CONFIG = REPO / "examples" / "seed-model.config.json"
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def _write_sparse_checkpoint(config: dict, out: str, shard_bytes: int = 200 * 2**30) -> int:
    """The model's state dict as safetensors shards whose data is never written (sparse files); returns the
    number of parameters."""
    model = empty_model(config, torch.bfloat16)
    tensors = list(model.state_dict().items())  # meta tensors: names, shapes, dtypes only
    shards, current, size = [], [], 0
    for name, t in tensors:
        if current and size + t.nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += t.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, t in shard:
            header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(out, file), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # the tensor bytes: a hole
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(p.numel() for p in model.parameters())


def test_models_inspect_reports_the_seed_model_in_under_2_gib(tmp_path):
    config = json.loads(SEED_CONFIG.read_text())
    parameters = _write_sparse_checkpoint(config, str(tmp_path))
    assert parameters == 2_783_166_526_912
    # The CLI in a fresh process, reporting its own peak RSS after the command.
    code = ("import sys\nfrom moetune.service.cli.main import main\n"
            "from moetune.workers.reporting.system import peak_rss_bytes\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(peak_rss_bytes(), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, "models", "inspect", f"file://{tmp_path}", "--ep", "64",
                          "--lora", "q_proj,v_proj,gate_proj", "--json"], capture_output=True, text=True, timeout=300,
                         check=True)
    report, peak = json.loads(out.stdout), int(out.stderr.strip().splitlines()[-1])
    assert peak < 2 * 2**30, f"inspect peaked at {peak / 2**30:.2f} GiB"
    assert report["parameters"] == parameters and report["quantization"] is None
    assert report["experts_per_layer"] == 896 and report["moe_layers"] == 59
    expert_bytes = 2 * report["expert_parameters"]  # bf16
    non_expert = report["checkpoint_bytes"] - expert_bytes
    assert len(report["bytes_per_rank"]) == 64
    assert all(n == non_expert + expert_bytes // 64 for n in report["bytes_per_rank"])
    # the seed recipe adapts the 45 KDA layers' q/v and the shared experts, no MLA layer and no routed expert
    lora = {row["layer_type"]: row for row in report["lora"]["rows"]}
    kda = lora["linear attention"]
    assert (kda["adapted_layers"], kda["adapted"]) == (45, ["q_proj", "v_proj"])
    assert (lora["full attention"]["layers"], lora["full attention"]["adapted_layers"]) == (15, 0)
    assert lora["shared experts"]["adapted_layers"] == 59 and lora["routed experts"]["adapted_layers"] == 0
    assert [w.split(" module")[0] for w in report["lora"]["warnings"]] == [
        "LoRA adapts no full attention", "LoRA adapts no routed experts"]
    assert report["lora"]["trainable_parameters"] / parameters < 2e-5  # 0.0011 %
    print(f"seed model: {parameters:,} parameters; inspect peak RSS {peak / 2**20:.0f} MiB; "
          f"{report['bytes_per_rank'][0] / 1e9:.1f} GB per rank at EP=64")
