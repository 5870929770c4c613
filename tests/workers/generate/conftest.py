"""Tiny checkpoints of two families (kimi_linear: KDA + MLA; qwen3_moe: softmax attention with RoPE) and PEFT
adapters of each in moetune's export layout (bench.support.adapters)."""

from __future__ import annotations

import pytest

from bench.support.adapters import write_adapter, write_checkpoint

FAMILIES = ("kimi_linear", "qwen3_moe")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}")) for name in FAMILIES}


@pytest.fixture(scope="session")
def adapters(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(family, "linear" | "experts") -> adapter dir; kimi_linear also has "linear-2" and "experts-2"."""
    kinds = (("linear", 1, False), ("experts", 2, True), ("linear-2", 3, False), ("experts-2", 4, True))
    return {(name, kind): write_adapter(name, tmp_path_factory.mktemp(f"adapter-{name}-{kind}"), seed, experts)
            for name in FAMILIES for kind, seed, experts in kinds[:4 if name == "kimi_linear" else 2]}
