"""The streaming loader against a real S3 server (moto) behind a counting, fault-injecting proxy."""

from __future__ import annotations

import gc
import json
import os
import shutil
import ssl

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from moetune.api.environment import ENV_S3_ENDPOINT_URL
from moetune.service.cli.main import main
from bench.support.proxy import FaultProxy

from moetune.workers.weights.cache import RangeCache
from moetune.workers.weights.errors import WeightsError
from moetune.workers.weights.header import HEADER_PROBE
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at
from moetune.workers.settings import WorkerSettings
from moetune.workers.weights.loader import load_summary, stream_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from moetune.workers.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    p = FaultProxy(s3_endpoint)
    monkeypatch.setenv(ENV_S3_ENDPOINT_URL, p.url)  # the loader's fsspec client now talks through the proxy
    yield p
    p.close()


def _push(local_dir: str, uri: str, shard_size: str = "300KB"):
    result = CliRunner().invoke(main, ["models", "push", local_dir, uri, "--shard-size", shard_size])
    assert result.exit_code == 0, result.output
    return result


def _reference(local_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(local_dir, dtype=F32).state_dict()


def _safetensors_bytes(local_dir: str, piece) -> bytes:
    """The same piece read by safetensors from the pushed shard (downloaded), as raw bytes."""
    with safe_open(os.path.join(local_dir, piece.shard), framework="pt") as f:
        tensor = f.get_tensor(piece.tensor.split("[")[0])
    if "[expert " in piece.tensor:
        tensor = tensor[int(piece.tensor.split("[expert ")[1].rstrip("]"))]
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_push_inspect_and_stream_each_rank_only_its_bytes(tiny_dir, s3_bucket, proxy, tmp_path):
    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    pushed = tmp_path / "pushed"
    from moetune.api import storage

    storage.download_dir(uri, str(pushed))
    assert json.loads((pushed / "moetune-manifest.json").read_text())["tensors"]

    report = json.loads(CliRunner().invoke(main, ["models", "inspect", uri, "--ep", "2", "--json"]).output)
    assert report["model_type"] == "kimi_linear" and report["experts_per_layer"] == 8
    assert report["moe_layers"] == 3 and len(report["bytes_per_rank"]) == 2

    reference = _reference(tiny_dir)
    # EP=1: every tensor byte-identical to transformers' safetensors loading; every piece verified.
    full = stream_model(uri, CPU, F32, cache_dir="")
    state = full.model.state_dict()
    assert set(state) == set(reference)
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    assert full.verified and full.stats.verified_pieces == len(full.plan.pieces)
    tensors = dict(full.model.named_parameters()) | dict(full.model.named_buffers())
    for piece in full.plan.pieces:
        dest = piece.destination(tensors[piece.param].detach())
        assert dest.contiguous().view(torch.uint8).numpy().tobytes() == _safetensors_bytes(str(pushed), piece)

    # EP=2: each rank reads (counted at the proxy) its non-expert tensors and its own experts only.
    sizes = {}
    for shard in pushed.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            sizes.update({k: f.get_slice(k).get_shape() for k in f.keys()})  # noqa: SIM118 - safe_open is no dict
    expert_bytes = sum(4 * torch.Size(shape).numel() for k, shape in sizes.items() if ".experts." in k)
    tensor_bytes = sum(4 * torch.Size(shape).numel() for shape in sizes.values())
    config = json.loads((pushed / "config.json").read_text())
    heads = sum(min(HEADER_PROBE, shard.stat().st_size) for shard in pushed.glob("*.safetensors"))
    for rank in range(2):
        proxy.reset_counts()
        placement = placement_at(config, 2, rank)
        part = stream_model(uri, CPU, F32, placement, cache_dir="")
        assert part.stats.bytes_needed == tensor_bytes - expert_bytes // 2 == report["bytes_per_rank"][rank]
        assert part.stats.bytes_from_storage <= 1.05 * part.stats.bytes_needed
        # What crossed the wire: the planned ranges, plus each shard's first bytes (its header) and the small
        # JSON files.
        assert 0 < proxy.bytes_relayed - part.stats.bytes_from_storage < heads + 64 * 1024
        for name, tensor in part.model.state_dict().items():
            if tensor.shape != reference[name].shape:  # expert tensors: this rank's 4 of 8 experts only
                assert tensor.shape[0] == 4 and torch.equal(tensor, reference[name][4 * rank:4 * rank + 4])
            else:
                assert torch.equal(tensor, reference[name])
        # The expert-parallel module takes the streamed rows as they are (no copy, no full tensor).
        experts = part.model.model.layers[1].mlp.experts
        ep_experts = ExpertParallelExperts(experts, placement)
        assert ep_experts.gate_up_proj.data_ptr() == experts.gate_up_proj.data_ptr()

    # The local cache (keyed by ETag) serves a restarted load without reading the weights again.
    cache = str(tmp_path / "cache")
    stream_model(uri, CPU, F32, placement_at(config, 2, 0), cache_dir=cache)
    proxy.reset_counts()
    again = stream_model(uri, CPU, F32, placement_at(config, 2, 0), cache_dir=cache)
    assert again.stats.bytes_from_storage == 0 and again.stats.bytes_from_cache == again.stats.bytes_needed
    assert proxy.ranged_gets == 0


def test_checkpoint_metadata_takes_one_request_per_file(tiny_dir, s3_bucket, proxy, monkeypatch):
    """From S3 without a cache, each small JSON file is one GET (no HEAD first), and one request tells a shard's
    ETag (the same as a HEAD's), size and header (a ranged GET of its first bytes); a header longer than that
    first read takes one more, and reads the same."""
    from moetune.workers.weights import header, loader

    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    proxy.reset_counts()
    ckpt = loader.open_checkpoint(uri)
    shards = len(ckpt.tensors)
    assert shards > 1 and proxy.ranged_gets == shards and proxy.requests == 3 + shards  # config, index, manifest
    for source in ckpt.sources.values():
        assert source.etag == ckpt.fs.info(source.path)["ETag"].strip('"')
    monkeypatch.setattr(header, "HEADER_PROBE", 64)
    monkeypatch.setattr(loader, "HEADER_PROBE", 64)
    proxy.reset_counts()
    again = loader.open_checkpoint(uri)
    assert proxy.ranged_gets == 2 * shards and proxy.requests == 3 + 2 * shards
    assert again.tensors == ckpt.tensors and again.sources == ckpt.sources


def test_an_unreadable_shard_is_named(tiny_dir, s3_bucket, proxy):
    """An empty shard object (no range of it can be read) is an error naming it, not a storage client's."""
    from moetune.api import storage
    from moetune.workers.weights.loader import open_checkpoint

    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    shard = sorted(set(json.loads(storage.read_text(f"{uri}/model.safetensors.index.json"))["weight_map"].values()))[0]
    storage.write_bytes(f"{uri}/{shard}", b"")
    with pytest.raises(WeightsError, match=f"shard {shard} cannot be read"):
        open_checkpoint(uri)


def test_faults_are_retried_or_name_the_shard_and_tensor(tiny_dir, s3_bucket, proxy, tmp_path):
    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri, shard_size="2MB")  # one shard: every range read is a weight read
    proxy.faults_from_byte = 1  # the weight reads (one 1.2 MB range), not the read of the shard's header
    fast = {"cache_dir": "", "backoff_s": 0.01}
    for fault in ("500", "cut", "truncate", "flip"):
        proxy.inject(fault, count=2)
        out = stream_model(uri, CPU, F32, **fast)  # transient: retried (flips: re-read after the checksum)
        assert out.stats.verified_pieces == len(out.plan.pieces), fault
    # A flipped byte streamed into the local cache is re-read and never stays cached.
    proxy.inject("flip", count=1)
    stream_model(uri, CPU, F32, cache_dir=str(tmp_path / "cache"), backoff_s=0.01)
    from moetune.api import storage

    shard = storage.read_bytes(f"{uri}/model-00001-of-00001.safetensors")
    cached = [f for f in (tmp_path / "cache").rglob("*-*") if not f.name.startswith(".")]
    assert all(f.read_bytes() == shard[slice(*map(int, f.name.split("-")))] for f in cached)
    proxy.inject("truncate")
    with pytest.raises(WeightsError, match=r"shard model-00001-of-00001.safetensors: bytes \d+-\d+ \(tensors lm_head.weight.*failed after 2 attempts"):
        stream_model(uri, CPU, F32, attempts=2, **fast)
    proxy.inject("flip")
    with pytest.raises(WeightsError, match=r"model-00001-of-00001.safetensors: tensor \S+ does not match its manifest"):
        stream_model(uri, CPU, F32, attempts=2, **fast)
    proxy.inject(None)
    assert gc.get_freeze_count() == 0  # a failed load too leaves the heap to the garbage collector again


