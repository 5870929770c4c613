"""A session's driver checks its layout against the model's config.json before any worker is held (the control
plane checked it against the workers only): an expert-parallel size that does not divide the routed experts fails
the session naming the field, as a job's driver does."""

from __future__ import annotations

import pytest

from moetune.api.models.training_sessions import SessionCreate, SessionRunSpec
from moetune.workers.errors import JobError
from moetune.workers.families import REGISTRY
from moetune.workers.sessions.driver import run_session


def _session(model_dir, **parallelism) -> SessionRunSpec:
    return SessionRunSpec(session_id="ts_1", attempt=1, seed=0, output_uri="file:///unused/ts_1",
                          spec=SessionCreate(model=f"file://{model_dir}", parallelism=parallelism))


def test_a_layout_the_model_cannot_divide_fails_before_any_worker(tmp_path):
    config = REGISTRY["kimi_linear"].tiny_config()
    (tmp_path / "config.json").write_text(config.to_json_string())
    with pytest.raises(JobError) as refused:  # raised before the trainer is built or Ray is asked for workers
        run_session(_session(tmp_path, num_workers=3, expert_parallel_size=3))
    assert refused.value.param == "parallelism.expert_parallel_size"
    assert f"the model's {config.num_experts} routed experts" in refused.value.message
