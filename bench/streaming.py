"""Weight streaming: moetune's loader vs raw concurrent ranged GETs of the same bytes, bytes read per rank and
peak memory per rank at EP=2, against a local S3 server that serves ranged reads fast (s3rver from npm,
installed into a temporary folder; the moto server when npm cannot install it: slower, said in the output).

A ~1 GiB bf16 checkpoint of the seed family (kimi_linear scaled up so routed experts hold ~97 % of the bytes)
is generated, then uploaded by the code of `moetune models push` (re-sharded, checksum manifest). Measured:

1. throughput (EP=1, whole model, no local cache): bytes the plan needs / wall time of `stream_model` (shard
   headers, model skeleton, plan, range reads, checksum verification, writes into the parameters), against
   the same ranges (the loader's merged ranges cut into its chunks) read by a thread pool of the same size
   with nothing done to the bytes. Rounds alternate; the median of each is kept. throughput_ratio = moetune / raw.
2. bytes (EP=2): each rank loads in its own process through its own byte-counting proxy in front of the
   server; every GET body it relays counts (shard headers, config, index and manifest included).
   bytes_ratio = max over ranks of relayed bytes / the bytes `models inspect --ep 2` says the rank needs.
3. memory (EP=2, same processes): peak RSS (VmHWM) of the rank's process minus the peak RSS of a process
   that imported the same modules, read the headers and built the model skeleton on the meta device and its
   plan (everything but the weights), minus the rank's share (the bytes it needs: bf16 in, bf16 out).
   rss_over_share_mib = max over ranks, in MiB.

    python bench/streaming.py [--rounds 3]

Ends with `RESULT throughput_ratio=<x> bytes_ratio=<y> rss_over_share_mib=<z>`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

from moetune.service.local.embedded import free_port, local_s3_server, s3_env, stop_process, wait_http

BUCKET = "models"
S3RVER_KEY = "S3RVER"  # s3rver's built-in account
MiB, GiB = 2**20, 2**30


def say(text: str) -> None:
    print(text, flush=True)


# ------------------------------------------------------------------ the S3 server


@contextmanager
def s3rver(work: str):
    """s3rver installed from npm into `work`, on a free loopback port; yields (endpoint, credentials env)."""
    npm_dir = os.path.join(work, "npm")
    os.makedirs(npm_dir)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", "s3rver@3"], cwd=npm_dir, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=180)
    port, data, log_path = free_port(), os.path.join(work, "s3rver-data"), os.path.join(work, "s3rver.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["node", os.path.join(npm_dir, "node_modules", ".bin", "s3rver"), "-d", data,
                                 "-a", "127.0.0.1", "-p", str(port), "--silent", "--configure-bucket", BUCKET],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, 30, proc, log_path)
        yield url, {"AWS_ACCESS_KEY_ID": S3RVER_KEY, "AWS_SECRET_ACCESS_KEY": S3RVER_KEY}
    finally:
        stop_process(proc)


@contextmanager
def moto_server():
    import boto3

    with local_s3_server() as url:
        env = s3_env(url)
        boto3.client("s3", endpoint_url=url, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1") \
            .create_bucket(Bucket=BUCKET)
        yield url, {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}


def start_server(stack: ExitStack, work: str) -> tuple[str, str]:
    """(server name, endpoint); points this process's S3 clients at it."""
    try:
        name, (url, creds) = "s3rver", stack.enter_context(s3rver(work))
    except (OSError, subprocess.SubprocessError, RuntimeError, TimeoutError) as e:
        say(f"s3rver unavailable ({type(e).__name__}: {e}); FALLING BACK to the moto server, which copies the whole "
            "object on every ranged GET: throughput numbers are not representative")
        name, (url, creds) = "moto", stack.enter_context(moto_server())
    os.environ.update({**creds, "AWS_DEFAULT_REGION": "us-east-1", "MOETUNE_S3_ENDPOINT_URL": url})
    return name, url


# ------------------------------------------------------------------ the checkpoint


