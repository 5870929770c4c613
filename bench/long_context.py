"""Long-context memory: peak memory of one LoRA step of a tiny-but-wide kimi_linear (a KDA layer and an MLA layer,
a MoE MLP, a 32K vocabulary) at growing T, for moetune (its kernels, per-layer activation checkpointing, the loss
through the output layer) and for transformers + PEFT on the same model (stock code and loss), on CPU in fp32.

Each (implementation, T) runs in a fresh child process; its peak is the growth of the child's maximum resident set
over the step (ru_maxrss after the model is built vs after the step), so it counts everything the step allocated.
moetune's growth exponent is fitted over T in log-log space; the longest T each fits is the largest length of the
doubling ladder whose peak stays within the budget (the ladder stops at the first length past it).

    python bench/long_context.py [--lengths 2048,8192,32768] [--budget-gb 6] [--ladder-max 131072]

Last line: `RESULT peak_ratio_32k=... growth_exponent=... max_seq_ratio=...` (moetune / baseline for the ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

WIDE = {"vocab_size": 32768, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "sparse"], "num_attention_heads": 2, "num_key_value_heads": 2,
        "linear_num_heads": 2, "linear_head_dim": 64, "max_position_embeddings": 1 << 20}


def _child(impl: str, seq: int) -> None:
    import resource

    import torch

    from moetune.workers.families import REGISTRY, apply_kernel_swaps
    from moetune.workers.methods.sft import Example, SupervisedMethod, collate
    from moetune.workers.model import trainable_model
    from bench.support.tiny_models import plain_model
    from bench.support.harness import spec

    torch.set_num_threads(2)
    fam = REGISTRY["kimi_linear"]
    model = plain_model(fam, config=fam.tiny_config(**WIDE))
    moetune = impl == "moetune"
    if moetune:
        apply_kernel_swaps(model)
    job = spec(ep=1, zero=2, checkpointing=moetune)
    model = trainable_model(model, job.lora, job.training, None)
    ids = torch.randint(0, WIDE["vocab_size"], (seq,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = collate([Example(ids, ids)], pad_id=0)
    method = SupervisedMethod(tokenizer=None, seq_len=seq)
    if moetune:
        method.prepare(model)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if moetune:
        method.loss_sum(model, batch).backward()
    else:  # transformers' own loss over its logits
        model(**batch.inputs, labels=batch.labels).loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_bytes": (after - before) * 1024}))


ADDRESS_CAP = 20 * 2**30  # a child's address space: a step too large for this machine fails instead of swapping


def _capped():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_CAP, ADDRESS_CAP))


def _peak(impl: str, seq: int, budget: float) -> float | None:
    """Peak bytes of one step, or None when the child failed (out of memory under the address cap)."""
    done = subprocess.run([sys.executable, __file__, "--child", impl, str(seq)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=_capped, check=False)
    if done.returncode != 0:
        print(f"  {impl} T={seq}: failed ({done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode})")
        return None
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
    print(f"  {impl:12s} T={seq:>7,}: peak {peak / 2**30:7.2f} GiB{'  (over budget)' if peak > budget else ''}",
          flush=True)
    return peak


def _longest_fit(impl: str, budget: float, ladder_max: int, known: dict) -> int:
    best, seq = 0, 1024
    while seq <= ladder_max:
        peak = known.get(seq) if seq in known else _peak(impl, seq, budget)
        if peak is None or peak > budget:
            break
        best, seq = seq, seq * 2
    return best


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], int(sys.argv[3]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--budget-gb", type=float, default=6.0)
    p.add_argument("--ladder-max", type=int, default=131072)
    args = p.parse_args()
    lengths, budget = [int(x) for x in args.lengths.split(",")], args.budget_gb * 2**30
    peaks = {}
    for impl in ("baseline", "moetune"):
        print(f"{impl}: one LoRA step, fp32, {WIDE['vocab_size']:,} vocabulary", flush=True)
        peaks[impl] = {seq: _peak(impl, seq, budget) for seq in lengths}
    ours = [(seq, peak) for seq, peak in peaks["moetune"].items() if peak]
    xs, ys = [math.log(s) for s, _ in ours], [math.log(p) for _, p in ours]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    exponent = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    longest = {impl: _longest_fit(impl, budget, args.ladder_max, peaks[impl]) for impl in peaks}
    top = lengths[-1]
    base_top = peaks["baseline"][top]
    # a baseline that failed under the address cap needed more than the cap: the ratio is then an upper bound
    ratio = peaks["moetune"][top] / (base_top or ADDRESS_CAP)
    baseline = (f"{base_top / 2**30:.2f} GiB" if base_top else
                f"over the {ADDRESS_CAP / 2**30:.0f} GiB cap (the ratio is an upper bound)")
    print(f"peak at T={top:,}: moetune {peaks['moetune'][top] / 2**30:.2f} GiB vs baseline {baseline}; "
          f"moetune's peak grows as T^{exponent:.2f}")
    print(f"longest T within {args.budget_gb:g} GiB: moetune {longest['moetune']:,}, baseline {longest['baseline']:,}")
    print(f"RESULT peak_ratio_32k={ratio:.3f} growth_exponent={exponent:.3f} "
          f"max_seq_ratio={longest['moetune'] / max(longest['baseline'], 1):.1f}")


if __name__ == "__main__":
    main()
