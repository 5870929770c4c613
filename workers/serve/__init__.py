"""The OpenAI-compatible inference surface on Ray Serve: one engine deployment per base model (its adapters load
on first use), an ingress that authenticates each call against the control plane, Prometheus metrics, and the vLLM
configuration used where a replica has a GPU and vLLM serves the family."""
