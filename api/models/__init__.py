"""The wire contract shared by the control plane, the workers and the SDK, one module per section: `job_create`
(the request, JobCreate and resolve_spec) over its sections `lora`, `training`, `parallelism`, `method`
(OpenAI's hyperparameters and method) and `evaluation`, all on `base` (the strict model, URI forms, SpecError);
`responses` (what the public routes answer) and `job_run` (the driver's run spec and the workers' reports)."""
