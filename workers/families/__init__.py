"""Model families: one folder per family, `<model_type>/`, holding everything moetune knows about it:
- `facts.py`: `FACTS`, the torch-free facts the control plane checks a job against (read by api.families; it
  imports nothing but `linears.py`),
- `family.py`: `FAMILY`, a `spec.Family` (its MoE blocks and experts, kernel swaps, LoRA scope),
- `tiny.py`: `tiny_config`, a tiny random config of the family (tests, benchmarks, the demo).
Adding a family is adding its folder. Beside the folders live the building blocks families share (mla, kda,
segments, linears, spec) and the registry.

Importing a family's facts must not load torch, so this package imports nothing itself: the registry's names
below are loaded on first use.
"""

_REGISTRY_NAMES = frozenset({"REGISTRY", "known_family", "family_for", "demo_family", "hf_config", "auto_model_class",
                             "apply_kernel_swaps"})


def __getattr__(name: str):
    if name in _REGISTRY_NAMES:
        from moetune.workers.families import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
