"""What the benchmarks run, shared with the tests that check the same paths (tests import it from here; nothing in
bench/ imports tests):

- harness: the two-rank loopback gloo launcher, the job spec of a case and the plain transformers + PEFT reference;
- tiny_models: each family's tiny random model and deterministic batches;
- image_batches: image rows, the image method and model, the EP run of an image batch;
- quantized: tiny FP8 / INT4 / MXFP4 checkpoints and their dequantized reference;
- adapters: a tiny checkpoint and adapters in moetune's export layout;
- proxy: a loopback HTTP proxy that injects storage faults;
- receiver: a receiver of worker reports;
- netns_cluster, cluster_job: a multi-node Ray cluster in network namespaces, and its tiny job through node faults;
- postgres: a real PostgreSQL server on loopback and fresh databases on it;
- ray_jobs_api: a loopback stand-in for the Ray Jobs API that records every submission attempt;
- replicas: `moetune server` processes, alone or as replicas on one database, and the leader takeover;
- webhook_receiver: a webhook receiver that verifies deliveries with the openai SDK and refuses the first tries;
- waiting: polling for something a real process does.
"""
