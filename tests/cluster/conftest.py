"""One multi-node Ray cluster for these tests (bench.support.cluster_job): a head and two worker nodes, each in its
own network namespace, and their S3 server on the bridge address holding a tiny checkpoint and datasets. It goes
once they ran (package scope): three idle Ray nodes would otherwise load the worker's remaining tests."""

from __future__ import annotations

import pytest

from bench.support.cluster_job import cluster_stack
from bench.support.netns_cluster import netns_permitted


@pytest.fixture(scope="package")
def netns_stack(tmp_path_factory):
    if reason := netns_permitted():
        pytest.skip(f"the multi-node cluster needs network namespaces: {reason}")
    with cluster_stack(str(tmp_path_factory.mktemp("netns-cluster"))) as stack:
        yield stack
