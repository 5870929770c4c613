"""A pipeline stage's rank streams only its stage's weights (workers.weights.loader.stream_model's `held`, from
workers.pipeline.stages.stage_tensor_names): Kimi K3 as released (MXFP4 experts kept packed; its vision tower on no
stage) at 2 and 4 stages, Kimi-Linear at 2. Each stage holds its tensors as the whole model's load does and nothing
else (every other one is never allocated: still on the meta device), reads only their bytes (the stages together
read what the whole text model needs), and its forward (experts dequantized, for the stock modules) equals the whole
model's same stage on the same input."""

import pytest
import torch

from bench.support.harness import write_released_checkpoint
from moetune.workers.pipeline.split import stage_bounds
from moetune.workers.pipeline.stages import stage_module, stage_tensor_names
from moetune.workers.weights.loader import stream_model

CASES = [("kimi_k3", 2), ("kimi_k3", 4), ("kimi_linear", 2)]


def _load(folder: str, held=None, base_weights: str = "quantized"):
    streamed = stream_model(f"file://{folder}", torch.device("cpu"), torch.float32, cache_dir="", held=held,
                            base_weights=base_weights)
    return streamed.model, streamed.plan.nbytes  # the tensor bytes it reads (not the shard headers)


def _tensors(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_released_checkpoint(str(tmp_path_factory.mktemp(name)), name)
            for name in sorted({name for name, _ in CASES})}


@pytest.mark.parametrize("family, stages", CASES)
def test_each_stage_streams_only_its_own_weights(checkpoints, family, stages):
    whole, whole_bytes = _load(checkpoints[family])
    runnable = _load(checkpoints[family], base_weights="dequantized")[0]  # the stock modules' forward
    bounds = stage_bounds(whole.config.get_text_config().num_hidden_layers, stages)
    rows = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    received, read, union = (rows,), 0, set()
    with torch.no_grad():
        for stage in range(stages):
            planned = []  # the names asked of the model on the meta device (a quantized weight's, before its parts)
            model, nbytes = _load(checkpoints[family],
                                  lambda meta: planned.append(stage_tensor_names(meta, bounds, stage)) or planned[0])
            read, union = read + nbytes, union | planned[0]
            names = stage_tensor_names(model, bounds, stage)
            mine, want = _tensors(model), _tensors(whole)
            assert names and all(not mine[n].is_meta and torch.equal(mine[n], want[n]) for n in names), stage
            others = {n for n, t in mine.items() if n not in names and not t.is_meta}
            assert not others & model.state_dict().keys(), others  # what else is allocated: rotary tables
            assert nbytes < whole_bytes
            held = lambda meta: stage_tensor_names(meta, bounds, stage)  # noqa: E731 - as above, dequantized
            sent = stage_module(runnable, bounds, stage)(*received)
            got = stage_module(_load(checkpoints[family], held, "dequantized")[0], bounds, stage)(*received)
            sent = sent if isinstance(sent, tuple) else (sent,)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(sent) and all(torch.equal(g, s) for g, s in zip(got, sent)), stage
            received = sent
    # the stages share no tensor: together they read what one load of all their tensors reads, once
    assert read == _load(checkpoints[family], lambda meta: union)[1]
    assert {n for n in whole.state_dict() if n not in union} == {n for n in whole.state_dict() if "vision" in n
                                                                or "mm_projector" in n}
