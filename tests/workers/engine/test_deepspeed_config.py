"""The DeepSpeed config of a bf16 (GPU) job: gradients accumulate and reduce in fp32, as DeepSpeed itself parses
the config (its own DeepSpeedConfig), not only as written."""

import pytest
import torch

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.workers.engine.deepspeed import deepspeed_config


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_bf16_jobs_accumulate_and_reduce_gradients_in_fp32(zero_stage):
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = resolve_run_config(JobCreate(model="file:///m", training_file="file:///t.jsonl",
                                        training={"global_batch_size": 8, "micro_batch_size": 2},
                                        parallelism={"num_workers": 1, "zero_stage": zero_stage}), 0)
    # no process group here: DeepSpeed checks the batch sizes against a world of one rank
    parsed = DeepSpeedConfig(deepspeed_config(spec.training, spec.parallelism, world_size=1, bf16=True))
    assert parsed.bfloat16_config.enabled and parsed.zero_optimization_stage == zero_stage
    assert parsed.grad_accum_dtype == "fp32" and parsed.communication_data_type == torch.float32
    fp32 = DeepSpeedConfig(deepspeed_config(spec.training, spec.parallelism, world_size=1, bf16=False))
    assert fp32.grad_accum_dtype is None and fp32.communication_data_type is None