def bench_config(layers: int, experts: int, hidden: int, expert_ffn: int):
    """The tiny seed-family config scaled up: wide expert FFNs and many experts, so experts dominate the bytes."""
    from moetune.workers.families.kimi_linear.tiny import tiny_config

    config = tiny_config(vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    config.mlp_layer_types = ["dense"] + ["sparse"] * (layers - 1)
    config.hidden_size, config.moe_intermediate_size, config.num_local_experts = hidden, expert_ffn, experts
    config.intermediate_size = 2 * hidden
    return config


def write_checkpoint(local_dir: str, config) -> None:
    """Random bf16 weights (uniform: the values do not matter here, and uniform_ is cheap) saved by transformers."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.05, 0.05)
    model.save_pretrained(local_dir, max_shard_size="5GB")


# ------------------------------------------------------------------ EP=1 throughput


def chunk_ranges(plan, fetcher) -> list[tuple[str, int, int]]:
    """The loader's requests: (path, start, end) of its merged ranges cut into its chunks."""
    from moetune.workers.weights.plan import merge_ranges

    return [(fetcher.sources[shard].path, a, min(a + fetcher.chunk_bytes, end))
            for shard, start, end in merge_ranges(plan.pieces, fetcher.merge_gap)
            for a in range(start, end, fetcher.chunk_bytes)]


def raw_read(fs, ranges, workers: int) -> float:
    """Seconds to GET every range with `workers` threads, dropping the bytes."""
    def get(r):
        path, a, b = r
        if len(fs.cat_file(path, start=a, end=b)) != b - a:
            raise RuntimeError(f"short read of {path} {a}-{b}")

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(get, ranges))
    return time.perf_counter() - started


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def floor_cpu_per_gib() -> dict:
    """CPU seconds per GiB of work a loader must do and raw GETs do not: the manifest's checksum of the bytes and
    faulting in fresh memory for the parameters (zeroed pages; the loader populates them with one madvise each,
    workers.weights.pages). The least of 3 tries: memory the machine has not handed out before can cost several
    times more."""
    import torch

    from moetune.workers.weights.manifest import checksum
    from moetune.workers.weights.pages import populate_for_write

    size, populate, digest = 256 * MiB, [], []
    for _ in range(3):
        fresh = torch.empty(size, dtype=torch.uint8)  # as the loader allocates: 4 KiB pages
        cpu = cpu_seconds()
        if not populate_for_write(fresh.data_ptr(), size):
            fresh.numpy()[::4096] = 1  # where the kernel cannot: a fault per page, as the loader then takes
        populate.append(cpu_seconds() - cpu)
        cpu = cpu_seconds()
        for a in range(0, size, MiB):
            checksum(fresh.numpy()[a:a + MiB])
        digest.append(cpu_seconds() - cpu)
        del fresh
    return {"checksum": min(digest) * GiB / size, "populate": min(populate) * GiB / size}


def measure_throughput(uri: str, rounds: int) -> dict:
    import torch

    from moetune.workers.weights.fetch import RangeFetcher
    from moetune.workers.weights.loader import empty_model, open_checkpoint, stream_model

    ckpt = open_checkpoint(uri)
    empty_model(ckpt.config, torch.bfloat16)  # imports the family's modeling code outside the timed rounds
    fetcher = RangeFetcher(ckpt.fs, ckpt.sources)  # the loader's defaults: chunk size, merge gap, threads
    times = {"raw": [], "moetune": [], "fetch": [], "raw_cpu": [], "moetune_cpu": []}
    for i in range(rounds):
        cpu = cpu_seconds()
        out = stream_model(uri, torch.device("cpu"), torch.bfloat16, cache_dir="")
        times["moetune_cpu"].append(cpu_seconds() - cpu)
        needed, verified, ranges = out.stats.bytes_needed, out.stats.verified_pieces, chunk_ranges(out.plan, fetcher)
        times["moetune"].append(out.seconds)
        times["fetch"].append(out.stats.seconds)
        del out  # the 1 GiB model, before the raw round
        cpu = cpu_seconds()
        times["raw"].append(raw_read(ckpt.fs, ranges, fetcher.workers))
        times["raw_cpu"].append(cpu_seconds() - cpu)
        say(f"  round {i + 1}/{rounds}: moetune {needed / times['moetune'][-1] / 1e9:.3f} GB/s "
            f"(range reads only {needed / times['fetch'][-1] / 1e9:.3f}), raw {needed / times['raw'][-1] / 1e9:.3f} GB/s")
    return {"bytes": needed, "requests": len(ranges), "threads": fetcher.workers, "verified_pieces": verified,
            **{key: statistics.median(values) for key, values in times.items()}, **floor_cpu_per_gib()}


