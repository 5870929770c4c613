"""Kimi K3's executable reference: NeMo Automodel 0.7.0's `kimi_k3` with fla 0.6.0's pure-torch functions.

They are installed `--no-deps` into the ignored folder `.reference/kimi_k3` by `make install` (the stamp names the pins) and
only ever imported by a child process (kimi_k3_reference_child.py): transformers dispatches to fla whenever it is
importable, so fla on this process's path would change every other test."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys

import torch

PINS = ("nemo-automodel==0.7.0", "fla-core==0.6.0", "flash-linear-attention==0.6.0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(ROOT, ".reference", "kimi_k3")
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kimi_k3_reference_child.py")
# every linear both models hold as nn.Linear (the reference's routed experts are grouped parameters)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "q_a_proj",
                "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
                "routed_expert_down_proj", "routed_expert_up_proj"]


def install() -> str:
    """Installs the reference into its folder from the package registry (`make install` runs this: tests use no
    network); idempotent, safe to race. Returns the folder."""
    stamp = os.path.join(TARGET, ".pins")
    os.makedirs(os.path.dirname(TARGET), exist_ok=True)
    with open(f"{TARGET}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed():
            return TARGET
        shutil.rmtree(TARGET, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                               "--target", TARGET, *PINS], capture_output=True, text=True, timeout=600, check=False)
        if done.returncode:
            raise RuntimeError(f"installing the Kimi K3 reference ({', '.join(PINS)}) failed:\n{done.stderr[-3000:]}")
        with open(stamp, "w") as f:
            f.write("\n".join(PINS))
    return TARGET


def _installed() -> bool:
    stamp = os.path.join(TARGET, ".pins")
    return os.path.exists(stamp) and open(stamp).read() == "\n".join(PINS)


def ensure_installed() -> str:
    """The reference's folder; a clear error when `make install` has not put it there."""
    if not _installed():
        raise RuntimeError(f"the Kimi K3 reference ({', '.join(PINS)}) is not installed in {TARGET}: run `make "
                           f"install` (or `python bench/support/kimi_k3_reference.py`)")
    return TARGET


def run_reference(workdir: str, request: dict) -> dict:
    """Checkpoints written by the reference under `workdir` (bf16/, mxfp4/) and its results on each:
    {"bf16" | "mxfp4": {"logits", "loss", "lora_weights", "lora_grads"}}, LoRA tensors by released name."""
    run_child(workdir, request)
    return torch.load(os.path.join(workdir, "reference.pt"))


def run_child(workdir: str, request: dict) -> None:
    """The reference's child process on `request` (see kimi_k3_reference_child.py); its outputs land in `workdir`."""
    with open(os.path.join(workdir, "request.json"), "w") as f:
        json.dump(request, f)
    env = {**os.environ, "PYTHONPATH": ensure_installed(), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, CHILD, workdir], env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"the Kimi K3 reference failed:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}")


if __name__ == "__main__":
    print(install())
