"""Streaming of a rank's share of a safetensors checkpoint from any fsspec URI (s3://, file://, ...).

`header` reads shard headers with two small range reads, `mapping` turns checkpoint names into model
parameters (through transformers' own conversion rules), `plan` decides which byte ranges this rank needs,
`fetch` reads them concurrently with a bound on bytes in flight (retries, local ETag cache, checksums from
`manifest`) and `materialize` builds the model on the meta device and fills only what this rank holds.
"""
