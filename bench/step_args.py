"""The command line of the benchmarks that time training steps (train_step.py, quantized_base.py)."""

from __future__ import annotations

import argparse


def step_arguments(doc: str, steps: int, warmup: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--micro", type=int, default=4, help="sequences per worker and step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    return parser.parse_args()
