"""The loop every Ray Train worker runs, phase by phase: load, data, train (steps, evaluation, checkpoints), finish.

Rank 0 ("chief") reports to the control plane and writes what exists once (adapter, metrics);
the first worker of each node ("node leader") moves node-local files to and from storage.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace

import ray.train
import ray.train.torch
import torch

from moetune.api import storage
from moetune.api.layout import ADAPTER_DIR, adapter_uri, checkpoint_uri, metrics_uri, step_dir, summary_uri
from moetune.api.models.job_run import JobRunSpec
from moetune.api.report import EVAL_PREFIX
from moetune.kernels.quant import held, held_names
from moetune.workers.checkpoints import run_state
from moetune.workers.checkpoints.save import load_checkpoint, save_adapter, save_checkpoint
from moetune.workers.checkpoints.stage_relay import PipelinedModel
from moetune.workers.data.rows import load_rows
from moetune.workers.data.sampling import step_examples
from moetune.workers.engine.deepspeed import build_engine, full_shape
from moetune.workers.engine.pipeline import StageGroups, StagePipeline, StageTraffic
from moetune.workers.engine.schedule import total_steps
from moetune.workers.errors import DatasetError
from moetune.workers.evaluation.alignment import check_alignment, verdict
from moetune.workers.evaluation.generation import evaluate_generation, load_eval_rows
from moetune.workers.loop.collectives import Collectives
from moetune.workers.loop.faults import fault_hook
from moetune.workers.loop.context_split import ContextSplit
from moetune.workers.loop.pipeline_step import PipelineStepRunner
from moetune.workers.loop.step import RankPlace, StepRunner
from moetune.workers.methods import method_for
from moetune.workers.model import TRAIN, WeightsSource, build_model, load_tokenizer
from moetune.workers.pipeline.stages import model_stage_bounds, stage_module
from moetune.workers.reporting.metrics import WorkerMetrics
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.reporting.step_figures import memory_budget_bytes, step_figures
from moetune.workers.settings import enter_worker_env
from moetune.workers.weights.loader import load_summary, streamed_or_unused


class _Worker:
    def __init__(self, config: dict):
        self.settings = enter_worker_env(config["worker_env"])  # report endpoint and storage credentials
        torch.set_num_threads(config["threads"])
        self.run: JobRunSpec = config["run"]
        self.job, self.t = self.run.config, self.run.config.training
        torch.manual_seed(self.job.seed)  # same LoRA init on every rank and in every rerun of the job
        ctx = ray.train.get_context()
        self.world_rank, self.world, self.local_rank = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()
        self.chief, self.node_leader = self.world_rank == 0, self.local_rank == 0
        self.device = ray.train.torch.get_device()
        self.collectives = Collectives(self.device)
        self.reporter = (Reporter(self.run.job_id, self.settings.callback_url, self.settings.job_token)
                         if self.chief else None)
        self.metrics = WorkerMetrics(self.run.job_id, self.world_rank, self.local_rank, self.device, self.event,
                                     self.settings)
        self.node_dir = os.path.join(tempfile.gettempdir(), "moetune", self.run.job_id)
        self.attempt = config["attempt"]  # this driver run's id (see workers.checkpoints.run_state)
        self.stage = self.run.config.parallelism.coordinates(self.world_rank).stage  # its pipeline stage
        self.pipelined = None  # with pipeline stages: what saving an adapter or checkpoint needs (train)
        self.traffic = StageTraffic() if self.run.config.parallelism.pipeline_parallel_size > 1 else None
        self.alignment = None  # the alignment table, when this run checked it (a resumed run does not)
        self.base_evaluation = None  # the evaluation scores at step 0, when this run evaluated (not a resumed one)

    def event(self, message: str, **kwargs) -> None:
        if self.chief:
            self.reporter.event(message, **kwargs)

    # -------------------------------------------------------------- phases

    def load(self) -> None:
        model_dir = os.path.join(self.node_dir, "model")
        self.event("Loading model", data={"model": self.job.model})
        if self.node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            storage.download_dir(self.job.model, model_dir, skip=streamed_or_unused)  # tokenizer + config only
        self.collectives.barrier()
        self.tokenizer = load_tokenizer(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        # Each rank streams its own share of the weights (workers.weights): non-expert tensors, its experts.
        built = build_model(TRAIN, config, self.job, device=self.device, weights=WeightsSource(
            self.job.model, self.settings.weights_cache_dir, self.settings.weights_cache_max_bytes),
                            stage=self.stage)
        message, data = load_summary(built.streamed, self.job.parallelism.expert_parallel_size)
        data["bytes_from_storage_all_ranks"] = int(self.collectives.all_sum(built.streamed.stats.bytes_from_storage)[0])
        self.event(message, data=data)
        swapped = {name: n for name, n in built.swapped.items() if n}
        if swapped:
            self.event("Custom kernels swapped in: " + ", ".join(f"{k} ({n} modules)" for k, n in swapped.items()))
        self.model = built.model
        if self.t.activation_checkpointing:
            self.event("Activation checkpointing: each decoder layer keeps its inputs only and is recomputed in "
                       "the backward")
        # frozen weights kept quantized are buffers: counted by their dense shapes, like the rest
        total = sum(math.prod(full_shape(p)) for p in self.model.parameters()) + sum(  # ZeRO-3: partitioned
            held(m, name).shape.numel() for m in self.model.modules() for name in held_names(m))
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.event(f"Model loaded: {total:,} parameters, {trainable:,} trainable (LoRA)",
                   data={"parameters": total, "trainable_parameters": trainable})

    def load_data(self) -> None:
        seq_len = self.t.seq_len
        self.method = method_for(self.job.method, self.job.training, self.tokenizer,
                                 os.path.join(self.node_dir, "model"))
        self.train_set, dropped = self.method.examples(load_rows(self.job.training_file, "training_file"))
        if not self.train_set:
            raise DatasetError("training_file", f"training_file {self.job.training_file}: no row has a trained "
                                                f"token within seq_len={seq_len}")
        if dropped:
            self.event(f"{dropped} training rows have no trained token within seq_len={seq_len}; skipped",
                       level="warn")
        self.valid_set = []
        if self.job.validation_file:
            self.valid_set, _ = self.method.examples(load_rows(self.job.validation_file, "validation_file"))
        evaluation = self.job.evaluation
        self.eval_rows = load_eval_rows(evaluation.file, self.tokenizer, evaluation.metrics) if evaluation else []

    def checkpoint(self, step: int, record: dict, paused: bool = False) -> None:
        local = os.path.join(self.node_dir, "checkpoints", step_dir(step))
        uri = checkpoint_uri(self.run.output_uri, step)
        save_checkpoint(self.engine, local, is_writer=self.chief, base_model=self.job.model, pipelined=self.pipelined)
        if self.chief:
            record["checkpoint"] = step_dir(step)  # also in this history's copy: the report's checkpoint marks
            run_state.save_trainer_state(local, step=step, trained_tokens=record["trained_tokens"],
                                         history=self.history, attempt=self.attempt, paused=paused,
                                         micro_batches=self.steps.state())
            run_state.retract_manifest(uri)
        self.collectives.barrier()
        if self.node_leader:
            _upload_checkpoint(local, uri, step)
            shutil.rmtree(local)
        self.collectives.barrier()  # every node's files are up: only now may the manifest say it is complete
        if self.chief:
            run_state.write_manifest(uri, step)
            keep = self.t.keep_checkpoints
            retired = run_state.retired_checkpoints(self.run.output_uri, keep) if keep else []
            best = self._best_record()  # select_checkpoint "best:...": never retire the best so far
            retired = [s for s in retired if best is None or s != best["step"]]
            listed = self.reporter.checkpoint(step, uri, retired, train_loss=record["train_loss"],
                                              valid_loss=record.get("valid_loss"), **_eval_scores(record))
            if listed or self.reporter.url is None:  # never delete what the control plane may still list
                for old in retired:
                    run_state.delete_checkpoint(self.run.output_uri, old)

    def resume(self) -> tuple[int, int]:
        """Loads the newest complete checkpoint into the engine, if any: (its step, trained tokens so far).

        The chief picks it and every rank follows, so a checkpoint completing meanwhile cannot split the group.
        """
        point = run_state.latest_checkpoint(self.run.output_uri) if self.chief else None
        restarted = self.chief and run_state.mark_group_started(self.run.output_uri, self.attempt)
        (step,) = self.collectives.all_sum(point.step if point else 0)
        if not step:
            if restarted:
                self.event("Restarted from step 1 after a worker failure (no complete checkpoint yet)", level="warn")
            return 0, 0
        step = int(step)
        self._load_checkpoint(step)
        if not self.chief:
            return step, 0  # only the chief reports token counts and keeps the metrics history
        self.history, self.resumed_tuner = point.state["history"], point.state.get("micro_batches")
        self.event(f"Resumed from checkpoint step-{step} after {run_state.resume_reason(point, restarted)}",
                   level="warn" if restarted else "info", data={"step": step, "checkpoint": point.uri})
        return step, point.state["trained_tokens"]

    def _load_checkpoint(self, step: int) -> None:
        """Every rank: the engine takes the state of checkpoint step-<step> (its node's leader downloads it)."""
        local = os.path.join(self.node_dir, "resume")
        if self.node_leader:
            storage.download_dir(checkpoint_uri(self.run.output_uri, step), local)
        self.collectives.barrier()
        load_checkpoint(self.engine, local, self.stage)
        self.collectives.barrier()
        if self.node_leader:
            shutil.rmtree(local)

    def _best_record(self) -> dict | None:
        """Chief: under `training.select_checkpoint: "best:<metric>"`, the step record with the best score among
        the checkpointed ones and the last step (the earliest of equal scores); None otherwise."""
        selected = self.t.select_checkpoint
        if not selected.startswith("best:"):
            return None
        key, last = EVAL_PREFIX + selected.removeprefix("best:"), self.history[-1]
        scored = [r for r in self.history if key in r and (r.get("checkpoint") or r is last)]
        return max(scored, key=lambda r: r[key], default=None)

    def _selected_checkpoint(self) -> int:
        """The step of the best checkpoint (`_best_record`) when it is not the last step (the engine's state now),
        else 0; the chief decides, every rank follows."""
        chosen = 0
        best = self._best_record() if self.chief else None
        if best is not None:
            key = EVAL_PREFIX + self.t.select_checkpoint.removeprefix("best:")
            last = self.history[-1]
            kept = {step for step, _ in run_state.complete_checkpoints(self.run.output_uri)}
            if best is not last and best["step"] in kept:
                chosen = best["step"]
                self.event(f"Exporting checkpoint step-{chosen} as the adapter: best {key.removeprefix(EVAL_PREFIX)} "
                           f"{best[key]:.4g} (last step {last['step']}: {last.get(key, float('nan')):.4g})",
                           data={"selected_step": chosen, key: best[key]})
            elif best is not last:
                self.event(f"Checkpoint step-{best['step']} had the best {key.removeprefix(EVAL_PREFIX)} but is no "
                           "longer stored (keep_checkpoints); exporting the last step", level="warn")
        (chosen,) = self.collectives.all_sum(chosen)
        return int(chosen)

    def restore_tuner(self) -> None:
        """The chief's view (the checkpoint's tuner state, sizes that failed with an OOM) on every rank."""
        tuned = (self.resumed_tuner or {}) if self.chief else {}
        failed = (run_state.smallest_oom_size(self.run.output_uri) or 0) if self.chief else 0
        size, ceiling, failed = self.collectives.all_sum(tuned.get("size", 0), tuned.get("ceiling", 0), failed)
        self.steps.restore(int(size), int(ceiling), int(failed))

    def pause_requested(self) -> bool:
        """Whether the control plane asked to pause in its answer to the chief's last report (all ranks agree)."""
        (asked,) = self.collectives.all_sum(float(self.chief and self.reporter.control == "pause"))
        return asked > 0

    def _record_oom(self, step: int, micro_batch_size: int) -> None:
        run_state.record_oom(self.run.output_uri, self.attempt, self.world_rank, step, micro_batch_size)

    def generation_eval(self) -> dict[str, float]:
        """{"eval_<metric>": score} of the model now on the evaluation rows (every rank: a collective). Expert-
        parallel and ZeRO-3 forwards are collectives, so ranks then generate in lockstep."""
        scores = evaluate_generation(self.engine.module, self.tokenizer, self.eval_rows, self.job.evaluation,
                                     self.world_rank, self.world, self.collectives.all_sum, self.job.seed,
                                     lockstep=self.job.parallelism.collective_forward)
        self.metrics.evaluated(scores)
        return {f"{EVAL_PREFIX}{metric}": score for metric, score in scores.items()}

    def check_alignment(self) -> None:
        """Before step 1: the swapped operators and the first loss against their references on this rank's first
        micro-batch (workers.evaluation.alignment), its slice of it in a CP forward with context parallelism; beyond
        tolerance the job fails naming the operators."""
        t, steps, started = self.t, self.steps, time.perf_counter()
        indices = step_examples(len(self.train_set), 0, t.global_batch_size, steps.data_rank, steps.data_world,
                                self.job.seed)
        first_stage = t.seq_len_schedule[0].seq_len if t.seq_len_schedule else t.seq_len
        examples = [self.train_set[i].truncated(first_stage) for i in indices[:steps.micro_batch_size]]
        self.engine.eval()  # no dropout: both forwards see the same network
        with steps.micro_batch(examples) as batch:
            rows = check_alignment(self.engine.module, lambda: self.method.loss_sum(self.engine, batch),
                                   self.model.dtype, lambda values: self.collectives.all_max(*values))
        self.engine.train()
        level, message, error = verdict(rows, t.alignment_check, time.perf_counter() - started)
        self.event(message, level=level, data={"alignment": rows})
        self.alignment = rows
        if error:
            raise error

    def train(self) -> bool:
        """Runs the steps left after the newest complete checkpoint; False when it stopped for a pause."""
        t = self.t
        steps = total_steps(len(self.train_set), t.global_batch_size, t.max_steps, t.n_epochs)
        self.method.prepare(self.model)
        scheduler = self._step_runner(steps)
        self.engine = self.steps.engine
        self.memory_budget_mb = memory_budget_bytes(self.device, t.memory_budget_mb) / 1e6
        self.event(f"Training started: {steps} steps on {self.world} workers, {self.steps.describe()}",
                   data={"total_steps": steps, "train_examples": len(self.train_set), "workers": self.world})
        self.history, self.resumed_tuner = [], None
        done, trained_tokens = self.resume()
        if not done and t.alignment_check and self.pipelined:
            self.event("Alignment check skipped: it does not run on pipeline stages yet", level="warn")
        elif not done and t.alignment_check:
            self.check_alignment()
        if not done and self.eval_rows:
            self.base_evaluation = self.generation_eval()
            self.event("Evaluation at step 0 (base model): " + _scores(self.base_evaluation),
                       data={"step": 0, **self.base_evaluation})
        if self.steps.tuner:
            self.restore_tuner()
        for step in range(done + 1, steps + 1):
            started, learning_rate = time.perf_counter(), scheduler.get_last_lr()[0]
            loss_sum, loss_tokens, tokens = self.steps.run(step, self.train_set)
            trained_tokens += int(tokens)
            train_seconds = time.perf_counter() - started
            self.metrics.training_part_done()
            record = {"step": step, "total_steps": steps, "train_loss": loss_sum / loss_tokens,
                      "learning_rate": learning_rate, "tokens_per_second": tokens / train_seconds,
                      "trained_tokens": trained_tokens, **self.steps.figures}
            if step == done + 1 and done:
                record["resumed_from_step"] = done
            if self.valid_set and ((t.eval_every and step % t.eval_every == 0) or step == steps):
                record["valid_loss"] = self.steps.validation_loss(self.valid_set)
            every = (self.job.evaluation.every or t.checkpoint_every) if self.eval_rows else None
            if self.eval_rows and ((every and step % every == 0) or step == steps):
                record.update(self.generation_eval())
            moe = self.metrics.step_end(record, time.perf_counter() - started, self.steps.micro_batch_size,
                                        self.steps.grad_accum_steps)
            record.update(step_figures(moe, train_seconds, time.perf_counter() - started - train_seconds,
                                       self.world_rank, self.world, self.device, self.collectives.all_sum))
            record["memory_budget_mb"] = self.memory_budget_mb
            if self.chief:
                self.reporter.metrics(**record)
                self.history.append(record)
            pause = step < steps and self.pause_requested()
            if pause or (t.checkpoint_every and step % t.checkpoint_every == 0):
                self.checkpoint(step, record, paused=pause)
            if pause:
                self.event(f"Paused at step {step}: checkpoint step-{step} written, workers stopping")
                return False
        return True

    def _step_runner(self, steps: int):
        """The engine over the rank's model (its pipeline stage's module, with stages) and the runner of its
        steps (`self.steps`); returns the engine's LR scheduler."""
        par, bf16 = self.job.parallelism, self.device.type == "cuda"
        faults = fault_hook(self.settings.inject_faults, self.world_rank)
        place = RankPlace(self.world_rank, self.world, self.job.seed, self.device,
                          collective_forward=par.collective_forward)
        rest = (self.collectives, self.event, steps, faults, self._record_oom)
        if par.pipeline_parallel_size > 1:
            stages, groups = par.pipeline_parallel_size, StageGroups(par, self.world_rank)
            module = stage_module(self.model, model_stage_bounds(self.model, stages), self.stage,
                                  emit_logits=self.method.head is None)
            engine, scheduler = build_engine(module, self.t, par, self.world, steps, bf16=bf16, groups=groups)
            pipeline = StagePipeline(engine, self.stage, stages, self.device, groups.model, self.method.stage_loss,
                                     self.traffic)
            self.pipelined = PipelinedModel(self.model, self.stage, par.stage_first_ranks)
            self.steps = PipelineStepRunner(pipeline, self.tokenizer.pad_token_id, self.model, self.method, self.job,
                                            place, *rest)
            return scheduler
        engine, scheduler = build_engine(self.model, self.t, par, self.world, steps, bf16=bf16)
        if par.context_parallel_size > 1:
            place = replace(place, context=ContextSplit(engine.module, par, self.world_rank,
                                                        self.tokenizer.pad_token_id))
        self.steps = StepRunner(engine, self.method, self.job, place, *rest)
        return scheduler

    def finish(self) -> None:
        if selected := self._selected_checkpoint():
            self._load_checkpoint(selected)
        local = os.path.join(self.node_dir, ADAPTER_DIR)
        save_adapter(self.engine, local, is_writer=self.chief, base_model=self.job.model, pipelined=self.pipelined)
        if self.chief:
            storage.upload_dir(local, adapter_uri(self.run.output_uri))
            lines = "".join(json.dumps(r) + "\n" for r in self.history)
            storage.write_bytes(metrics_uri(self.run.output_uri), lines.encode())
            last = self.history[-1]
            summary = {k: last.get(k) for k in ("step", "train_loss", "valid_loss", "trained_tokens")}
            summary["first_train_loss"] = self.history[0]["train_loss"]
            summary["alignment"] = self.alignment
            summary["base_evaluation"] = self.base_evaluation
            summary["selected_step"] = selected or last["step"]
            storage.write_bytes(summary_uri(self.run.output_uri), json.dumps(summary).encode())
            self.event("Training finished", data=summary)
        self.collectives.barrier()
        if self.node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)


