"""The import rules of DESIGN.md, enforced."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_control_plane_import_does_not_load_the_training_stack():
    code = (
        "import sys, moetune.service.app, moetune.service.cli, moetune.api.client\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'deepspeed', 'peft', 'moetune.workers')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"control plane imported: {out.stdout.strip()}"
