"""Deployments outlive the Serve app: a base deployed through the control plane is recorded, and a control plane
(a new one on the same database, as after `moetune down` / `up`) that finds Serve empty deploys it again.

A real HTTP server on loopback keeps an application config the way Ray's Serve REST API does (GET answers it, PUT
replaces it, a head restart forgets it), so this runs in a second; tests/e2e/test_serve.py does it on a real head."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moetune.service.cluster import deployments, serve_deploy
from moetune.service.cluster.scheduler import Scheduler
from moetune.service.store import Store
from tests.support.control_plane import settings_for

BASES = {"tiny": "s3://models/tiny"}


class _ServeApi(BaseHTTPRequestHandler):
    config: dict | None = None  # the applications PUT last; None: a fresh head, nothing deployed
    puts: list[dict] = []

    def do_GET(self):
        app = type(self).config and type(self).config["applications"][0]
        apps = {app["name"]: {"status": "RUNNING", "message": "", "deployed_app_config": app}} if app else {}
        self._answer(json.dumps({"applications": apps}).encode())

    def do_PUT(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).config = body
        type(self).puts.append(body)
        self._answer(b"{}")

    def _answer(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve_api():
    _ServeApi.config, _ServeApi.puts = None, []
    with ThreadingHTTPServer(("127.0.0.1", 0), _ServeApi) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


def _control_plane(tmp_path, serve_api):
    settings = settings_for(tmp_path, ray_address=serve_api, serve_url="http://127.0.0.1:8001")
    store = Store(settings.database_url)
    store.migrate()
    return store, settings


def test_a_control_plane_that_finds_serve_empty_deploys_again(tmp_path, serve_api):
    store, settings = _control_plane(tmp_path, serve_api)
    assert deployments.deploy(store, settings, BASES) == "DEPLOYING"
    assert _ServeApi.config["applications"][0]["args"]["bases"] == BASES and len(_ServeApi.puts) == 1

    _ServeApi.config = None  # the Ray head restarted (or `moetune down` / `up`): Serve forgot the app
    store.close()
    store, settings = _control_plane(tmp_path, serve_api)  # a control plane started again on the same database
    restorer = deployments.DeploymentRestorer(store, settings)
    assert restorer.restore() == BASES
    assert _ServeApi.config["applications"][0]["args"]["bases"] == BASES
    assert _ServeApi.config["applications"][0]["import_path"] == serve_deploy.APP_BUILDER

    restorer._next_check = 0.0  # the next period: Serve runs it, nothing more to do
    assert restorer.restore() == {} and len(_ServeApi.puts) == 2


def test_the_scheduler_pass_restores_and_checks_once_per_period(tmp_path, serve_api):
    store, settings = _control_plane(tmp_path, serve_api)
    scheduler = Scheduler(store, settings)
    scheduler.tick()
    assert _ServeApi.puts == []  # nothing deployed, nothing to bring back (and no call to Ray)
    deployments.deploy(store, settings, BASES)
    _ServeApi.config = None
    scheduler.tick()  # within the period: no check
    assert _ServeApi.config is None
    scheduler.deployments._next_check = 0.0
    scheduler.tick()
    assert _ServeApi.config["applications"][0]["args"]["bases"] == BASES
