"""`moetune up` / `moetune down`: the S3 server and the control plane as background processes (here on the
session's Ray head), their data kept across a restart, and the CLI finding the stack of the directory; and one stack
with a Ray head of its own, started by the README's "Run it locally" commands run word for word (through
`moetune jobs deploy` to a chat with the tuned model, then `moetune down`), whose every component is then killed
under a running job and brought back by `moetune up`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
from click.testing import CliRunner
from ray.job_submission import JobSubmissionClient

from bench.support.waiting import wait_for
from moetune.api.client import Client
from moetune.api.layout import CHECKPOINT_MANIFEST
from moetune.service.cli import main as cli
from moetune.service.local import embedded, processes
from moetune.service.local import stack as local_stack
from moetune.service.local.embedded import s3_env

REPO = Path(__file__).resolve().parents[2]
JOB_ID = "ftjob-..."  # how the README's lines stand for the id `moetune submit` printed


def _run(*args):
    result = CliRunner().invoke(cli.main, list(args), catch_exceptions=False, env={"MOETUNE_URL": None,
                                                                                   "MOETUNE_TOKEN": None})
    assert result.exit_code == 0, result.output
    return result.output


def test_up_prints_how_to_reach_it_keeps_data_across_down_and_up(ray_head, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stack of this directory: .moetune/
    for name in [*s3_env(""), "MOETUNE_RAY_ADDRESS", "MOETUNE_SERVE_URL"]:  # `up` and the CLI set them here: the session's come back
        monkeypatch.delenv(name, raising=False)
    output = _run("up", "--ray-address", ray_head.dashboard_url)
    stack = local_stack.read_stack()
    assert f"control plane {stack.url} (token {stack.token})" in output
    assert f"web console: {stack.url}/console " in output
    assert "Sign in" in httpx.get(f"{stack.url}/console/login").text  # the printed address serves the console
    assert f"export MOETUNE_URL={stack.url}" in output and f"export MOETUNE_TOKEN={stack.token}" in output
    assert f"export MOETUNE_S3_ENDPOINT_URL={stack.s3_endpoint}" in output
    assert f"export MOETUNE_RAY_ADDRESS={ray_head.dashboard_url}" in output
    assert f"export MOETUNE_SERVE_URL={stack.serve_url}" in output and stack.serve_url != "http://127.0.0.1:8001"
    try:
        uploaded = Client(stack.url, stack.token).files.create(b'{"text": "kept"}\n', "kept.jsonl")
        s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint)
        s3.put_object(Bucket="moetune", Key="outputs/", Body=b"")  # a folder marker, as Ray Train writes them
        s3.put_object(Bucket="moetune", Key="outputs/run/adapter.bin", Body=b"weights")
        for name in s3_env(""):
            monkeypatch.delenv(name)
        assert _run("jobs", "list").split() == ["id", "status", "step", "loss", "created", "model"]  # found it
        # and handed its Ray address and S3 credentials to the command (jobs deploy, serve, models download)
        handed = {name: value for name, value in stack.env().items() if name not in ("MOETUNE_URL", "MOETUNE_TOKEN")}
        assert {name: os.environ.get(name) for name in handed} == handed
        reply = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {stack.token}"},
                           json={"model": "s3://moetune/models/x", "training_file": "file:///etc/passwd"})
        assert (reply.status_code, reply.json()["error"]["param"]) == (422, "training_file")  # file:// is off
        assert _run("down") == "down; data kept in .moetune\n"
        assert not local_stack.read_stack() and not any(processes.alive(p) for p in stack.pids.values())
        # the stack's URL, not `moetune server`'s default, and what to do about it
        stopped = CliRunner().invoke(cli.main, ["jobs", "list"], env={"MOETUNE_URL": None, "MOETUNE_TOKEN": None})
        assert (stopped.exit_code, stopped.output) == (1, f"Error: {local_stack.down_message()}\n")
        assert "./.moetune is down" in stopped.output and "run `moetune up`" in stopped.output
        example = subprocess.run([sys.executable, str(REPO / "examples/rl_grpo.py"), "--iterations", "1"],
                                 env={k: v for k, v in os.environ.items() if k not in ("MOETUNE_URL", "MOETUNE_TOKEN")},
                                 capture_output=True, text=True, timeout=120)
        assert (example.returncode, example.stderr) == (1, f"{local_stack.down_message()}\n")  # as the CLI finds it

        _run("up", "--ray-address", ray_head.dashboard_url)
        again = local_stack.read_stack()
        assert (again.url, again.token) == (stack.url, stack.token)  # same address and token
        assert Client(again.url, again.token).files.content(uploaded.id) == b'{"text": "kept"}\n'
        s3 = boto3.client("s3", endpoint_url=again.s3_endpoint)
        assert s3.get_object(Bucket="moetune", Key="outputs/run/adapter.bin")["Body"].read() == b"weights"
    finally:
        _run("down")
    assert _run("down") == "nothing was up\n"


def test_a_driver_failing_on_a_vanished_ray_actor_requeues_its_job_while_ray_is_gone(service):
    """The driver of a job whose Ray head died reports ActorUnavailableError: with Ray unreachable or not knowing
    the submission (this control plane never submitted it) that is the head's loss, so the job goes back to the
    queue as its next attempt (resuming from its last checkpoint); the run's own failure still fails it."""
    lost, failing = service.create_job()["id"], service.create_job()["id"]
    error = {"code": "training_failed", "message": "ActorUnavailableError: The actor is unavailable"}
    reply = service.report(lost, service.start_job(lost), {"kind": "result", "status": "failed", "error": error})
    assert reply.status_code == 200, reply.text
    row = service.store.get_job(lost)
    assert (row.status, row.attempt) == ("queued", 2)
    last = service.sdk().jobs.events_since(lost)[-1]
    assert last.level == "warn" and last.message.startswith("Job requeued: ")
    assert last.message.endswith("the next attempt continues from its last checkpoint")

    error = {"code": "training_failed", "message": "ValueError: the run's own"}
    service.report(failing, service.start_job(failing), {"kind": "result", "status": "failed", "error": error})
    assert service.store.get_job(failing).status == "failed"