def test_weights_come_on_the_fetchers_own_connections_until_storage_refuses_them(tiny_dir, s3_bucket, proxy,
                                                                                caplog):
    """Ranged GETs of the weights are presigned and read on the fetcher's own connections; a 403 to one of them
    (a server that takes no presigned URLs) sends the rest of the load through fsspec's client, losing nothing."""
    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    proxy.faults_from_byte = 1  # the weight reads, not the shards' headers
    proxy.reset_counts()
    out = stream_model(uri, CPU, F32, cache_dir="")
    weights = out.stats.requests
    assert weights > 1 and out.stats.direct_requests == weights and proxy.presigned_gets == weights
    proxy.inject("403", count=1)
    proxy.reset_counts()
    with caplog.at_level("WARNING", logger="moetune.workers.weights.fetch"):
        again = stream_model(uri, CPU, F32, cache_dir="")
    assert again.stats.verified_pieces == len(again.plan.pieces) and again.stats.requests == weights
    assert again.stats.direct_requests < weights and proxy.presigned_gets == again.stats.direct_requests + 1
    assert "through fsspec's client from now on" in caplog.text and "HTTP 403 AccessDenied" in caplog.text
    message, data = load_summary(again, ep_size=1)  # the job's event says why the load took the slower client
    assert "not the loader's own connections" in message and "HTTP 403 AccessDenied" in message
    assert data["direct_requests"] == again.stats.direct_requests
    assert "refused" not in load_summary(out, ep_size=1)[0]


