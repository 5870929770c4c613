"""The installed distribution exposes one import name, `moetune`: nothing generic such as `api` or `kernels` lands
in a user's site-packages, and Hugging Face's `kernels` package (which transformers probes for) installs beside it."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

from moetune.service.settings import Settings
from tests.support import REPO


def test_the_distribution_has_one_top_level_name():
    dist = importlib.metadata.distribution("moetune")
    assert set(dist.read_text("top_level.txt").split()) == {"moetune"}
    assert dist.entry_points.select(group="console_scripts")["moetune"].value == "moetune.service.cli.main:main"


def test_hugging_face_kernels_imports_beside_moetune(tmp_path):
    """Run where the repository is not on sys.path, as a user's process is."""
    code = ("import importlib.util, json, kernels, moetune.kernels.kda\n"
            "print(json.dumps({'hf': kernels.__file__, 'ours': moetune.kernels.kda.__file__,"
            " 'api': importlib.util.find_spec('api') is None,"
            " 'workers': importlib.util.find_spec('workers') is None}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    found = json.loads(out.stdout)
    assert "site-packages" in found["hf"] and found["hf"] != str(REPO / "kernels" / "__init__.py")
    assert found["ours"].startswith(str(REPO / "kernels"))
    assert found["api"] and found["workers"], "a generic top-level name is importable"


def test_the_ray_jobs_entrypoint_names_an_installed_module():
    python, flag, module = Settings().driver_entrypoint.split()
    assert (python, flag) == ("python", "-m") and importlib.util.find_spec(module) is not None
