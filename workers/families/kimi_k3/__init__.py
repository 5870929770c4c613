"""Kimi K3 (`kimi_k3`), the seed model, read as released: transformers has no class for it, so moetune defines the
model here (configuration.py, modeling.py) with the release's module names; tests prove it against NeMo
Automodel's reference implementation."""
