"""A `moetune server` process of the benchmarks' own, on loopback, its log in the work folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moetune.service.local.embedded import free_port, s3_env, wait_http


def start_server(work: Path, s3_url: str, output_uri: str, tokens: dict[str, str],
                 **settings: str) -> tuple[subprocess.Popen, str]:
    """(process, URL) of a control plane over `s3_url` with a SQLite database in `work`, its scheduler off;
    `tokens`: tenant -> API token; `settings`: more MOETUNE_* variables (name without the prefix, lower case)."""
    port = free_port()
    env = {**os.environ, **s3_env(s3_url),
           "MOETUNE_DEFAULT_OUTPUT_URI": output_uri,
           "MOETUNE_DATABASE_URL": f"sqlite:///{work / 'moetune.db'}",
           "MOETUNE_API_TOKENS": ",".join(f"{token}:{tenant}" for tenant, token in tokens.items()),
           "MOETUNE_SCHEDULER_ENABLED": "false",
           **{f"MOETUNE_{name.upper()}": value for name, value in settings.items()}}
    log = open(work / "server.log", "w")  # noqa: SIM115 - the server writes to it until it is stopped
    moetune = Path(sys.executable).with_name("moetune")
    proc = subprocess.Popen([str(moetune), "server", "--port", str(port), "--log-level", "warning"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", 60, proc, str(work / "server.log"))
    return proc, url
