"""One rank of a session's group: the job worker's model assembly (workers.loop.worker: download, streamed
weights, kernel swaps, LoRA, expert parallelism, the ZeRO engine), then calls until the session closes.

The chief polls the control plane for the next call and broadcasts it; every rank runs it (each forward is one per
rank, so expert-parallel and ZeRO-3 forwards meet their peers), and the chief posts the outcome. A call that fails
on user input (a token beyond the vocabulary) fails alone; the group goes on.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from moetune.api import storage
from moetune.api.models.job_run import JobRunSpec
from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo
from moetune.api.models.run_config import session_run_config
from moetune.api.models.training_sessions import (
    Forward,
    ForwardBackward,
    LoadState,
    OptimStep,
    Sample,
    SaveState,
    SaveWeights,
    SessionRunSpec,
    TakenCall,
)
from moetune.workers.checkpoints.save import load_checkpoint, save_adapter, save_checkpoint
from moetune.workers.data.sampling import step_rng_seed
from moetune.workers.engine.deepspeed import build_engine
from moetune.workers.engine.generation import partitioned_bytes, whole_for_generation
from moetune.workers.generate import SamplingParams, generate_batch
from moetune.workers.loop.worker import _Worker
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.reporting.step_figures import memory_budget_bytes
from moetune.workers.methods.dpo import lora_off
from moetune.workers.methods.loss_head import install_loss_head
from moetune.workers.sessions.batch import TokenLogprobHead, padded, padded_tokens, token_logprobs
from moetune.workers.sessions.control import SessionLink
from moetune.workers.sessions.layout import state_uri, weights_uri
from moetune.workers.sessions.losses import LOSSES
from moetune.workers.sessions.optim import forget_optimizer_state, set_gradient_clipping
from moetune.workers.sessions.snapshots import WeightSnapshots
from moetune.workers.sessions.sampling import whole_weights_refusal
from moetune.workers.sessions.stops import cut_at_stop, stop_reached

log = logging.getLogger("moetune.session")
IDLE_STATE = "idle"  # the state a group saves when it stops for idleness
_POLL_S = 10.0  # one long poll of the next call


class CallError(Exception):
    """A call the user got wrong; its message goes back as the call's error."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def job_shape(run: SessionRunSpec) -> JobRunSpec:
    """The session as the job worker's loader sees it: its run config (base, LoRA, parallelism; no training file)."""
    return JobRunSpec(job_id=run.session_id, output_uri=run.output_uri,
                      config=session_run_config(run.spec.model, run.spec.lora, run.spec.parallelism, run.seed))