def _eval_scores(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith(EVAL_PREFIX)}


def _scores(scores: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix(EVAL_PREFIX)}={v:.4g}" for k, v in scores.items())


def train_loop_per_worker(config: dict) -> None:
    """Entry point for ray.train.torch.TorchTrainer; `config` comes from workers.entry.driver."""
    worker = _Worker(config)
    try:
        worker.load()
        worker.metrics.training_started(worker.model, worker.job.parallelism.context_parallel_size > 1,
                                        (worker.stage, worker.traffic) if worker.traffic else None)
        worker.load_data()
        if worker.train():
            worker.finish()
    finally:
        worker.metrics.close()
        if worker.reporter:  # the chief's reports delivered before the driver reports the result
            worker.reporter.close()


class CheckpointUploadError(RuntimeError):
    """A checkpoint that did not reach storage: the worker group restarts (not a user error) from the newest
    complete checkpoint, which this one, without its manifest, never becomes."""


def _upload_checkpoint(local: str, uri: str, step: int) -> None:
    try:
        storage.upload_dir(local, uri)
    except Exception as e:  # noqa: BLE001 - whatever storage raised, the job's event must name the checkpoint
        cause = (str(e).strip().splitlines() or [""])[-1]
        raise CheckpointUploadError(f"checkpoint {step_dir(step)} could not be written to {uri} ({type(e).__name__}: "
                                    f"{cause}); it is incomplete and never resumed from") from None
