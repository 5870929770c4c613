"""The wire contract shared by the control plane, the workers and the SDK, one module per section: `job_create`
(the request, JobCreate) over its sections `lora`, `training`, `parallelism` (ParallelDims, the one layout type),
`method` (OpenAI's hyperparameters and method) and `evaluation`, all on `base` (the strict model, URI forms,
SpecError); `run_config` (RunConfig, what the workers run, and resolve_run_config, which makes it from a request);
`responses` (what the public routes answer) and `job_run` (the driver's run spec and the workers' reports)."""
