"""What the driver checks before any worker starts: the rules of submission again (the control plane skips those
it cannot check when storage is unreachable), the model's config and tokenizer, the LoRA targets, the output
location and every data row (training, validation and evaluation files), with every image it names."""

from __future__ import annotations

import os
import tempfile
from functools import partial

from moetune.api import storage
from moetune.api.data_rows import evaluation_row_problem, training_row_problem
from moetune.api.checkpoint_files import check_tokenizer_files, check_tokenizer_size
from moetune.api.errors import ErrorCode
from moetune.api.families import images_refusal
from moetune.api.models.base import SpecError
from moetune.api.models.job_run import JobRunSpec
from moetune.api.preference import method_type
from moetune.workers.data.images import ImageCheck
from moetune.workers.data.rows import load_rows
from moetune.workers.errors import JobError
from moetune.workers.lora.coverage import Coverage
from moetune.workers.lora.peft_lora import check_targets_on_config
from moetune.workers.methods import method_for
from moetune.workers.methods.multimodal import SupervisedImageMethod
from moetune.workers.model import load_tokenizer
from moetune.workers.model_config import check_supported, read_remote_config
from moetune.workers.settings import WorkerSettings
from moetune.workers.weights.loader import streamed_or_unused


def validate(run: JobRunSpec, settings: WorkerSettings) -> tuple[int, Coverage]:
    """Fails fast, before any worker starts: returns the number of training rows and what LoRA adapts. `settings`:
    the tenant's storage access and the image limits, for the images the data files name."""
    job = run.config
    config = read_remote_config(job.model)
    check_supported(config, job.lora, job.parallelism)
    lora = check_targets_on_config(config, job.lora)
    check_output(run.output_uri)
    with tempfile.TemporaryDirectory() as model_dir:
        tokenizer = check_tokenizer(job.model, config, model_dir)
        method = method_for(job.method, job.training, tokenizer, model_dir)
        too_long = method.too_long if isinstance(method, SupervisedImageMethod) else None
        refusal = images_refusal(config, job.parallelism)
        images = ImageCheck(settings.uri_access, settings.image_limits, refusal, too_long)
        problem = training_row_problem(method_type(job.method))  # preference rows for dpo, SFT rows otherwise
        rows = len(load_rows(job.training_file, "training_file", images, problem))
        if job.validation_file:
            load_rows(job.validation_file, "validation_file", images, problem)
    if job.evaluation:
        load_rows(job.evaluation.file, "evaluation.file",
                  problem=partial(evaluation_row_problem, metrics=job.evaluation.metrics))
    return rows, lora


def check_tokenizer(model_uri: str, config: dict, local: str):
    """The checkpoint's tokenizer, checked to load from its files (downloaded into `local` as the workers fetch
    them, with the processor's) and to fit the model's vocabulary."""
    storage.download_dir(model_uri, local, skip=streamed_or_unused)
    try:
        check_tokenizer_files(os.listdir(local), model_uri)
        tokenizer = load_tokenizer(local)
        check_tokenizer_size(len(tokenizer), config, model_uri)
    except SpecError as e:
        raise JobError(ErrorCode.invalid_model, e.message, e.param) from None
    return tokenizer


def check_output(output_uri: str) -> None:
    try:
        storage.check_writable(output_uri)
    except (FileNotFoundError, PermissionError) as e:
        raise JobError(ErrorCode.invalid_request, f"output_uri: {output_uri} is not writable ({e})",
                       "output_uri") from None
