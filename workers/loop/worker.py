"""The loop every Ray Train worker runs: load, LoRA, DeepSpeed ZeRO, steps, eval, checkpoints, adapter.

Rank 0 ("chief") reports to the control plane and writes what exists once (adapter, metrics);
the first worker of each node ("node leader") moves node-local files to and from storage.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from moetune.api.models import ADAPTER_DIR, METRICS_FILE, SUMMARY_FILE, JobRunSpec
from moetune.api import storage
from moetune.workers.checkpoints.save import load_checkpoint, save_adapter, save_checkpoint
from moetune.workers.data.rows import IGNORE, collate, eval_micro_batches, load_rows, tokenize_rows
from moetune.workers.engine.deepspeed import build_engine
from moetune.workers.errors import DatasetError
from moetune.workers.families.kda import apply_kernel_swaps
from moetune.workers.lora.peft_lora import trainable_model
from moetune.workers.reporting.metrics import WorkerMetrics
from moetune.workers.loop.tuner import MicroBatchLoop, token_loss_sum
from moetune.workers.model import (
    expert_parallel_rank,
    load_summary,
    load_tokenizer,
    stream_base_model,
)
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.checkpoints.run_state import (
    checkpoint_uri,
    delete_checkpoint,
    latest_checkpoint,
    mark_group_started,
    resume_reason,
    retired_checkpoints,
    retract_manifest,
    save_trainer_state,
    smallest_oom_size,
    write_manifest,
)
from moetune.workers.engine.schedule import total_steps
from moetune.workers.weights.loader import is_weight_file


class _Worker:
    def __init__(self, config: dict):
        import ray.train
        import ray.train.torch
        import torch

        os.environ.update(config["worker_env"])  # report endpoint and storage credentials
        torch.set_num_threads(config["threads"])
        self.run = JobRunSpec.model_validate_json(config["run_spec"])
        torch.manual_seed(self.run.seed)  # same LoRA init on every rank and in every rerun of the job
        self.spec, self.t = self.run.spec, self.run.spec.training
        ctx = ray.train.get_context()
        self.rank, self.world, self.local_rank = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()
        self.chief, self.node_leader = self.rank == 0, self.local_rank == 0
        self.device = ray.train.torch.get_device()
        self.reporter = Reporter(self.run.job_id) if self.chief else None
        self.metrics = WorkerMetrics(self.run.job_id, self.rank, self.local_rank, self.device, self.event)
        self.node_dir = os.path.join(tempfile.gettempdir(), "moetune", self.run.job_id)
        self.attempt = config["attempt"]  # this driver run's id (see workers.resume)

    # -------------------------------------------------------------- helpers

    def event(self, message: str, **kwargs) -> None:
        if self.chief:
            self.reporter.event(message, **kwargs)

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batches.micro_batch_size  # the tuner's current size (exported as a metric)

    @property
    def grad_accum_steps(self) -> int:
        return self.micro_batches.grad_accum_steps

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def all_sum(self, *values: float) -> list[float]:
        return self._all_reduce(values, "SUM")

    def all_max(self, *values: float) -> list[float]:
        return self._all_reduce(values, "MAX")

    def _all_reduce(self, values, op: str) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) for k, v in batch.items()}

    # -------------------------------------------------------------- phases

    def load(self) -> None:
        model_dir = os.path.join(self.node_dir, "model")
        self.event("Loading model", data={"model": self.spec.model})
        if self.node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            storage.download_dir(self.spec.model, model_dir, skip=is_weight_file)  # tokenizer + config only
        self.barrier()
        self.tokenizer = load_tokenizer(model_dir)
        # Each rank streams its own share of the weights (workers.weights): non-expert tensors, its experts.
        ep_size = self.spec.parallelism.expert_parallel_size
        streamed = stream_base_model(self.spec.model, self.device, expert_parallel_rank(ep_size), ep_size)
        message, data = load_summary(streamed, ep_size)
        data["bytes_from_storage_all_ranks"] = int(self.all_sum(streamed.stats.bytes_from_storage)[0])
        self.event(message, data=data)
        model = streamed.model
        if self.t.custom_kernels:
            swapped = {name: n for name, n in apply_kernel_swaps(model).items() if n}
            if swapped:
                self.event("Custom kernels swapped in: " + ", ".join(f"{k} ({n} modules)" for k, n in swapped.items()))
        self.model = trainable_model(model, self.spec)
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.event(f"Model loaded: {total:,} parameters, {trainable:,} trainable (LoRA)",
                   data={"parameters": total, "trainable_parameters": trainable})

    def load_data(self) -> None:
        seq_len = self.t.seq_len
        self.train_set, dropped = tokenize_rows(self.tokenizer, load_rows(self.spec.training_file, "training_file"), seq_len)
        if not self.train_set:
            raise DatasetError("training_file", f"training_file {self.spec.training_file}: no row has a trained "
                                                f"token within seq_len={seq_len}")
        if dropped:
            self.event(f"{dropped} training rows have no trained token within seq_len={seq_len}; skipped",
                       level="warn")
        self.valid_set = []
        if self.spec.validation_file:
            self.valid_set, _ = tokenize_rows(self.tokenizer, load_rows(self.spec.validation_file, "validation_file"),
                                          seq_len)

    def evaluate(self) -> float:
        """Token-weighted mean loss over the whole validation set, across ranks."""
        import torch

        loss_sum = count = 0.0
        self.engine.eval()
        with torch.no_grad():
            for indices in eval_micro_batches(len(self.valid_set), self.micro_batch_size, self.rank, self.world):
                real = [self.valid_set[i] for i in indices if i is not None]
                # A rank whose share ran out still runs a forward: under ZeRO-3 it is a collective.
                batch = self.to_device(collate(real or self.valid_set[:1], self.tokenizer.pad_token_id))
                logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                if real:
                    loss_sum += token_loss_sum(logits, batch["labels"]).item()
                    count += (batch["labels"][:, 1:] != IGNORE).sum().item()
        self.engine.train()
        loss_sum, count = self.all_sum(loss_sum, count)
        return loss_sum / count

    def checkpoint(self, step: int, record: dict, paused: bool = False) -> None:
        local = os.path.join(self.node_dir, "checkpoints", f"step-{step}")
        uri = checkpoint_uri(self.run.output_uri, step)
        save_checkpoint(self.engine, local, is_writer=self.chief)
        if self.chief:
            save_trainer_state(local, step=step, trained_tokens=record["trained_tokens"], history=self.history,
                               attempt=self.attempt, paused=paused, micro_batches=self.micro_batches.state())
            retract_manifest(uri)
        self.barrier()
        if self.node_leader:
            storage.upload_dir(local, uri)
            shutil.rmtree(local)
        self.barrier()  # every node's files are up: only now may the manifest say the checkpoint is complete
        if self.chief:
            write_manifest(uri, step)
            keep = self.run.spec.training.keep_checkpoints
            retired = retired_checkpoints(self.run.output_uri, keep) if keep else []
            listed = self.reporter.checkpoint(step, uri, retired, train_loss=record["train_loss"],
                                              valid_loss=record.get("valid_loss"))
            if listed or self.reporter.url is None:  # never delete what the control plane may still list
                for old in retired:
                    delete_checkpoint(self.run.output_uri, old)

    def resume(self) -> tuple[int, int]:
        """Loads the newest complete checkpoint into the engine, if any: (its step, trained tokens so far).

        The chief picks it and every rank follows, so a checkpoint completing meanwhile cannot split the group.
        """
        point = latest_checkpoint(self.run.output_uri) if self.chief else None
        restarted = self.chief and mark_group_started(self.run.output_uri, self.attempt)
        (step,) = self.all_sum(point.step if point else 0)
        if not step:
            if restarted:
                self.event("Restarted from step 1 after a worker failure (no complete checkpoint yet)", level="warn")
            return 0, 0
        step, local = int(step), os.path.join(self.node_dir, "resume")
        if self.node_leader:
            storage.download_dir(checkpoint_uri(self.run.output_uri, step), local)
        self.barrier()
        load_checkpoint(self.engine, local)
        self.barrier()
        if self.node_leader:
            shutil.rmtree(local)
        if not self.chief:
            return step, 0  # only the chief reports token counts and keeps the metrics history
        self.history, self.resumed_tuner = point.state["history"], point.state.get("micro_batches")
        self.event(f"Resumed from checkpoint step-{step} after {resume_reason(point, restarted)}",
                   level="warn" if restarted else "info", data={"step": step, "checkpoint": point.uri})
        return step, point.state["trained_tokens"]

    def restore_tuner(self) -> None:
        """The chief's view (the checkpoint's tuner state, sizes that failed with an OOM) on every rank."""
        tuned = (self.resumed_tuner or {}) if self.chief else {}
        failed = (smallest_oom_size(self.run.output_uri) or 0) if self.chief else 0
        size, ceiling, failed = self.all_sum(tuned.get("size", 0), tuned.get("ceiling", 0), failed)
        self.micro_batches.restore(int(size), int(ceiling), int(failed))

    def pause_requested(self) -> bool:
        """Whether the control plane asked to pause in its answer to the chief's last report (all ranks agree)."""
        (asked,) = self.all_sum(float(self.chief and self.reporter.control == "pause"))
        return asked > 0

    def train(self) -> bool:
        """Runs the steps left after the newest complete checkpoint; False when it stopped for a pause."""
        t = self.t
        steps = total_steps(len(self.train_set), t.global_batch_size, t.max_steps, t.n_epochs)
        self.engine, scheduler = build_engine(self.model, self.spec, self.world, steps,
                                              bf16=self.device.type == "cuda")
        self.micro_batches = MicroBatchLoop(self, self.engine)
        self.event(f"Training started: {steps} steps on {self.world} workers, {self.micro_batches.describe()}",
                   data={"total_steps": steps, "train_examples": len(self.train_set), "workers": self.world})
        self.history, self.resumed_tuner = [], None
        done, trained_tokens = self.resume()
        if self.micro_batches.tuner:
            self.restore_tuner()
        for step in range(done + 1, steps + 1):
            started, learning_rate = time.perf_counter(), scheduler.get_last_lr()[0]
            loss_sum, loss_tokens, tokens = self.micro_batches.run_step(step)
            trained_tokens += int(tokens)
            record = {"step": step, "total_steps": steps, "train_loss": loss_sum / loss_tokens,
                      "learning_rate": learning_rate,
                      "tokens_per_second": tokens / (time.perf_counter() - started),
                      "trained_tokens": trained_tokens}
            if self.valid_set and ((t.eval_every and step % t.eval_every == 0) or step == steps):
                record["valid_loss"] = self.evaluate()
            if self.chief:
                self.reporter.metrics(**record)
                self.history.append(record)
            self.metrics.step_end(self, record, time.perf_counter() - started)
            pause = step < steps and self.pause_requested()
            if pause or (t.checkpoint_every and step % t.checkpoint_every == 0):
                self.checkpoint(step, record, paused=pause)
            if pause:
                self.event(f"Paused at step {step}: checkpoint step-{step} written, workers stopping")
                return False
        return True

    def finish(self) -> None:
        local = os.path.join(self.node_dir, ADAPTER_DIR)
        save_adapter(self.engine, local, is_writer=self.chief)
        if self.chief:
            storage.upload_dir(local, storage.join(self.run.output_uri, ADAPTER_DIR))
            lines = "".join(json.dumps(r) + "\n" for r in self.history)
            storage.write_bytes(storage.join(self.run.output_uri, METRICS_FILE), lines.encode())
            last = self.history[-1]
            summary = {k: last.get(k) for k in ("step", "train_loss", "valid_loss", "trained_tokens")}
            summary["first_train_loss"] = self.history[0]["train_loss"]
            storage.write_bytes(storage.join(self.run.output_uri, SUMMARY_FILE), json.dumps(summary).encode())
            self.event("Training finished", data=summary)
        self.barrier()
        if self.node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)


def train_loop_per_worker(config: dict) -> None:
    """Entry point for ray.train.torch.TorchTrainer; `config` comes from moetune.workers.entry.driver."""
    worker = _Worker(config)
    try:
        worker.load()
        worker.metrics.training_started(worker.model)
        worker.load_data()
        if worker.train():
            worker.finish()
    finally:
        worker.metrics.close()
