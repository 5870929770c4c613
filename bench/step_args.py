"""The command line of the benchmarks that time training steps (train_step.py, quantized_base.py)."""

from __future__ import annotations

import argparse


def step_arguments(doc: str, steps: int, warmup: int, profile: bool = False) -> argparse.Namespace:
    """`profile`: the benchmark takes --profile N (print the N ops with the most self CPU time)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--micro", type=int, default=4, help="sequences per worker and step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    if profile:
        parser.add_argument("--profile", type=int, default=0, metavar="N",
                            help="profile the timed moetune steps on rank 0 and print the top N ops")
    return parser.parse_args()
