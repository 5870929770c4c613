"""The Ray token the chart hands the head and the control plane is what Ray 2.60 actually checks.

A real Ray head runs here with the rendered head container's RAY_AUTH_* environment; a Jobs API client with the
rendered control plane's environment gets in, and one with another token does not.
"""

from __future__ import annotations

import subprocess
import sys

from moetune.service.local.embedded import local_ray_head

LIST_JOBS = "import sys; from ray.job_submission import JobSubmissionClient as C; C(sys.argv[1]).list_jobs()"


def _ray_auth(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("RAY_AUTH_")}


def test_control_plane_env_passes_ray_token_auth_and_a_wrong_token_does_not(render, tmp_path):
    rendered = render({})
    head = rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_auth = _ray_auth(rendered.resolve_env(head))
    control_plane_auth = _ray_auth(rendered.resolve_env(rendered.control_plane))
    assert head_auth["RAY_AUTH_MODE"] == "token" and control_plane_auth == head_auth

    def list_jobs(address: str, auth: dict[str, str]) -> subprocess.CompletedProcess:
        # HOME is empty: no ~/.ray/auth_token to fall back on, only the environment counts.
        return subprocess.run([sys.executable, "-c", LIST_JOBS, address], capture_output=True, text=True,
                              timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **auth})

    with local_ray_head(num_cpus=1, env=head_auth) as ray:
        allowed = list_jobs(ray.dashboard_url, control_plane_auth)
        assert allowed.returncode == 0, allowed.stderr[-2000:]
        refused = list_jobs(ray.dashboard_url, {**control_plane_auth, "RAY_AUTH_TOKEN": "not-the-token"})
        assert refused.returncode != 0
        assert "Invalid authentication token" in refused.stderr, refused.stderr[-2000:]
