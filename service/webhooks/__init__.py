"""Webhooks like OpenAI's: per-tenant endpoints (endpoints.py), job events written to an outbox table in the
same transaction as the status change they announce (outbox.py), and a delivery loop that signs each attempt the
Standard Webhooks way (signing.py) and retries with capped, jittered exponential backoff (delivery.py)."""
