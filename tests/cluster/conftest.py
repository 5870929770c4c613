"""One multi-node Ray cluster for the session (bench.support.netns_cluster): a head and two worker nodes, each in
its own network namespace, with its own S3 server on the bridge address (durable, so a test may stop and restart
it) holding a tiny checkpoint and datasets."""

from __future__ import annotations

import os
from dataclasses import dataclass

import boto3
import pytest

from bench.support.netns_cluster import NetnsCluster, cluster_network, netns_permitted
from moetune.service.local.embedded import free_port, s3_env, spawn_s3_server, stop_process

BUCKET = "cluster"


@dataclass
class ClusterStack:
    cluster: NetnsCluster
    s3_url: str
    assets: str  # s3:// base of models/tiny and data/{train,valid}.jsonl

    def s3(self):
        return boto3.client("s3", endpoint_url=self.s3_url, **_keys(self.s3_url))


def _keys(url: str) -> dict:
    env = s3_env(url)
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_DEFAULT_REGION"]}


@pytest.fixture(scope="session")
def netns_stack(tmp_path_factory):
    if reason := netns_permitted():
        pytest.skip(f"the multi-node cluster needs network namespaces: {reason}")
    from moetune.workers.tiny import write_tiny_checkpoint, write_tiny_dataset

    work = tmp_path_factory.mktemp("netns-s3")
    tiny_checkpoint = write_tiny_checkpoint(str(work / "tiny"), seed=0)
    with cluster_network(worker_nodes=2) as cluster:
        port = free_port()
        s3 = spawn_s3_server(port, str(work / "s3.log"), data_dir=str(work / "objects"), host=cluster.host_address)
        try:
            stack = ClusterStack(cluster, f"http://{cluster.host_address}:{port}", f"s3://{BUCKET}")
            client = stack.s3()
            client.create_bucket(Bucket=BUCKET)
            for path in os.listdir(tiny_checkpoint):
                client.upload_file(os.path.join(tiny_checkpoint, path), BUCKET, f"models/tiny/{path}")
            for name, rows, seed in (("train.jsonl", 160, 0), ("valid.jsonl", 16, 1)):
                write_tiny_dataset(str(work / name), rows, seed)
                client.upload_file(str(work / name), BUCKET, f"data/{name}")
            cluster.start(s3_env(stack.s3_url))
            yield stack
        finally:
            stop_process(s3)
