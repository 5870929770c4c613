"""Triton-backend tests without a GPU: they run in a child pytest under TRITON_INTERPRET=1.

Triton chooses between interpreter and compiler for its own library functions (tl.zeros, ...) when it is first
imported, and this test process also compiles kernels for sm_90, so it cannot interpret them itself. A test module
marks its Triton-backend tests with `on_triton` (their ids, module name included, must contain "triton"; the
sm_90 compile checks, whose names contain "sm90", stay in this process) and imports `test_interpreter_run`,
which runs exactly those in the child and passes only if they all pass. The child's interpreter skips its repeated
patching of triton.language within a launch (tests.support.triton_interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.triton_interpreter import skip_repatching_within_a_launch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if interpreting():  # the child run
    skip_repatching_within_a_launch()


def backend_device(backend: str = "triton") -> torch.device:
    """Where a kernel backend's inputs must live: compiled Triton kernels take CUDA tensors only ("Pointer argument
    cannot be accessed from Triton (cpu tensor?)"); the interpreter and the torch backend run on CPU tensors."""
    compiled = backend == "triton" and torch.cuda.is_available() and not interpreting()
    return torch.device("cuda" if compiled else "cpu")


def to_device(device, *values):
    """`values` (tensors, QuantizedWeights, dicts or lists of them; anything else as is) on `device`; a leaf that
    requires grad stays a leaf that requires grad."""
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.detach().to(device).requires_grad_(v.requires_grad) if v.is_leaf else v.to(device)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if isinstance(v, list):
            return [move(x) for x in v]
        return v.to(device) if hasattr(v, "with_tensors") else v

    moved = [move(v) for v in values]
    return moved[0] if len(moved) == 1 else moved


on_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                               reason="run by test_interpreter_run in a child process under TRITON_INTERPRET=1")


@pytest.mark.skipif(torch.cuda.is_available() or interpreting(), reason="the child's own run, or a GPU is here")
def test_interpreter_run(request):
    """This module's Triton-backend tests through the interpreter; their results decide this test."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(request.path),
                           "-k", "triton and not sm90"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-6000:] + done.stderr[-2000:]
