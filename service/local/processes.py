"""The processes a local stack started, found again by a tag in their environment.

Every component `moetune up` starts gets `MOETUNE_LOCAL_STACK=<stack id>:<role>` in its environment, and every
process it starts in turn inherits it (the Ray head's GCS, raylet, workers and the job drivers they run, whatever
process group or session they move to). So `up` finds what is left of a component whose leader died (adopting or
stopping it, never starting a second copy beside it) and `down` stops everything the stack ever started; a process
without the tag (another stack's, the user's) is never touched.
"""

from __future__ import annotations

import os
import signal
import time

TAG = "MOETUNE_LOCAL_STACK"


def tag(stack_id: str, role: str) -> dict[str, str]:
    """The environment entry a component of stack `stack_id` starts with."""
    return {TAG: f"{stack_id}:{role}"}


def alive(pid: int | None) -> bool:
    """The process exists and is no zombie (exited, not yet reaped). A killed multi-threaded process shows its
    leader as a zombie while its other threads still exit, holding its files and sockets (its port is not free
    yet): it lives until every thread is gone."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_running(f"/proc/{pid}/task/{task}/stat") for task in tasks)


def _running(stat_path: str) -> bool:
    try:
        with open(stat_path) as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def tagged(stack_id: str, role: str | None = None) -> list[int]:
    """Live processes carrying the stack's tag (the role's only, when given), this one excepted."""
    wanted = f"{TAG}={stack_id}:{role or ''}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if any(v == wanted if role else v.startswith(wanted) for v in variables) and alive(int(name)):
            found.append(int(name))
    return found


def stop(stack_id: str, role: str | None, leader: int | None = None, grace: float = 15.0) -> None:
    """SIGTERM the component's process group (led by `leader`) and every process carrying its tag (or the
    stack's, for role None); SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if alive(leader):  # a dead leader's process id may be someone else's by now
            try:
                os.killpg(leader, sig)  # members without the tag too (none expected)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in tagged(stack_id, role):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while (alive(leader) or tagged(stack_id, role)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive(leader) and not tagged(stack_id, role):
            return
