"""moetune's wire contract (api.models) and Python SDK (api.client)."""

from moetune.api.client import APIError, Client

__all__ = ["APIError", "Client"]
