"""Where a session's saves go (workers/sessions/layout.py), without Ray. Serve replicas cache adapters by URI, so
two save_weights under one name must land in two folders, else a deploy of the second keeps serving the first."""

from moetune.workers.sessions.layout import state_uri, weights_uri

OUTPUT = "s3://bucket/outputs/ts_1"


def test_each_save_of_weights_under_one_name_has_its_own_uri():
    first, second = weights_uri(OUTPUT, "policy", 4), weights_uri(OUTPUT, "policy", 9)
    assert first != second
    assert first.startswith(f"{OUTPUT}/weights/policy/") and second.startswith(f"{OUTPUT}/weights/policy/")
    assert weights_uri(OUTPUT, "other", 4) != first
    assert state_uri(OUTPUT, "s1") == f"{OUTPUT}/states/s1"  # load_state finds a state by its name alone