# ------------------------------------------------------------------ EP=2 bytes and memory, one process per rank


def child(mode: str, uri: str, rank: int, ep: int) -> None:
    """Runs in a rank's process: `skeleton` builds everything but the weights, `load` streams the rank's share.
    Prints one JSON line; maxrss is the process's peak RSS, read as its last action."""
    import torch

    from moetune.workers.experts.placement import placement_at
    from moetune.workers.reporting.system import peak_rss_bytes
    from moetune.workers.weights.loader import (
        empty_model,
        open_checkpoint,
        plan_for,
        stream_model,
    )

    if mode == "skeleton":
        ckpt = open_checkpoint(uri)
        plan_for(ckpt, empty_model(ckpt.config, torch.bfloat16), placement_at(ckpt.config, ep, rank))
        result = {}
    else:
        ckpt = open_checkpoint(uri)
        out = stream_model(uri, torch.device("cpu"), torch.bfloat16, placement_at(ckpt.config, ep, rank), cache_dir="")
        result = {"bytes_needed": out.stats.bytes_needed, "bytes_from_storage": out.stats.bytes_from_storage,
                  "seconds": out.seconds}
    result["maxrss"] = peak_rss_bytes()
    print(json.dumps(result), flush=True)


def spawn(mode: str, uri: str, rank: int, ep: int, endpoint: str) -> subprocess.Popen:
    env = {**os.environ, "MOETUNE_S3_ENDPOINT_URL": endpoint}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", mode, "--uri", uri,
                             "--rank", str(rank), "--ep", str(ep)], env=env, stdout=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(proc.args[2:])} failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def measure_ranks(uri: str, endpoint: str, ep: int) -> list[dict]:
    """Both ranks at once, as in a job, each behind its own counting proxy; then the skeleton baseline."""
    from bench.support.proxy import FaultProxy
    from moetune.workers.weights.push import inspect

    needs = inspect(uri, ep)["bytes_per_rank"]
    proxies = [FaultProxy(endpoint) for _ in range(ep)]
    try:
        procs = [spawn("load", uri, rank, ep, proxies[rank].url) for rank in range(ep)]
        ranks = [collect(p) for p in procs]
        relayed = [p.bytes_relayed for p in proxies]
    finally:
        for p in proxies:
            p.close()
    skeleton = collect(spawn("skeleton", uri, 0, ep, endpoint))["maxrss"]
    for rank, r in enumerate(ranks):
        if r["bytes_needed"] != needs[rank]:
            raise RuntimeError(f"rank {rank} planned {r['bytes_needed']} bytes, inspect says {needs[rank]}")
        r.update(rank=rank, relayed=relayed[rank], skeleton_rss=skeleton,
                 over_share=r["maxrss"] - skeleton - r["bytes_needed"])
        say(f"  rank {rank}: {r['bytes_needed'] / MiB:.1f} MiB needed, {relayed[rank] / MiB:.1f} MiB through its proxy, "
            f"peak RSS {r['maxrss'] / MiB:.0f} MiB (skeleton {skeleton / MiB:.0f} MiB), {r['seconds']:.1f} s")
    return ranks


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="EP=1 rounds (moetune, then raw), median kept")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--child", choices=("skeleton", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        child(args.child, args.uri, args.rank, args.ep)
        return

    from moetune.workers.weights.push import push

    work = tempfile.mkdtemp(prefix="moetune-bench-streaming-")
    try:
        with ExitStack() as stack:
            started = time.perf_counter()
            server, endpoint = start_server(stack, work)
            say(f"S3 server: {server} at {endpoint} ({time.perf_counter() - started:.0f} s)")

            started, local = time.perf_counter(), os.path.join(work, "checkpoint")
            write_checkpoint(local, bench_config(layers=6, experts=64, hidden=512, expert_ffn=1024))
            say(f"checkpoint written ({time.perf_counter() - started:.0f} s)")
            started, uri = time.perf_counter(), f"s3://{BUCKET}/bench-moe"
            # moto copies the whole object on every ranged GET: smaller shards keep the fallback's run short
            pushed = push(local, uri, shard_bytes=(256 if server == "s3rver" else 32) * MiB)
            shutil.rmtree(local)
            say(f"pushed {pushed['bytes'] / GiB:.2f} GiB in {pushed['shards']} shards, {pushed['tensors']} tensors, "
                f"with manifest ({time.perf_counter() - started:.0f} s)")

            say(f"EP=1 throughput, {args.rounds} rounds:")
            tp = measure_throughput(uri, args.rounds)
            say(f"EP={args.ep}, one process per rank:")
            ranks = measure_ranks(uri, endpoint, args.ep)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw_gbs, ours_gbs = tp["bytes"] / tp["raw"] / 1e9, tp["bytes"] / tp["moetune"] / 1e9
    gib = tp["bytes"] / GiB
    throughput_ratio = ours_gbs / raw_gbs
    bytes_ratio = max(r["relayed"] / r["bytes_needed"] for r in ranks)
    over_mib = max(r["over_share"] for r in ranks) / MiB
    rows = [("server", server, ""),
            ("EP=1 bytes", f"{tp['bytes'] / GiB:.3f} GiB", f"{tp['requests']} ranged GETs, {tp['threads']} threads"),
            ("raw concurrent GETs", f"{raw_gbs:.3f} GB/s",
             f"same ranges, bytes dropped; client CPU {tp['raw_cpu'] / gib:.2f} s/GiB"),
            ("moetune stream_model", f"{ours_gbs:.3f} GB/s",
             (f"range reads alone {tp['bytes'] / tp['fetch'] / 1e9:.3f} GB/s; {tp['verified_pieces']} pieces verified; "
             f"client CPU {tp['moetune_cpu'] / gib:.2f} s/GiB")),
            ("  of which at least", f"{tp['checksum'] + tp['populate']:.2f} s/GiB",
             f"checksum {tp['checksum']:.2f} + faulting in the parameters' memory {tp['populate']:.2f}"),
            ("throughput_ratio", f"{throughput_ratio:.3f}", "goal >= 0.9")]
    for r in ranks:
        rows += [(f"rank {r['rank']}/{args.ep} bytes", f"{r['relayed'] / MiB:.1f} / {r['bytes_needed'] / MiB:.1f} MiB",
                  f"relayed / needed = {r['relayed'] / r['bytes_needed']:.4f}"),
                 (f"rank {r['rank']}/{args.ep} peak RSS", f"{r['maxrss'] / MiB:.0f} MiB",
                  (f"- skeleton {r['skeleton_rss'] / MiB:.0f} - share {r['bytes_needed'] / MiB:.0f} "
                  f"= {r['over_share'] / MiB:.0f} MiB"))]
    rows += [("bytes_ratio", f"{bytes_ratio:.4f}", "goal <= 1.05"),
             ("rss_over_share_mib", f"{over_mib:.0f}", "goal <= 256")]
    width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for name, value, note in rows:
        say(f"{name:<{width[0]}}  {value:>{width[1]}}  {note}")
    say(f"RESULT throughput_ratio={throughput_ratio:.3f} bytes_ratio={bytes_ratio:.4f} rss_over_share_mib={over_mib:.0f}")


if __name__ == "__main__":
    main()
