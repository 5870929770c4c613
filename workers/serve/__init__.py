"""The OpenAI-compatible inference surface on Ray Serve: one engine deployment per base model (its adapters load
on first use), an ingress that authenticates each call against the control plane and Prometheus metrics. Every
replica runs moetune's own engine (workers/generate); vLLM is not wired in (docs/serving.md)."""