class SessionWorker(_Worker):
    def __init__(self, config: dict):
        self.session: SessionRunSpec = config["session"]
        super().__init__({**config, "run": job_shape(self.session)})
        self.reporter = Reporter(self.session.session_id, None, None)  # session events are the calls' outcomes
        self.link = SessionLink(self.settings.callback_url, self.settings.job_token, self.session) \
            if self.chief else None
        self.pending: list[ForwardBackward] = []  # forward_backward calls since the last step (see forward_backward)
        self.snapshots = WeightSnapshots()
        self.call_number = 0  # the running call's place in the session (names saved weights)

    def start(self) -> None:
        self.load()
        self.head = install_loss_head(self.model, TokenLogprobHead)  # logprobs without [tokens, vocab] logits
        self.engine, _ = build_engine(self.model, self.job.training, self.job.parallelism, self.world, total_steps=1,
                                      bf16=self.device.type == "cuda")
        self.engine.train()
        (memory,) = self.collectives.all_min(memory_budget_bytes(self.device, self.t.memory_budget_mb))
        self.sample_refusal = whole_weights_refusal(partitioned_bytes(self.model), int(memory))  # same on all ranks
        self.lockstep = self.job.parallelism.collective_forward
        if self.session.restore:  # this group replaces a failed one: it resumes where the session last saved
            step = self.load_state(LoadState(name=self.session.restore))["step"]
            log.info("session %s: resumed from state %r (step %d)", self.session.session_id, self.session.restore,
                     step)
        if self.chief:
            self.link.ready()

    # ------------------------------------------------------------ the call loop

    def serve(self) -> str:
        """Runs calls until the session closes; returns why it stopped ("closed" or "idle")."""
        idle_since = time.monotonic()
        while True:
            message = self._next(idle_since)
            if message == "idle":
                self.save_state(SaveState(name=IDLE_STATE))
                return "idle"
            if message == "close":
                return "closed"
            if message is None:
                continue  # no call yet: every rank comes round again, well within the collectives' timeout
            started = time.perf_counter()
            outcomes = self._run(message)
            worker_ms = (time.perf_counter() - started) * 1e3  # the calls' cost beyond the API's (merged: together)
            if self.chief:
                for taken, outcome in zip(message, outcomes):
                    if isinstance(outcome, CallError):
                        error = ErrorInfo(code=ErrorCode.invalid_request, message=str(outcome), param=outcome.param)
                        self.link.outcome(taken.call_id, None, error)
                    else:
                        self.link.outcome(taken.call_id, {**outcome, "worker_ms": worker_ms}, None)
            idle_since = time.monotonic()

    def _run(self, taken: list[TakenCall]) -> list[dict | CallError]:
        """Each call's result, or the CallError it failed on; several calls are samples merged into one generation."""
        self.call_number = taken[0].number
        if taken[0].call.kind == "sample":
            return self.sample([(t.number, t.call) for t in taken])
        try:
            return [getattr(self, taken[0].call.kind)(taken[0].call)]
        except CallError as e:
            return [e]

    def _next(self, idle_since: float):
        """The chief's next message for every rank: the calls taken (TakenCall), "close", "idle", or None when a
        poll brought nothing."""
        message = [None]
        if self.chief:
            left = self.session.spec.idle_timeout_s - (time.monotonic() - idle_since)
            answer = self.link.next_call(wait_s=min(left, _POLL_S)) if left > 0 else None
            if answer is None:
                message = ["idle"]
            elif answer.close:
                message = ["close"]
            elif answer.calls:
                message = [answer.calls]
        dist.broadcast_object_list(message, src=0)
        return message[0]

    # ------------------------------------------------------------ calls

    def forward_backward(self, call: ForwardBackward) -> dict:
        """The loss and logprobs now, without a gradient; the backward runs at optim_step, over every call since
        the last step as DeepSpeed's micro-batches (the weights do not change in between, so the gradients are
        the same, and DeepSpeed accumulates them only within one boundary)."""
        if self.pending and not (call.accumulate and all(p.accumulate for p in self.pending)):
            raise CallError("the gradients of the previous forward_backward are not applied yet: call optim_step "
                            "first (or send all the sequences in one forward_backward)", "call.data")
        with torch.no_grad():
            mine, _, logprobs, loss = self._loss(call)
        self.pending.append(call)
        (total,) = self.collectives.all_sum(loss.item())  # 0 on a rank without a datum
        return {"loss": total, "logprobs": self._gathered(call.data, mine, logprobs)}

    def _loss(self, call: ForwardBackward):
        mine, batch, logprobs = self._forward(call.data)
        clip = call.clip_range or (1 - call.clip_epsilon, 1 + call.clip_epsilon)
        return mine, batch, logprobs, LOSSES[call.loss_fn](logprobs, batch["weights"], batch["advantages"],
                                                           batch["sampler"], clip)

    def _backward_pending(self) -> None:
        for i, call in enumerate(self.pending):
            self.engine.set_gradient_accumulation_boundary(i == len(self.pending) - 1)
            loss = self._loss(call)[3]
            self.engine.backward(loss * self.world, scale_wrt_gas=False)  # DeepSpeed averages over ranks: a sum
        self.pending = []

    def forward(self, call: Forward) -> dict:
        with torch.no_grad(), nullcontext() if call.adapter else lora_off(self.engine.module):
            mine, _, logprobs = self._forward(call.data)
        return {"logprobs": self._gathered(call.data, mine, logprobs)}

    def optim_step(self, call: OptimStep) -> dict:
        if not self.pending:
            raise CallError("no gradients to apply: call forward_backward first", "call")
        self._backward_pending()
        for group in self.engine.optimizer.param_groups:
            group.update(lr=call.learning_rate, betas=(call.beta1, call.beta2), eps=call.eps,
                         weight_decay=call.weight_decay)
        set_gradient_clipping(self.engine, call.grad_clip_norm)
        self.engine.step()
        self.snapshots.weights_changed()
        return {"step": int(self.engine.global_steps)}

    def sample(self, calls: list[tuple[int, Sample]]) -> list[dict | CallError]:
        """Samples (each with its number in the session) as one generation: they are alike but for Sample.PER_CALL.
        A call whose prompts are wrong fails alone."""
        first = calls[0][1]
        if self.sample_refusal:
            return [CallError(self.sample_refusal, "call")] * len(calls)
        if first.top_k > 0 and self.head is None:
            return [CallError("top_k needs the model's plain output layer; this model has another", "call.top_k")] \
                * len(calls)
        outcomes: list[dict | CallError] = [{"sequences": []} for _ in calls]
        wanted = []  # every sequence to draw: (its call, its prompt's index, the prompt, its seed)
        for c, (number, call) in enumerate(calls):
            try:
                prompts = self._prompts(call)
            except CallError as e:
                outcomes[c] = e
                continue
            seed = call.seed if call.seed is not None else step_rng_seed(self.job.seed, number, 0) % 2**31
            rows = [(i, p) for i, p in enumerate(prompts) for _ in range(call.n)]
            wanted += [(c, i, p, seed + k) for k, (i, p) in enumerate(rows)]
        if not wanted:
            return outcomes
        share = wanted[self.world_rank :: self.world]
        rows = share + [wanted[0]] * (math.ceil(len(wanted) / self.world) - len(share)) if self.lockstep else share
        try:
            mine = self._draw(first, [r[2] for r in rows], [r[3] for r in rows])[:len(share)]
        except CallError as e:  # the snapshot the calls name (alike on every rank)
            return [o if isinstance(o, CallError) else e for o in outcomes]
        drawn = _in_order(list(range(self.world_rank, len(wanted), self.world)), mine, self.world, len(wanted))
        for (c, i, _, _), sequence in zip(wanted, drawn):
            if not calls[c][1].prompt_logprobs:
                del sequence["prompt_logprobs"]
            outcomes[c]["sequences"].append({"prompt_index": i, **sequence})
        for outcome in outcomes:
            if isinstance(outcome, dict):
                outcome["merged_calls"] = len(calls)
        return outcomes

    def _prompts(self, call: Sample) -> list[list[int]]:
        prompts = [self.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p
                   for p in call.prompts]
        self._check_tokens(prompts, "call.prompts")
        return prompts

    def _draw(self, call: Sample, prompts: list[list[int]], seeds: list[int]) -> list[dict]:
        """Each prompt's completion drawn with its seed, its logprobs and how it ended (every rank the same rows'
        count: the forwards of an expert-parallel or ZeRO-3 model meet their peers)."""
        texts = [s for s in call.stop if isinstance(s, str)]
        stops = set(self._stop_tokens(call.stop)) | set(_ids(self.tokenizer.eos_token_id))
        params = SamplingParams(call.max_tokens, temperature=call.temperature, top_p=call.top_p)

        def ends(t: list[int]) -> bool:  # stop tokens end a row here, so that the row keeps the one it drew
            return t[-1] in stops or bool(texts) and stop_reached(t, self._decode, texts)

        # ZeRO-3: the weights gathered once for the call, not per token; the snapshot asked for, or none
        with whole_for_generation(self.engine), self._sampled_weights(call):
            with self.head.keeping_top(call.top_k if call.top_k > 0 else None) if self.head else nullcontext():
                drawn = generate_batch(self.engine.module, prompts, params, lockstep=self.lockstep,
                                       eos_token_id=None, ends=ends, seeds=seeds) if prompts else []
            ended = [_ending(t, stops, call.max_tokens) for t in drawn]
            cut = [cut_at_stop(t, self._decode, texts) for t, _, _ in ended]
            scored = [t + ([stop] if stop is not None else []) for (t, _), (_, stop, _) in zip(cut, ended)]
            logprobs = self._sampled_logprobs(prompts, scored) if prompts else []
        return [{"prompt_tokens": p, "tokens": t, "text": text, "finish_reason": reason,
                 "logprobs": lp[len(p):len(p) + len(t)], "stop_token": stop,
                 "stop_logprob": lp[len(p) + len(t)] if stop is not None else None, "prompt_logprobs": lp[:len(p)]}
                for p, (t, text), (_, stop, reason), lp in zip(prompts, cut, ended, logprobs)]

    def save_state(self, call: SaveState) -> dict:
        local = os.path.join(self.node_dir, "state")
        save_checkpoint(self.engine, local, is_writer=self.chief, base_model=self.job.model)
        return {"uri": self._upload(local, state_uri(self.run.output_uri, call.name)),
                "step": int(self.engine.global_steps)}

    def load_state(self, call: LoadState) -> dict:
        uri, local = call.uri or state_uri(self.run.output_uri, call.name), os.path.join(self.node_dir, "state")
        saved = self.chief and storage.exists(storage.join(uri, "deepspeed", "latest"))
        (found,) = self.collectives.all_sum(float(saved))
        if not found:
            raise CallError(f"no saved state named {call.name!r} in this session ({uri})", "call.name")
        if self.node_leader:
            storage.download_dir(uri, local)
        self.collectives.barrier()
        load_checkpoint(self.engine, local)
        if not call.optimizer:
            forget_optimizer_state(self.engine)
        self.collectives.barrier()
        if self.node_leader:
            shutil.rmtree(local)
        self.pending = []
        self.snapshots.weights_changed()
        return {"uri": uri, "step": int(self.engine.global_steps)}

    def save_weights(self, call: SaveWeights) -> dict:
        local = os.path.join(self.node_dir, "weights")
        save_adapter(self.engine, local, is_writer=self.chief, base_model=self.job.model)
        self.snapshots.keep(call.name, self.engine.module)  # what a sample naming these weights draws from
        return {"uri": self._upload(local, weights_uri(self.run.output_uri, call.name, self.call_number))}

    # ------------------------------------------------------------ helpers

    def _forward(self, data: list) -> tuple[list[int], dict, torch.Tensor]:
        """This rank's share of the call's sequences (their indices), as a batch, and their per-token logprobs."""
        self._check_tokens([d.tokens for d in data], "call.data")
        mine = list(range(self.world_rank, len(data), self.world))
        batch = padded([data[i] for i in mine] or [data[0]], self.device)  # a rank without a datum meets its peers
        if not mine:
            batch["weights"].zero_()
        # dropout masks follow the optimizer step, so a group resumed from a state draws the same ones (and a
        # forward the same ones as the forward_backward after it)
        torch.manual_seed(step_rng_seed(self.job.seed, self.engine.global_steps, self.world_rank))
        return mine, batch, token_logprobs(self.engine, batch["tokens"], self.head, batch["targets"])

    def _gathered(self, data: list, mine: list[int], logprobs: torch.Tensor) -> list[list[float]]:
        values = [lp[: len(data[i].tokens)].tolist() for lp, i in zip(logprobs.detach(), mine)]
        return _in_order(mine, values, self.world, len(data))

    def _upload(self, local: str, uri: str) -> str:
        self.collectives.barrier()
        if self.node_leader:
            storage.upload_dir(local, uri)
            shutil.rmtree(local)
        self.collectives.barrier()
        return uri

    def _sampled_weights(self, call: Sample):
        if not call.adapter:
            return lora_off(self.engine.module)
        if call.weights is None:
            return nullcontext()
        try:
            return self.snapshots.swapped_in(call.weights, self.engine.module)
        except KeyError as e:
            raise CallError(str(e.args[0]), "call.weights") from None

    def _sampled_logprobs(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Each prompt and completion's tokens' log-probabilities under the adapter that drew them (one forward per
        rank)."""
        data = [p + c if c else p + [self.tokenizer.eos_token_id] for p, c in zip(prompts, completions)]
        model = self.engine.module  # inside sample's whole_for_generation: not through the engine's ZeRO-3 forward
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logprobs = token_logprobs(model, padded_tokens(data, self.device), self.head)
        model.train(was_training)
        return [lp[: len(p) + len(c)].tolist() for lp, p, c in zip(logprobs, prompts, completions)]

    def _check_tokens(self, sequences: list[list[int]], param: str) -> None:
        vocab = self.model.config.get_text_config().vocab_size  # a nested text_config (K3) holds it
        for i, tokens in enumerate(sequences):
            if any(not 0 <= t < vocab for t in tokens):
                raise CallError(f"{param}[{i}]: token ids must be in [0, {vocab})", f"{param}[{i}]")

    def _stop_tokens(self, stop: list[str | int]) -> tuple[int, ...]:
        """What the engine stops on: the token ids, and the strings that are one token (the others end a row once its
        decoded text holds them, and are cut out of it, workers.sessions.stops)."""
        ids = [[s] if isinstance(s, int) else self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stop]
        return tuple(i[0] for i in ids if len(i) == 1)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _ids(token_id) -> tuple[int, ...]:
    """A tokenizer's eos: one id, several, or none."""
    if token_id is None:
        return ()
    return tuple(token_id) if isinstance(token_id, (list, tuple)) else (token_id,)


def _ending(tokens: list[int], stops: set[int], max_tokens: int) -> tuple[list[int], int | None, str]:
    """A drawn row as (its tokens before a stop token, that stop token or None, why it ended)."""
    if tokens and tokens[-1] in stops:
        return tokens[:-1], tokens[-1], "stop"
    return tokens, None, "length" if len(tokens) >= max_tokens else "stop"


def _in_order(mine: list[int], values: list, world: int, total: int) -> list:
    """Every rank's values (this rank's at indices `mine`) back in the call's order, on every rank."""
    gathered = [None] * world
    dist.all_gather_object(gathered, list(zip(mine, values)))
    ordered = [None] * total
    for pairs in gathered:
        for i, v in pairs:
            ordered[i] = v
    return ordered


def session_loop_per_worker(config: dict) -> None:
    """Entry point for ray.train.torch.TorchTrainer; `config` comes from workers.sessions.driver."""
    worker = SessionWorker(config)
    try:
        worker.start()
        reason = worker.serve()
        if worker.chief:
            worker.link.ended(reason)
    finally:
        worker.metrics.close()
