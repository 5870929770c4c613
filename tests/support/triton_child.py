"""Triton-backend tests without a GPU: they run in a child pytest under TRITON_INTERPRET=1.

Triton chooses between interpreter and compiler for its own library functions (tl.zeros, ...) when it is first
imported, and this test process also compiles kernels for sm_90, so it cannot interpret them itself. A test module
marks its Triton-backend tests with `on_triton` (their ids, module name included, must contain "triton"; the
sm_90 compile checks, whose names contain "sm90", stay in this process) and imports `test_interpreter_run`,
which runs exactly those in the child and passes only if they all pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


on_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                               reason="run by test_interpreter_run in a child process under TRITON_INTERPRET=1")


@pytest.mark.skipif(torch.cuda.is_available() or interpreting(), reason="the child's own run, or a GPU is here")
def test_interpreter_run(request):
    """This module's Triton-backend tests through the interpreter; their results decide this test."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(request.path),
                           "-k", "triton and not sm90"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-6000:] + done.stderr[-2000:]
