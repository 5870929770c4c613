"""Which storage URIs one tenant's job may read and write: the control plane checks a job's URI fields with it at
submission (service/submission/uri_policy.py), and hands it to the driver, which checks the image URIs inside the data files
the same way before any worker starts."""

from __future__ import annotations

from pydantic import BaseModel

from moetune.api.models.base import URI_SCHEMES


def _within(uri: str, prefix: str) -> bool:
    """Prefix match on whole path segments: `s3://data` covers `s3://data/x`, not `s3://data-b/x`."""
    prefix = prefix.rstrip("/")
    return uri == prefix or uri.startswith(prefix + "/")


class UriAccess(BaseModel):
    # None: any bucket (the server has no allow-list); a list, even empty: only URIs under these prefixes.
    prefixes: list[str] | None = None
    allow_file_uris: bool = False  # file:// reads the workers' own disks
    # Where file:// may point when allowed (absolute directories); None: anywhere (a driver run without a server).
    file_roots: list[str] | None = None

    def problem(self, uri: str) -> str | None:
        """Why this tenant may not use `uri`, phrased to follow the field's name; None when it may."""
        if uri.startswith("file://") and not self.allow_file_uris:
            return "file:// URIs are disabled on this server; use s3://"
        if uri.startswith("file://") and self.file_roots is not None and ".." not in uri.split("/") and not any(
                _within(uri, f"file://{root}") for root in self.file_roots):
            return f"{uri} is outside the directories file:// may name on this server ({', '.join(self.file_roots)})"
        if not uri.startswith(URI_SCHEMES):
            usable = "s3:// or file://" if self.allow_file_uris else "s3://"
            return f"{uri.split('://', 1)[0]}:// is no storage this server reads; use {usable}"
        if ".." in uri.split("/"):
            return "'..' path segments are not allowed"
        if self.prefixes is not None and not any(_within(uri, prefix) for prefix in self.prefixes):
            return f"{uri} is outside this tenant's storage locations ({', '.join(self.prefixes) or 'none'})"
        return None
