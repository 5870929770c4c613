"""tinker-cookbook's loops, unmodified, against moetune (tests/tinker/cookbook_recipes.py): the supervised loop
(`supervised.train` through `recipes/sl_basic.py`'s main) on a local JSONL of conversations, and the RL loop
(`rl.train`, as `recipes/rl_basic.py` runs it) on an answer-key environment. Each runs as a child process given only
what a user gives it (the `cookbook` fixture: the two Tinker variables, an offline tokenizer cache, no network), and
makes its own training client, so its own session group. The SFT loss falls and the RL reward rises in the loops' own
metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support import REPO

pytestmark = pytest.mark.ray_job

CONVERSATIONS = [("Spell moe.", "m-o-e"), ("Spell tiny.", "t-i-n-y"), ("Spell lora.", "l-o-r-a"),
                 ("Spell ray.", "r-a-y")]


def _run(cookbook: dict, loop: str, *args: str) -> None:
    """One loop of tests/tinker/cookbook_recipes.py in the cookbook's environment; its output and the control
    plane's log's tail make the failure message."""
    done = subprocess.run([sys.executable, "-m", "tests.tinker.cookbook_recipes", loop, *args], env=cookbook["env"],
                          cwd=REPO, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, (f"the {loop} loop exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-6000:]}\n--- control plane ---\n"
                                  f"{cookbook['server_log'].read_text()[-3000:]}")


def _metrics(log_path: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in sorted(rows, key=lambda r: r["step"]) if key in row]


def test_the_cookbooks_supervised_loop_lowers_the_loss(cookbook, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    _run(cookbook, "sl", f"model_name={cookbook['model']}", f"log_path={tmp_path / 'sft'}",
         f"dataset_builder.file_path={data}")
    losses = _metrics(tmp_path / "sft", "train_mean_nll")
    # one batch, four epochs of it: 5.93 -> 2.10 (5.93 throughout with learning_rate=1e-9)
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses


def _answer_key(checkpoint: Path) -> list[int]:
    """The tokens whose row of the output head has a positive first entry: about half the vocabulary, all on one
    side of one direction of the last hidden state, which LoRA can move the model along in a few steps (a random
    half of the tokens shares no such direction: a tiny model's head spans too few logits to learn it quickly)."""
    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    with safe_open(checkpoint / shard, "pt") as f:
        head = f.get_tensor("lm_head.weight")
    return (head[:, 0] > 0).nonzero().flatten().tolist()


def test_the_cookbooks_rl_loop_raises_the_reward(cookbook, tiny_assets, tmp_path):
    key = tmp_path / "key.json"
    key.write_text(json.dumps(_answer_key(tiny_assets["local_model"])))
    _run(cookbook, "rl", f"model_name={cookbook['model']}", f"log_path={tmp_path / 'rl'}",
         f"dataset_builder.key_file={key}")
    rewards = _metrics(tmp_path / "rl", "env/all/reward/total")
    # from about half (the base's share of the key) up, the first two steps' mean against the last two's: 0.53 ->
    # 0.75 over 8 steps (at 6 steps 0.54 -> 0.65 and 0.54 -> 0.69); 0.55 -> 0.56 with learning_rate=1e-9 (a step's
    # mean varies by ~0.03 between runs: the margin is twice that)
    print("rewards per step", [round(r, 3) for r in rewards])
    assert len(rewards) == 8 and sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.06, rewards
