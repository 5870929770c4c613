"""GRPO through a training session: the policy answers templated sums ("3+4="), a verifier scores each answer, and
each group of answers to one question is its own baseline (advantage = reward - group mean, over the group's std).

    python examples/rl_grpo.py --model tiny-kimi-k3 --iterations 20        # against `moetune up --with-demo-assets`

Run in the stack's folder it finds the stack as the `moetune` command does (--url/--token, else MOETUNE_URL and
MOETUNE_TOKEN, else the stack of ./.moetune).

The reward checks the first character of the answer against the sum: 1 for the right digit, less the further its
character code is from it (a tiny random base rarely says the digit itself; the shaped part gives every group a
signal). The loss is importance sampling on the sampler's log-probabilities (`--loss ppo` clips the ratio).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import httpx

from moetune.api.client import Client
from moetune.api.training import Session, Training
from moetune.service.local.stack import connection, down_message


def question(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(5)
    b = rng.randrange(5)
    return f"{a}+{b}=", str(a + b)


def reward(text: str, answer: str) -> float:
    if not text:
        return 0.0
    return max(0.0, 1.0 - abs(ord(text[0]) - ord(answer)) / 64)


def datum(sequence: dict, advantage: float) -> dict:
    """The prompt and the answer as one sequence; only the answer's tokens carry the advantage and the loss."""
    prompt, answer = sequence["prompt_tokens"], sequence["tokens"]
    pad = [0.0] * len(prompt)
    return {"tokens": prompt + answer, "weights": pad + [1.0] * len(answer),
            "advantages": pad + [advantage] * len(answer), "logprobs": pad + sequence["logprobs"]}


def grpo(session: Session, iterations: int, questions: int = 4, group_size: int = 4, max_tokens: int = 2,
         learning_rate: float = 2e-2, loss_fn: str = "importance_sampling", seed: int = 0,
         log=print) -> list[float]:
    """Runs the loop; returns the mean reward of each iteration's samples (drawn before its update)."""
    rng = random.Random(seed)
    means = []
    for iteration in range(iterations):
        asked = [question(rng) for _ in range(questions)]
        sampled = session.sample([q for q, _ in asked], n=group_size, max_tokens=max_tokens, temperature=1.0,
                                 seed=seed * 100_003 + iteration).result(timeout=300)["sequences"]
        rewards = [reward(s["text"], asked[s["prompt_index"]][1]) for s in sampled]
        data = []
        for g in range(questions):
            group = rewards[g * group_size : (g + 1) * group_size]
            mean, spread = statistics.fmean(group), statistics.pstdev(group)
            data += [datum(s, (r - mean) / (spread + 1e-4))
                     for s, r in zip(sampled[g * group_size : (g + 1) * group_size], group)]
        session.forward_backward(data, loss_fn=loss_fn)
        session.optim_step(learning_rate=learning_rate).result(timeout=300)  # the calls run in order
        exact = sum(s["text"][:1] == asked[s["prompt_index"]][1] for s in sampled) / len(sampled)
        means.append(statistics.fmean(rewards))
        log(f"iteration {iteration + 1}: mean reward {means[-1]:.3f}, exact answers {exact:.0%}")
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("MOETUNE_URL"),
                        help="The control plane [default: MOETUNE_URL, else the `moetune up` stack of this folder].")
    parser.add_argument("--token", default=os.environ.get("MOETUNE_TOKEN"),
                        help="[default: MOETUNE_TOKEN, else that stack's]")
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "ppo"])
    args = parser.parse_args()
    url, token, stack = connection(args.url, args.token)
    with Client(url, token) as client:
        try:
            session = Training(client).create({"model": args.model, "parallelism": {"num_workers": args.workers},
                                               "lora": {"rank": 8, "alpha": 16, "dropout": 0.0}})
        except httpx.ConnectError as e:
            sys.exit(down_message() if stack else f"cannot reach the control plane at {url}: {e}")
        try:
            session.wait_ready(timeout=600)
            means = grpo(session, args.iterations, group_size=args.group_size, loss_fn=args.loss)
            uri = session.save_weights("grpo").result(timeout=300)["uri"]
            print(f"mean reward {means[0]:.3f} -> {means[-1]:.3f}; adapter {uri}")
        finally:
            session.close()


if __name__ == "__main__":
    main()
