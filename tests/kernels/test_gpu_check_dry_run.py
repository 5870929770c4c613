"""bench/gpu_check.py, the prepared one-GPU check, runs as it is: its --dry-run takes every stage's code path on
this CPU (Triton through the interpreter, gloo, tiny shapes), writes each stage's JSON line to $OUT and ends with
a RESULT line that reports no failed stage. (The compile stage's sm_90 builds are test_compile_sm90.py's.)"""

import json
import os
import subprocess
import sys

from tests.support import REPO


def test_gpu_check_dry_run_passes_every_stage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OUT": str(tmp_path),
                                                                             "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    stages = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == ["env", "compile", "correctness", "syncs", "job_step", "bench"]
    assert not any("error" in s for s in stages), stages
    by_stage = {s["stage"]: s for s in stages}
    assert "skipped" in by_stage["compile"]  # its sm90_report is tests/kernels/test_compile_sm90.py's
    assert by_stage["correctness"]["rmse_ratio"] and by_stage["job_step"]["losses"]
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT failed=none "), result
