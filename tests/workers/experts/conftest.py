import pytest
import torch

from moetune.workers.families import REGISTRY
from moetune.workers.tiny import write_tiny_multimodal_checkpoint
from tests.workers.experts.cases import (
    BUILDER_CASES,
    IMAGE_CASES,
    IMAGELESS_RANK_CASES,
    RELEASED_CASES,
    RESUME_CASES,
    SAVED_CASES,
    TRAIN_CASES,
    TUNER_START_CASES,
)
from bench.support.harness import launch, run_cases, write_released_checkpoint
from bench.support.image_batches import wide_vision


@pytest.fixture(scope="session")
def ep_runs(tmp_path_factory):
    """Runs every case of tests.workers.experts.cases in one start of two processes; returns case id -> (out dir,
    per-rank results)."""
    out = tmp_path_factory.mktemp("ep-runs")
    cases = [(case, "train", fam, job.model_dump_json(), skew) for case, (fam, job, skew) in TRAIN_CASES.items()]
    cases += [(case, "resume", fam, job.model_dump_json(), False) for case, (fam, job) in RESUME_CASES.items()]
    for runner, more in (("saved", SAVED_CASES), ("tuner_start", TUNER_START_CASES)):
        cases += [(case, runner, fam, job.model_dump_json(), False) for case, (fam, job) in more.items()]
    for case, (fam, job) in RELEASED_CASES.items():  # their "family" is the checkpoint's folder, the case's "base"
        cases.append((case, "resume", write_released_checkpoint(str(out / case / "base"), fam), job.model_dump_json(),
                      False))
    for case, (fam, job) in BUILDER_CASES.items():  # released format: Kimi K3's experts stay MXFP4-packed
        cases.append((case, "builder", write_released_checkpoint(str(out / case / "base"), fam), job.model_dump_json(),
                      False))
    cases.append(("export-ep2", "export", "qwen3_moe", "{}", False))  # bench.support.export_check's own job
    for case, (fam, job) in IMAGE_CASES.items():  # their runner takes the checkpoint folder for the family
        model_dir = write_tiny_multimodal_checkpoint(str(out / f"{case}-model"), REGISTRY[fam].tiny_config)
        cases.append((case, "image", model_dir, job.model_dump_json(), False))
    for case, (fam, job) in IMAGELESS_RANK_CASES.items():
        model_dir = write_tiny_multimodal_checkpoint(str(out / f"{case}-model"), wide_vision(REGISTRY[fam].tiny_config))
        cases.append((case, "image", model_dir, job.model_dump_json(), True))
    launch(run_cases, 2, cases, str(out))
    return lambda case: (out / case, [torch.load(out / case / f"rank{r}.pt") for r in range(2)])