def _pids() -> dict[str, int]:
    return json.loads(Path(".moetune/stack.json").read_text())["pids"]


def _messages(client: Client, job_id: str) -> list[str]:
    return [e.message for e in client.jobs.events_since(job_id)]


def readme_commands(section: str = "Run it locally") -> list[str]:
    """The lines of the README section's fenced shell blocks, as a user copies them (comments included: the shell
    drops them)."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(?:bash|sh)\n(.*?)^```", body, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


class ReadmeWalk:
    """The README's commands run one by one by bash in a fresh project directory holding what a clone has
    (examples/), with the venv's `moetune` first on PATH and no moetune, S3 or Ray variable set: its first line,
    `make install && . .venv/bin/activate`, is what the test environment already is (the venv installed, its bin
    on PATH), so it is the one line not run."""

    def __init__(self, directory: Path):
        self.directory = directory
        shutil.copytree(REPO / "examples", directory / "examples")
        lines = readme_commands()
        assert lines[0].startswith("make install && . .venv/bin/activate"), lines[0]
        self.lines = lines[1:]
        unset = set(s3_env(""))  # with every MOETUNE_ variable: the CLI must find the stack by itself
        self.env = {name: value for name, value in os.environ.items()
                    if name not in unset and not name.startswith("MOETUNE_")}
        venv_bin = Path(sys.executable).parent  # what activate does
        self.env.update(PATH=f"{venv_bin}{os.pathsep}{self.env.get('PATH', '')}", VIRTUAL_ENV=str(venv_bin.parent))
        self.job_id = ""
        self.is_down = False
        self.seconds: dict[str, float] = {}  # what each line took

    def run(self, line: str, stdin: str = "") -> str:
        """Runs one README line (the job id put in for `ftjob-...`); fails with its output unless it exits 0."""
        command = line.replace(JOB_ID, self.job_id) if JOB_ID in line else line
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", command], cwd=self.directory, env=self.env, input=stdin, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        self.seconds[line.split("#")[0].strip()] = time.monotonic() - started
        assert done.returncode == 0, f"$ {command}\n{done.stdout}"
        return done.stdout

    def lines_with_job(self) -> list[str]:
        with_job = [line for line in self.lines if JOB_ID in line]
        assert with_job, f"the README's walk names no job ({JOB_ID}): {self.lines}"
        return with_job

    def down(self) -> None:
        """The README's lines after the job's (`moetune down`), once; then no process of the stack is left."""
        self.is_down = True
        stack_id = json.loads((self.directory / ".moetune/stack.json").read_text())["stack_id"]
        after = self.lines[self.lines.index(self.lines_with_job()[-1]) + 1:]
        for line in after or ["moetune down"]:  # the stack goes even when the README forgot to say how
            output = self.run(line)
        assert [line.split()[:2] for line in after] == [["moetune", "down"]], f"the walk's end is not down: {after}"
        assert "down; data kept in .moetune" in output
        assert processes.tagged(stack_id) == []  # every process the stack started, Ray's workers and drivers too


@pytest.fixture(scope="module")
def readme_walk(tmp_path_factory):
    """The README walk up to its job: `moetune up --with-demo-assets` and the job file submitted and followed to
    its end; `moetune down` at the end of the module if a test did not run it."""
    walk = ReadmeWalk(tmp_path_factory.mktemp("readme-walk"))
    try:
        for line in walk.lines[:walk.lines.index(walk.lines_with_job()[0])]:
            output = walk.run(line)
            if submitted := re.search(r"^submitted (ftjob-\S+)", output, flags=re.M):
                walk.job_id = submitted[1]
        assert walk.job_id, f"no line of the walk submitted a job: {walk.lines}"
        yield walk
    finally:
        if (walk.directory / ".moetune/stack.json").exists() and not walk.is_down:
            walk.down()
        print("README walk, seconds per line:", json.dumps({k: round(v, 1) for k, v in walk.seconds.items()}))


@pytest.mark.ray_job
def test_the_readme_walk_reaches_a_chat_with_the_tuned_model_through_jobs_deploy(readme_walk):
    """`moetune jobs deploy <id>` then `moetune chat <its model>` as the README writes them, with no variable set:
    the CLI finds the stack's Ray address and the Serve app's URL in the directory, and the tuned model answers."""
    job = json.loads(readme_walk.run(f"moetune jobs get {readme_walk.job_id}"))
    assert job["status"] == "succeeded", job
    deploy, chat = readme_walk.lines_with_job()
    assert deploy.startswith("moetune jobs deploy ") and chat.startswith("moetune chat "), (deploy, chat)
    deployed = readme_walk.run(deploy)
    model = job["fine_tuned_model"]
    assert f"{model}: RUNNING" in deployed or f"{model}: DEPLOYING\nServe app: RUNNING" in deployed, deployed
    said_model = chat.split("#")[0].split()[2].replace(JOB_ID, readme_walk.job_id)
    assert said_model == model, f"the README chats with {said_model}, deploy served {model}"
    answer = readme_walk.run(chat, stdin="What colour is the sky?\n")
    # `you> ` is the prompt; the model's streamed answer follows its name
    assert re.search(rf"{re.escape(said_model)}> .*\S", answer), answer
    print(f"README walk, the tuned model's answer: {answer.split(f'{said_model}> ', 1)[1].strip()!r}")


@pytest.mark.ray_job
def test_the_rl_example_runs_in_the_stacks_folder_as_the_cli_does(readme_walk):
    """examples/rl_grpo.py with no variable set finds the stack of the folder (as `moetune` does): a training
    session on the demo model, one GRPO iteration, its weights saved."""
    output = readme_walk.run("python examples/rl_grpo.py --iterations 1")
    assert re.search(r"^iteration 1: mean reward \d", output, flags=re.M), output
    assert re.search(r"^mean reward .* adapter s3://\S+$", output, flags=re.M), output


@pytest.mark.ray_job
def test_up_brings_back_each_killed_component_and_the_job_resumes_losing_nothing(readme_walk, monkeypatch):
    """One tiny job on the README walk's stack (a Ray head of its own); the control plane, then the S3 server, then
    the Ray head are SIGKILLed (by their PID in stack.json) while it trains, `moetune up` after each: each comes
    back on its ports and data, beside no second copy; files stay listed and readable; the job is followed again,
    then requeued when the head goes and resumes from its last checkpoint to succeed; the README's `moetune down`
    leaves no process."""
    started = time.monotonic()
    monkeypatch.chdir(readme_walk.directory)
    for name in [*s3_env(""), "MOETUNE_RAY_ADDRESS", "MOETUNE_SERVE_URL"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOETUNE_API_TOKENS", "carol-token:carol")  # the user's own tenant stays beside ours
    output = _run("up", "--tenant", "bob")  # the control plane restarts to know the tenants
    assert "server restarted" in output and "s3 adopted" in output and "ray adopted" in output, output
    stack = local_stack.read_stack()
    seen = set(_pids().values())  # every process-group leader the stack had, checked gone at the end
    assert f"tenant bob: token {stack.tenants['bob']}" in output
    me, bob = Client(stack.url, stack.token), Client(stack.url, stack.tenants["bob"])
    s3 = boto3.client("s3", endpoint_url=stack.s3_endpoint)
    try:
        assert Client(stack.url, "carol-token").files.list().data == []
        files = {me.files.create(b'{"text": "before"}\n', "before.jsonl").id: b'{"text": "before"}\n'}
        bobs = bob.files.create(b'{"text": "bob"}\n', "bob.jsonl").id
        walked = me.jobs.retrieve(readme_walk.job_id)  # the README's job: its base and data
        job = me.jobs.create({
            "model": walked.model, "training_file": walked.training_file, "seed": 7,
            "lora": {"rank": 8, "alpha": 16}, "parallelism": {"num_workers": 1},
            "training": {"max_steps": 36, "learning_rate": 0.003, "global_batch_size": 4, "micro_batch_size": 2,
                         "seq_len": 64, "checkpoint_every": 6}}).id

        def step() -> int:
            return me.jobs.retrieve(job).progress.step or 0

        def checkpointed() -> int:
            state = me.jobs.retrieve(job)
            assert state.status not in ("failed", "cancelled"), (state.status, _messages(me, job)[-15:])
            return max((c.step_number for c in me.jobs.checkpoints(job).data), default=0)

        def written() -> int:
            """The newest checkpoint the job wrote to storage (its manifest), which its report may reach the control
            plane long after: reports queued through the outages are delivered late."""
            bucket, _, prefix = me.jobs.retrieve(job).output_uri.removeprefix("s3://").partition("/")
            listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/checkpoints/").get("Contents", [])
            return max((int(o["Key"].split("/step-")[1].split("/")[0]) for o in listed
                        if o["Key"].endswith(f"/{CHECKPOINT_MANIFEST}")), default=0)

        def up_says(*actions: str) -> None:
            said = _run("up")
            for action in actions:
                assert action in said, said
            seen.update(_pids().values())

        # 1. The control plane: restarted on its port, it follows the running Ray job again.
        wait_for(lambda: step() >= 2, 400, "the job to train")
        os.kill(_pids()["server"], signal.SIGKILL)
        up_says("server restarted", "s3 adopted", "ray adopted")
        assert local_stack.read_stack().url == stack.url
        before = step()
        wait_for(lambda: step() > before, 120, "progress reported to the restarted control plane")
        files[me.files.create(b'{"text": "after"}\n', "after.jsonl").id] = b'{"text": "after"}\n'

        # 2. S3, right after a checkpoint: /readyz names storage while it is down; its objects come back.
        first = wait_for(checkpointed, 200, "a checkpoint")
        os.kill(_pids()["s3"], signal.SIGKILL)
        ready = httpx.get(f"{stack.url}/readyz", timeout=30)
        assert ready.status_code == 503 and "storage" in ready.json()["error"]["message"]
        up_says("s3 restarted", "ray adopted", "server adopted")
        assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 200
        assert {f: me.files.content(f) for f in files} == files
        assert bob.files.content(bobs) == b'{"text": "bob"}\n'

        # 3. The Ray head, once a checkpoint newer than the one listed before the S3 outage is in storage (not
        # once it is listed: the job could have ended by then): the job is requeued, not failed, and its next
        # attempt on the restarted head resumes from that checkpoint or a newer one.
        try:
            resume_step = wait_for(lambda: checkpointed() >= 0 and (c := written()) > first and c, 300,
                                   "a checkpoint after the S3 restart")
        except AssertionError as timeout:  # what the job said is what tells a stall from a slow restart
            raise AssertionError(f"{timeout}; step {step()}, events: {_messages(me, job)[-15:]}") from None
        os.kill(_pids()["ray"], signal.SIGKILL)
        killed_at = f"the Ray head was killed with checkpoint {resume_step} in storage, step {step()} reported"
        up_says("ray restarted", "s3 adopted")
        done = me.jobs.wait(job, timeout=600, poll_interval=2)
        assert done.status == "succeeded", done.error
        messages = _messages(me, job)
        assert not [m for m in messages if m.startswith("Job failed")]
        # none: the job had ended before the kill (its 36 steps outran the restarts of a loaded machine)
        assert len([m for m in messages if m.startswith("Job requeued")]) == 1, (killed_at, messages)
        assert [m for m in messages if m.startswith("Job started")] == ["Job started"] * 2
        resumed = [m for m in messages if m.startswith("Resumed from checkpoint")]
        assert resumed and int(resumed[-1].split("step-")[1].split()[0]) >= resume_step, messages
        assert [s.submission_id for s in JobSubmissionClient(stack.ray_address).list_jobs()] == [f"moetune-{job}-2"]

        # Nothing lost or duplicated: every checkpoint listed (those reported while S3 was down too), one job,
        # every file listed and readable, the adapter in storage.
        assert sorted(c.step_number for c in me.jobs.checkpoints(job).data) == list(range(6, 37, 6))
        assert [j.id for j in me.jobs.list().data] == [job, walked.id]
        assert sorted(f.id for f in me.files.list().data) == sorted(files)
        assert {f: me.files.content(f) for f in files} == files
        bucket, _, prefix = done.fine_tuned_model_uri.removeprefix("s3://").partition("/")
        assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["KeyCount"]
    finally:
        readme_walk.down()
    assert not [pid for pid in seen if processes.alive(pid)]
    print(f"crash test: {time.monotonic() - started:.0f} s")


def test_readyz_names_storage_when_it_lacks_the_newest_uploaded_files(service):
    """Storage that answers but came back without what the database references (an in-memory server restarted)
    is not ready."""
    uploaded = service.sdk().files.create(b'{"text": "referenced"}\n', "referenced.jsonl")
    assert httpx.get(f"{service.url}/readyz").status_code == 200
    bucket, _, key = service.store.get_file(uploaded.id, "tenant-a").uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=service.app.state.settings.s3_endpoint_url)
    kept = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.delete_object(Bucket=bucket, Key=key)
    try:
        ready = httpx.get(f"{service.url}/readyz")
        assert ready.status_code == 503 and "storage" in ready.json()["error"]["message"], ready.text
    finally:
        s3.put_object(Bucket=bucket, Key=key, Body=kept)
    assert httpx.get(f"{service.url}/readyz").status_code == 200


def test_ports_are_chosen_below_the_ephemeral_range_and_above_rays_worker_ports(tmp_path):
    """A port from the kernel's ephemeral range may be taken by any outgoing connection before the server binds it
    (`ray start`'s dashboard lost one so in `make demo`): none is ever chosen, whatever the range."""
    first_ephemeral = embedded.ephemeral_start()
    assert all(20000 <= embedded.free_port() < first_ephemeral for _ in range(200))
    (tmp_path / "range").write_text("21000\t60999\n")  # a machine whose range starts low
    assert embedded.ephemeral_start(str(tmp_path / "range")) == 21000
    assert all(20000 <= embedded.free_port(21000) < 21000 for _ in range(50))


def test_a_server_whose_port_was_taken_before_it_bound_starts_on_a_fresh_one(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", embedded.free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(embedded.PortTaken):  # the server's own words say so: no waiting for a timeout
            embedded.spawn_s3_server(port, str(tmp_path / "s3.log"))
        with embedded.local_s3_server(port) as endpoint:
            assert endpoint != f"http://127.0.0.1:{port}"
            assert httpx.get(f"{endpoint}/").status_code == 200


def test_the_in_process_control_plane_holds_its_port_from_the_moment_its_url_is_known(tmp_path):
    """`make demo` names the control plane's URL (its workers' callback) before the server starts: the socket is
    bound then and handed to uvicorn, so nothing can take the port in between; a port already taken fails at once
    with the OS's error, not after the 30 s wait for /healthz."""
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/healthz")(lambda: {"ok": True})
    listener = embedded.listening_socket()
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    with embedded.control_plane_in_thread(app, listener) as url:
        assert url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/healthz").json() == {"ok": True}
        started = time.monotonic()
        with pytest.raises(OSError, match="in use"), embedded.control_plane_in_thread(app, port):
            pass
        assert time.monotonic() - started < 5
    assert listener.fileno() == -1  # closed with the server
