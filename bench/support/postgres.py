"""A real PostgreSQL server on loopback (initdb + pg_ctl, the Debian package's binaries) and fresh databases on it:
what the control-plane replicas share in tests/service and bench/cluster_faults.py."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from moetune.service.local.embedded import free_port


def postgres_bin() -> str | None:
    """The folder of initdb and pg_ctl (on PATH, else the newest /usr/lib/postgresql/*/bin); None if not
    installed."""
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(candidates[-1]) if candidates else None


@contextmanager
def running_postgres() -> Iterator[str]:
    """Starts a server in a temporary folder; yields a SQLAlchemy URL prefix without a database; stops it and
    removes the folder.

    PostgreSQL refuses to run as root, so as root the server runs as the `postgres` system user.
    """
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL server binaries are not installed (Debian package postgresql)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = tempfile.mkdtemp(prefix="moetune-pg-")
    if as_user:
        shutil.chown(root, "postgres")
    data, port = os.path.join(root, "data"), free_port()
    subprocess.run([*as_user, f"{bin_dir}/initdb", "-D", data, "-A", "trust", "-U", "moetune"], check=True,
                   capture_output=True)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-o", opts, "-l", f"{root}/log", "-w", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://moetune@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server at `server_url` (running_postgres's prefix); its SQLAlchemy URL."""
    from sqlalchemy import create_engine, text

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(f"{server_url}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"{server_url}/{name}"
