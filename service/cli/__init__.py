"""The `moetune` command (main.py), a client of the SDK (`moetune.api.client`): commands that talk to a control
plane import neither FastAPI nor the server; only `server`, `up` and `demo` load it, inside the command."""
