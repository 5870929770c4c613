"""The import rules of docs/architecture.md (contracts in pyproject.toml), enforced, and the map kept true."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_control_plane_import_does_not_load_the_training_stack():
    """Of the workers' code, the control plane reads only the families' facts (each in its folder, torch-free)."""
    code = (
        "import sys, moetune.service.app, moetune.service.cli.main, moetune.api.client\n"
        "from moetune.api.families import FAMILIES\n"
        "facts = {'moetune.workers', 'moetune.workers.families', 'moetune.workers.families.linears'}"
        " | {f'moetune.workers.families.{t}{m}' for t in FAMILIES for m in ('', '.facts')}\n"
        "heavy = sorted(m for m in sys.modules if m in ('torch', 'transformers', 'deepspeed', 'peft')"
        " or m.startswith('moetune.workers') and m not in facts)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"control plane imported: {out.stdout.strip()}"


def _rooms(package: str) -> list[str]:
    return sorted(p.parent.name for p in (ROOT / package).glob("*/__init__.py"))


def test_every_room_is_on_the_map_and_says_what_it_is():
    """docs/architecture.md names every room of workers/ and service/ and every kernel folder; each room's docstring
    says what it is (no TODO)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rooms = {package: _rooms(package) for package in ("workers", "service", "kernels")}
    assert [f"{package}/{room}" for package in ("workers", "service") for room in rooms[package]
            if f"\n{room}/ " not in text] == []
    assert [op for op in rooms["kernels"] if f"`{op}`" not in text] == []
    for package, names in rooms.items():
        for room in names:
            doc = ast.get_docstring(ast.parse((ROOT / package / room / "__init__.py").read_text()))
            assert doc and "TODO" not in doc, f"{package}/{room}/__init__.py"
