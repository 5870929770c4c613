"""workers/settings.py is the one reader of the environment in moetune.workers, and its fields are the job's
variables (moetune.api.environment)."""

import ast
from pathlib import Path

from moetune.api import environment
from moetune.workers.settings import WorkerSettings

WORKERS = Path(__file__).resolve().parents[2] / "workers"


def _environment_reads(source: str) -> list[int]:
    """Lines that read the environment. Writing it (`os.environ[k] = v`, `del os.environ[k]`,
    `os.environ.update(...)`: for Ray or a child process) is not reading it."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def writes(node: ast.Attribute) -> bool:
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript):
            return isinstance(parent.ctx, (ast.Store, ast.Del))
        return isinstance(parent, ast.Attribute) and parent.attr == "update"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            reads += [node.lineno] if {a.name for a in node.names} & {"environ", "environb", "getenv"} else []
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("getenv", "environb") or (node.attr == "environ" and not writes(node)):
                reads.append(node.lineno)
    return reads


def test_the_check_tells_reads_from_writes():
    assert _environment_reads("import os\nos.environ['A'] = '1'\ndel os.environ['A']\nos.environ.update({})\n") == []
    for read in ("os.environ.get('A')", "os.environ['A']", "os.getenv('A')", "{**os.environ}",
                 "os.environ.setdefault('A', '1')", "from os import environ"):
        assert _environment_reads(read) == [1], read


def test_only_the_settings_module_reads_the_environment():
    found = {str(path.relative_to(WORKERS)): lines for path in sorted(WORKERS.rglob("*.py"))
             if path != WORKERS / "settings.py" and (lines := _environment_reads(path.read_text()))}
    assert found == {}


def test_every_job_variable_is_a_field():
    names = {name for name, value in vars(environment).items() if name.startswith("ENV_")}
    fields = {info.validation_alias or f"MOETUNE_{field.upper()}" for field, info in WorkerSettings.model_fields.items()}
    assert sorted(getattr(environment, name) for name in names if getattr(environment, name) not in fields) == []


def test_settings_parse_the_variables_as_the_driver_sets_them(monkeypatch):
    monkeypatch.setenv("MOETUNE_WEIGHTS_CACHE_DIR", "")
    monkeypatch.setenv("MOETUNE_WEIGHTS_CACHE_MAX_GB", "1.5")
    monkeypatch.setenv("MOETUNE_METRICS_PORT", " off ")
    monkeypatch.setenv("MOETUNE_MAX_WORKER_FAILURES", "5")
    monkeypatch.setenv("MOETUNE_IMAGE_LIMITS", '{"max_images_per_row": 2}')
    monkeypatch.setenv("MOETUNE_URI_ACCESS", "")
    settings = WorkerSettings()
    assert (settings.weights_cache_dir, settings.weights_cache_max_bytes, settings.metrics_port) == (None, 1.5e9, "off")
    assert settings.max_worker_failures == 5 and settings.image_limits.max_images_per_row == 2
    assert settings.uri_access.allow_file_uris  # unset or empty: a driver started by hand reads what its data names