def test_a_proxy_in_the_environment_keeps_ranged_gets_on_fsspecs_client(tiny_dir, s3_bucket, s3_endpoint, proxy,
                                                                         monkeypatch):
    """botocore sends requests through HTTP_PROXY; so must the weights' ranged GETs (here the counting proxy,
    the endpoint being the server itself)."""
    from s3fs import S3FileSystem

    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    monkeypatch.setenv(ENV_S3_ENDPOINT_URL, s3_endpoint)
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    S3FileSystem.clear_instance_cache()  # botocore reads the proxies when it creates a client
    proxy.reset_counts()
    try:
        out = stream_model(uri, CPU, F32, cache_dir="")
    finally:  # the cached clients go through the proxy: the next test in this process must not get them
        S3FileSystem.clear_instance_cache()
    assert out.stats.verified_pieces == len(out.plan.pieces) and out.stats.direct_requests == 0
    assert proxy.ranged_gets >= out.stats.requests > 0 and proxy.presigned_gets == 0
    assert "is reached through a proxy" in load_summary(out, ep_size=1)[0]


def _self_signed_tls(folder) -> tuple[ssl.SSLContext, str]:
    """(a server TLS context, the path of its certificate): a self-signed one for 127.0.0.1."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = str(folder / "cert.pem"), str(folder / "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    return context, cert_path


def test_weights_stream_over_https_checked_against_aws_ca_bundle(tiny_dir, s3_bucket, s3_endpoint, tmp_path,
                                                                monkeypatch):
    """An HTTPS endpoint (a self-signed certificate, trusted through AWS_CA_BUNDLE as botocore reads it): the
    direct ranged GETs check the certificate the same way and carry the weights."""
    uri = f"s3://{s3_bucket}/tiny"
    _push(tiny_dir, uri)
    server_tls, cert = _self_signed_tls(tmp_path)
    https = FaultProxy(s3_endpoint, tls=server_tls)
    try:
        monkeypatch.setenv(ENV_S3_ENDPOINT_URL, https.url)
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)
        out = stream_model(uri, CPU, F32, cache_dir="", attempts=1)
        assert out.stats.verified_pieces == len(out.plan.pieces)
        assert out.stats.direct_requests == out.stats.requests == https.presigned_gets > 0
    finally:
        https.close()


def test_a_format_1_manifest_with_sha256_per_tensor_still_verifies(s3_bucket, tmp_path):
    """Checkpoints pushed before the XXH3-128 checksums (format 1: sha256 per tensor and per expert slice) load
    verified, also per expert slice as an EP rank (gpt_oss's checkpoint keeps its experts fused), and a wrong
    digest there still fails the load."""
    import hashlib

    from safetensors.torch import load

    from moetune.api import storage
    from moetune.workers.families import REGISTRY
    from bench.support.tiny_models import plain_model

    plain_model(REGISTRY["gpt_oss"]).save_pretrained(str(tmp_path))
    uri = f"s3://{s3_bucket}/gpt-oss-format-1"
    _push(str(tmp_path), uri, shard_size="10MB")
    manifest = json.loads(storage.read_bytes(f"{uri}/moetune-manifest.json"))
    tensors = {name: tensor for shard in set(manifest["files"]) if shard.endswith(".safetensors")
               for name, tensor in load(storage.read_bytes(f"{uri}/{shard}")).items()}

    def sha256(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    old = {name: {"sha256": sha256(tensors[name])} | (
        {"expert_sha256": [sha256(row) for row in tensors[name]]} if "expert_xxh3_128" in entry else {})
        for name, entry in manifest["tensors"].items()}
    fused = next(name for name, entry in old.items() if "expert_sha256" in entry)

    def write(tensor_entries: dict) -> None:
        storage.write_bytes(f"{uri}/moetune-manifest.json", json.dumps(
            {**manifest, "format": "moetune-manifest/1", "tensors": tensor_entries}).encode())

    write(old)
    rank_1 = placement_at(json.loads(storage.read_bytes(f"{uri}/config.json")), 2, 1)
    for placement in (None, rank_1):
        out = stream_model(uri, CPU, F32, placement, cache_dir="")
        assert out.verified and out.stats.verified_pieces == len(out.plan.pieces)
    assert any(p.tensor == f"{fused}[expert {rank_1.first}]" for p in out.plan.pieces)
    # pushed before fused expert biases [E, out] had a checksum per expert: a rank's slices of them are unverified
    bias = next(name for name, entry in old.items() if "expert_sha256" in entry and tensors[name].dim() == 2)
    write({**old, bias: {"sha256": old[bias]["sha256"]}})
    out = stream_model(uri, CPU, F32, rank_1, cache_dir="")
    assert not out.verified and len(out.plan.pieces) - out.stats.verified_pieces == rank_1.count
    assert f"integrity unverified for {rank_1.count} of {len(out.plan.pieces)} pieces" in load_summary(out, 2)[0]
    old[fused]["expert_sha256"][rank_1.first] = hashlib.sha256(b"other bytes").hexdigest()
    write(old)
    with pytest.raises(WeightsError, match=rf"tensor {fused}\[expert {rank_1.first}\] does not match its manifest"):
        stream_model(uri, CPU, F32, rank_1, cache_dir="", attempts=1)


def test_missing_tensor_and_shape_mismatch_list_the_names(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(tiny_dir):
        shutil.copy(os.path.join(tiny_dir, f), broken / f)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(broken / shard))
    del tensors["model.norm.weight"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-8] if "lm_head.weight" in tensors else None
    save_file({k: v for k, v in tensors.items() if v is not None}, str(broken / shard), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"lacks tensors for: .*model\.norm\.weight"):
        stream_model(f"file://{broken}", CPU, F32, cache_dir="")
    # A checkpoint without a manifest still loads; its integrity is unverified.
    out = stream_model(f"file://{tiny_dir}", CPU, F32, cache_dir="")
    assert not out.verified and out.stats.verified_pieces == 0
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = 32
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"shape mismatch between checkpoint and model: .*model\.embed_tokens"):
        stream_model(f"file://{broken}", CPU, F32, cache_dir="")


def test_cache_stays_under_its_cap_and_keeps_what_fits(tiny_dir, s3_bucket, proxy, tmp_path, monkeypatch):
    uri = f"s3://{s3_bucket}/tiny-capped"
    _push(tiny_dir, uri)  # several 300 KB shards: one cached object per shard
    root = tmp_path / "cache"

    def cached_bytes() -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f.parent != root)

    unbounded = stream_model(uri, CPU, F32, cache_dir=str(root))
    total = cached_bytes()
    assert unbounded.stats.bytes_not_cached == 0 and total >= unbounded.stats.bytes_needed
    assert int((root / ".bytes").read_text()) == total  # the node's shared count matches the disk

    # Room for about half: opening the cache trims it to the cap; then the load never evicts its own model's
    # objects to admit others (that would evict each range just before it is needed again, for no hit at all),
    # so the same half serves every later load and the rest is read from storage without being cached.
    cap = total // 2
    reference = _reference(tiny_dir)
    for _ in range(2):
        proxy.reset_counts()
        out = stream_model(uri, CPU, F32, cache_dir=str(root), cache_max_bytes=cap)
        assert cached_bytes() <= cap and int((root / ".bytes").read_text()) == cached_bytes()
        assert 0 < out.stats.bytes_from_cache < out.stats.bytes_needed and out.stats.bytes_not_cached > 0
        assert out.stats.bytes_from_storage + out.stats.bytes_from_cache >= out.stats.bytes_needed
        state = out.model.state_dict()
        assert all(torch.equal(state[k], reference[k]) for k in reference)

    shutil.rmtree(root)  # nothing fits (MOETUNE_WEIGHTS_CACHE_MAX_GB=0): loads go on, uncached, and say so
    monkeypatch.setenv("MOETUNE_WEIGHTS_CACHE_MAX_GB", "0")
    out = stream_model(uri, CPU, F32, cache_dir=str(root), cache_max_bytes=WorkerSettings().weights_cache_max_bytes)
    assert out.stats.bytes_not_cached >= out.stats.bytes_needed and cached_bytes() == 0
    message, data = load_summary(out, ep_size=1)
    assert "not cached: the local weights cache is full" in message and data["bytes_not_cached"] > 0

    monkeypatch.setenv("MOETUNE_WEIGHTS_CACHE_MAX_GB", "lots")
    with pytest.raises(ValueError, match="MOETUNE_WEIGHTS_CACHE_MAX_GB='lots': expected a size in GB"):
        WorkerSettings()


def test_cache_keeps_a_free_space_floor_on_its_disk(tmp_path):
    roomy = RangeCache(str(tmp_path / "c"))
    roomy.put_range("bucket/shard", "etag", 0, 4, b"abcd")
    assert roomy.get_range("bucket/shard", "etag", 0, 4) == b"abcd" and roomy.skipped_bytes == 0
    # A disk that is always "too full" of other data: nothing more is cached, and what is cached stays (evicting
    # it could not make the room).
    full = RangeCache(str(tmp_path / "c"), min_free_fraction=1.0)
    full.put_range("bucket/other", "etag", 0, 4, b"efgh")
    assert full.get_range("bucket/other", "etag", 0, 4) is None and full.skipped_bytes == 4
    assert full.get_range("bucket/shard", "etag", 0, 4) == b"abcd"

    # A killed writer's half-written file is dropped (and uncounted) once it is an hour old, not before.
    (cached,) = (tmp_path / "c").rglob("0-4")
    fresh, stale = cached.parent / ".part-fresh", cached.parent / ".part-stale"
    for f in (fresh, stale):
        f.write_bytes(b"x" * 10)
    os.utime(stale, (0, 0))
    RangeCache(str(tmp_path / "c"))
    assert fresh.exists() and not stale.exists() and (tmp_path / "c" / ".bytes").read_text() == "14"


def test_cache_evicts_the_least_recently_used_objects_never_held_ones(tmp_path):
    root = str(tmp_path / "c")
    cache = RangeCache(root)
    for name, used_at in (("old", 1_000), ("recent", 3_000), ("middle", 2_000)):
        cache.put_range(name, "etag", 0, 100, b"x" * 100)
        os.utime(cache._dir(name, "etag"), (used_at, used_at))
    held = RangeCache(root, max_bytes=200)  # opening trims to the cap: the least recently used object goes
    assert [n for n in ("old", "recent", "middle") if held.get_range(n, "etag", 0, 100)] == ["recent", "middle"]
    held.hold("recent", "etag")
    held.hold("middle", "etag")
    held.put_range("new", "etag", 0, 100, b"y" * 100)  # no room without evicting what this load holds
    assert held.get_range("new", "etag", 0, 100) is None and held.skipped_bytes == 100
    RangeCache(root, max_bytes=200).put_range("new", "etag", 0, 100, b"y" * 100)  # another load: LRU goes
    assert RangeCache(root).get_range("new", "etag", 0, 100) == b"y" * 100
