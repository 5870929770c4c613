"""The control plane, in rooms: `routes/` (the FastAPI routers), `submission/` (what a job request is checked
against before it is stored), `cluster/` (what the control plane asks of Ray: the scheduler loop, Ray Jobs, Serve
deployments), `cli/` (the `moetune` command, a client of the SDK) and `local/` (the embedded stack of `moetune demo`
and `moetune up`). The core sits here: the app, settings, store, auth, errors, the views of stored rows."""
