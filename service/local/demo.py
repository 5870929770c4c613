"""`moetune demo`: the whole path on the embedded default, end to end.

Loopback S3 server + local Ray head + SQLite control plane; a tiny checkpoint of the seed model as released
(Kimi K3: KDA and MLA layers, Attention-Residual blocks, routed experts in MXFP4; workers.tiny) and a dataset are
generated, uploaded, and fine-tuned by a 2-worker ZeRO-2 LoRA job submitted through the SDK. `--images`: a tiny
vision-language checkpoint of the image demo's family (its image processor config, image tokens) and chat rows
asking the colour of a solid-colour image, trained with EP=2.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from moetune.api import storage
from moetune.api.client import Client
from moetune.api.models.job_create import JobCreate
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.responses import JobStatus
from moetune.api.models.training import TrainingSpec
from moetune.service.app import create_app
from moetune.service.cli.progress import follow
from moetune.service.local.demo_chat import chat_with_tuned_model, start_serving
from moetune.service.local.embedded import (
    RayHead,
    control_plane_in_thread,
    free_port,
    listening_socket,
    local_ray_head,
    local_s3_server,
    s3_env,
)
from moetune.service.settings import Settings

BUCKET = "moetune-demo"
TOKEN = "demo-token"
ADAPTER_COPY = Path(".moetune/demo-adapter")  # the demo's S3 server is gone when it exits; keep the adapter


MODELS = {False: "tiny-kimi-k3", True: "tiny-qwen3.5-moe-vl"}  # by --images
KINDS = {False: "seed", True: "images"}  # the demo family of each (workers.families.demo_family)


def make_demo_assets(work: Path, s3_url: str, images: bool) -> str:
    """The tiny checkpoint and datasets, generated and uploaded to s3://moetune-demo/ (also `moetune up
    --with-demo-assets`); returns the checkpoint's model_type."""
    # torch-heavy: only the demo needs them
    from moetune.workers.families import demo_family
    from moetune.workers.tiny import (
        tiny_image_rows,
        tiny_rows,
        write_tiny_checkpoint,
        write_tiny_dataset,
        write_tiny_multimodal_checkpoint,
    )

    if images:
        write_tiny_multimodal_checkpoint(str(work / "model"), demo_family("images").tiny_config)
    else:
        # the seed model as released, its output head at std 0.2 (last loss after the demo's 30 steps: 1.7; at 0.1: 2.7)
        write_tiny_checkpoint(str(work / "model"), seed=0, kind=KINDS[images], head_std=0.2)
    rows = tiny_image_rows if images else tiny_rows
    write_tiny_dataset(work / "train.jsonl", n_rows=256, seed=1, rows=rows)
    write_tiny_dataset(work / "valid.jsonl", n_rows=32, seed=2, rows=rows)
    storage.make_bucket(f"s3://{BUCKET}", endpoint_url=s3_url)
    storage.upload_dir(str(work / "model"), f"s3://{BUCKET}/models/{MODELS[images]}", endpoint_url=s3_url)
    for name in ("train.jsonl", "valid.jsonl"):
        storage.write_bytes(f"s3://{BUCKET}/data/{name}", (work / name).read_bytes(), endpoint_url=s3_url)
    return demo_family(KINDS[images]).model_type


def demo_job_spec(images: bool = False) -> JobCreate:
    return JobCreate(
        model=f"s3://{BUCKET}/models/{MODELS[images]}",
        training_file=f"s3://{BUCKET}/data/train.jsonl",
        validation_file=f"s3://{BUCKET}/data/valid.jsonl",
        suffix="demo",
        seed=7,
        lora=LoraSpec(rank=8, alpha=16),
        # A tiny random model needs a larger step size than the 1e-4 default to learn visibly in 30 steps; the seed
        # model's loss ends near 2.4 at 3e-3 (its tuned answer still noise), near 0.9 at 1e-2.
        training=TrainingSpec(
            max_steps=30, learning_rate=3e-3 if images else 1e-2, global_batch_size=8, micro_batch_size=2, seq_len=128,
            eval_every=10, checkpoint_every=15,
        ),
        # the image job splits the routed experts between the two workers (EP=2)
        parallelism=ParallelDims(num_workers=2, zero_stage=2, expert_parallel_size=2 if images else 1),
        output_uri=f"s3://{BUCKET}/outputs",
    )


@contextmanager
def demo_stack(work: Path, images: bool, console: Console) -> Iterator[tuple[Settings, str, RayHead]]:
    """The demo's stack up to its first request: the S3-compatible server holding the generated checkpoint and
    dataset, a Ray head, the control plane served from this process; yields (its settings, its URL, the head)."""
    with local_s3_server() as s3_url:
        env = s3_env(s3_url)
        os.environ.update(env)
        console.print(f"[bold]S3-compatible server[/] {s3_url}")
        model_type = make_demo_assets(work, s3_url, images)
        what = (f"{model_type} vision-language checkpoint, tokenizer, image processor and solid-colour image dataset"
                if images else f"{model_type} MoE checkpoint (routed experts in MXFP4), tokenizer and dataset")
        console.print(f"Generated a tiny {what}; uploaded to s3://{BUCKET}/")
        with local_ray_head(num_cpus=max(4, os.cpu_count() or 1), env=env) as head:
            console.print(f"[bold]Ray head[/] {head.gcs_address} (Jobs API {head.dashboard_url})")
            listener = listening_socket()  # held from here: the callback URL names it before the server starts
            port = listener.getsockname()[1]
            settings = Settings(
                database_url=f"sqlite:///{work / 'moetune.db'}",
                api_tokens=f"{TOKEN}:demo",
                ray_address=head.dashboard_url,
                callback_url=f"http://127.0.0.1:{port}",
                s3_endpoint_url=s3_url,
                default_output_uri=f"s3://{BUCKET}/outputs",
                base_models={MODELS[images]: f"s3://{BUCKET}/models/{MODELS[images]}"},
                serve_url=f"http://127.0.0.1:{free_port()}",
            )
            with control_plane_in_thread(create_app(settings), listener) as url:
                console.print(f"[bold]Control plane[/] {url} (token {TOKEN})")
                console.print(f"[bold]Web console[/] {url}/console (sign in with the token; open while the demo runs)")
                yield settings, url, head


def run_demo(timeout: float = 600, images: bool = False) -> int:
    """Returns the process exit code: 0 only if the job succeeded."""
    console = Console()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moetune-demo-") as tmp, \
            demo_stack(Path(tmp), images, console) as (settings, url, head):
        served = False
        client = Client(url, TOKEN)
        job = client.jobs.create(demo_job_spec(images))
        submitted = time.monotonic()
        if not images:
            start_serving(settings, MODELS[images])
        console.print(f"Submitted [bold]{job.id}[/]: 2 workers, ZeRO-2{', EP=2' if images else ''}, LoRA r=8 "
                      f"on all linear layers{' of the text model' if images else ''}")
        job, follower = follow(client, job.id, timeout=timeout, console=console)
        job_seconds = time.monotonic() - submitted
        if job.status == JobStatus.succeeded:
            shutil.rmtree(ADAPTER_COPY, ignore_errors=True)
            storage.download_dir(job.fine_tuned_model_uri, str(ADAPTER_COPY), endpoint_url=settings.s3_endpoint_url)
            # the demo ends by talking to the tuned model (the serving engine takes text models)
            served = images or chat_with_tuned_model(client, job, MODELS[images], head.dashboard_url,
                                                     TOKEN, Path(tmp) / "valid.jsonl", console)
    elapsed = time.monotonic() - start
    console.print(f"\nstatus: [bold]{job.status}[/]  (job {job_seconds:.0f}s, demo {elapsed:.0f}s)")
    if follower.losses:
        console.print(f"loss: first {follower.losses[0]:.4f} -> last {follower.losses[-1]:.4f}")
    if job.status == JobStatus.succeeded and served:
        console.print(f"model: {job.fine_tuned_model}\nadapter: {job.fine_tuned_model_uri} (copied to {ADAPTER_COPY}/)")
        return 0
    if job.error:
        console.print(f"[bold red]error[/] {job.error.code}: {job.error.message}")
    return 1
