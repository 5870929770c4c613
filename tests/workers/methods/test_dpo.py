"""DPO (workers/methods/dpo.py) against TRL's DPOTrainer on stock transformers + PEFT, in one process, on the tiny
checkpoint (its byte tokenizer and chat template) and the same preference rows: the token sequences and their loss
masks, the loss over a global batch and every LoRA gradient, and the reward metrics. moetune's side runs the job's
own step (workers.loop.step.StepRunner, micro-batches of 2 pairs over 5: gradient accumulation) on the kernel swaps
with packed micro-batches; TRL's one padded batch of all 5 pairs. LoRA B starts random here, so the policy and the
reference (LoRA off) differ.

Sabotage noted: the reference computed with LoRA on (lora_off a no-op) gives loss log 2 and fails the loss check;
a wrong sign (+logsigmoid) fails it too."""

import zlib

import pytest
import torch

from moetune.api.models.run_config import RunConfig, RunTraining
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.loop.step import RankPlace, StepRunner
from moetune.workers.methods import method_for
from moetune.workers.methods.dpo import FIGURES, DpoMethod
from moetune.workers.model import trainable_model
from moetune.workers.tiny import write_tiny_checkpoint

BETA, MICRO = 0.5, 2
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0}


def preference_rows() -> list[dict]:
    """Five pairs: a system turn, a prompt holding an assistant turn (no loss on it), answers of unequal length."""
    rows = []
    for i, (name, colour) in enumerate([("ada", "red"), ("bob", "blue"), ("cy", "green"), ("dee", "gold"),
                                        ("eve", "red")]):
        messages = [{"role": "user", "content": f"what does {name} like?"}]
        if i % 2:
            messages = [{"role": "system", "content": "answer briefly."}, *messages]
        if i == 3:
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}, *messages]
        rows.append({"input": {"messages": messages},
                     "preferred_output": [{"role": "assistant", "content": f"{name} likes {colour}."}],
                     "non_preferred_output": [{"role": "assistant", "content": "no idea" + "!" * i}]})
    return rows


def _job(pairs: int) -> RunConfig:
    """A run config as such (5 pairs in micro-batches of 2: no request would pass the batch rule)."""
    return RunConfig(model="file:///unused", seed=0, lora=LORA,
                     method={"type": "dpo", "dpo": {"hyperparameters": {"beta": BETA}}},
                     training=RunTraining(seq_len=128, global_batch_size=pairs, micro_batch_size=MICRO, max_steps=1))


class _OneProcessEngine:
    """DeepSpeed's engine as the step calls it, in one process: gradients accumulate in the parameters."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def set_gradient_accumulation_boundary(self, last):
        pass

    def step(self):
        pass


class _OneRank:
    def all_sum(self, *values):
        return list(values)

    all_max = all_min = all_sum


def random_pairs(seed: int, count: int = 2) -> list:
    """Deterministic pairs of random token ids (no tokenizer): a prompt without loss, then answers of unequal
    length."""
    from moetune.workers.methods.batch import IGNORE
    from moetune.workers.methods.dpo import PreferencePair
    from moetune.workers.methods.sft import Example

    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(count):
        prompt = torch.randint(3, 256, (4 + i,), generator=g).tolist()
        chosen, rejected = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 3 + 2 * i))
        pairs.append(PreferencePair(*(Example(prompt + a, [IGNORE] * len(prompt) + a) for a in (chosen, rejected))))
    return pairs


def random_lora_b(model, scale: float = 0.1) -> None:
    """Every LoRA B drawn from its name, so that the policy differs from the reference; an expert-parallel
    module's B (lora_*_b, this rank's experts) is its slice of the one drawn for all the experts."""
    def drawn(name, shape):
        return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * scale

    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if "lora_B" in module_name:
                    p.copy_(drawn(f"{module_name}.{name}", p.shape))
                elif name in ("lora_gate_up_b", "lora_down_b"):
                    p.copy_(drawn(f"{module_name}.{name}", (module.num_experts, *p.shape[1:]))[module.ep.local])


def _lora_grads(model) -> dict:
    return {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("dpo") / "model"))


def _moetune(checkpoint, rows):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    job = _job(len(rows))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    apply_kernel_swaps(model)
    torch.manual_seed(1)
    model = trainable_model(model, job.lora, job.training, None).train()
    random_lora_b(model)
    method = method_for(job.method, job.training, tokenizer)
    assert isinstance(method, DpoMethod) and method.beta == BETA
    pairs, dropped = method.examples(rows)
    assert len(pairs) == len(rows) and not dropped
    method.prepare(model)
    assert method.head is not None and method.pack  # the fused per-sequence head, packed micro-batches
    runner = StepRunner(_OneProcessEngine(model), method, job, RankPlace(0, 1, 0, torch.device("cpu")),
                        _OneRank(), lambda *args, **kwargs: None, total_steps=1)
    loss_sum, pair_count, _ = runner.run(1, pairs)
    assert pair_count == len(rows)
    return pairs, loss_sum / pair_count, _lora_grads(model), runner.figures


def _trl(checkpoint, rows, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from moetune.workers.lora.peft_lora import apply_lora

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(1)
    model = apply_lora(model, _job(len(rows)).lora)
    random_lora_b(model)
    data = Dataset.from_list([{"prompt": r["input"]["messages"], "chosen": r["preferred_output"],
                               "rejected": r["non_preferred_output"]} for r in rows])
    args = DPOConfig(output_dir=str(tmp_path), beta=BETA, max_length=None, report_to=[], use_cpu=True,
                     per_device_train_batch_size=len(rows), bf16=False, dataset_num_proc=None)
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    # handed a PeftModel, TRL keeps a copy of its adapter as the reference ("ref"); without it the reference is the
    # base with adapters disabled, TRL's reference for a new adapter and moetune's
    trainer.model.delete_adapter("ref")
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    figures = {name: trainer._metrics["train"][name][-1] for name in FIGURES}
    return inputs, loss.item(), _lora_grads(trainer.model), figures


def test_dpo_loss_gradients_and_rewards_equal_trl(checkpoint, tmp_path):
    rows = preference_rows()
    pairs, loss, grads, figures = _moetune(checkpoint, rows)
    inputs, want_loss, want_grads, want_figures = _trl(checkpoint, rows, tmp_path)

    # the same sequences, loss on the same tokens: TRL's batch is the chosen sequences, then the rejected ones
    sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    for seq, ids, mask, completion in zip(sequences, inputs["input_ids"], inputs["attention_mask"],
                                          inputs["completion_mask"]):
        n = int(mask.sum())
        assert seq.input_ids == ids[:n].tolist()
        assert [label != -100 for label in seq.labels] == completion[:n].bool().tolist()

    assert abs(want_loss - 0.6931) > 0.01  # the policy is not the reference: the loss is not log 2
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        scale = float(want_grads[name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert figures.keys() == want_figures.keys()
    for name, value in figures.items():
        assert value == pytest.approx(want_figures[name], rel=1e-4, abs=1e-6), name
    assert 0 < figures["rewards/accuracies"] < 1  # some pairs ranked right, some wrong: the count is checked
