"""vLLM through Ray Serve LLM where a replica has a GPU and vLLM serves the family, the CPU Engine otherwise.

`llm_config` builds the keyword arguments of `ray.serve.llm.LLMConfig` (Ray 2.60's fields: model_loading_config,
llm_engine, engine_kwargs, lora_config, deployment_config, accelerator_type) as a plain dict: LLMConfig cannot be
imported without vLLM, and a dict is what Serve's YAML/REST config takes anyway. Ray Serve LLM names a LoRA model
`<base id>:<lora id>` and loads it from `<dynamic_lora_loading_path>/<lora id>`, so the lora id of a moetune adapter
is its path under the jobs' output folder (`<job id>/adapter`).
"""

from __future__ import annotations

# model_type -> vLLM supports LoRA on it (SupportsLoRA, experts included through its fused-MoE LoRA layers). The
# families moetune trains whose vLLM model has no LoRA support, or whose swapped layers (KDA, sparse attention)
# vLLM does not run with LoRA, stay on the CPU/transformers engine.
VLLM_LORA_FAMILIES = frozenset({"qwen3_moe", "deepseek_v3", "gpt_oss"})


def engine_kind(model_type: str, gpus: int, vllm_installed: bool) -> str:
    """"vllm" for a GPU replica of a family vLLM serves with LoRA, else "moetune" (the Engine of
    workers/generate)."""
    return "vllm" if gpus > 0 and vllm_installed and model_type in VLLM_LORA_FAMILIES else "moetune"


def lora_id(adapter_uri: str, lora_root: str) -> str:
    """The adapter's Ray Serve LLM lora id: its path under `lora_root`."""
    root = lora_root.rstrip("/") + "/"
    if not adapter_uri.startswith(root):
        raise ValueError(f"adapter {adapter_uri} is not under the LoRA root {lora_root}")
    return adapter_uri[len(root):].rstrip("/")


def llm_config(base_name: str, base_uri: str, lora_root: str, *, max_loras: int = 8, max_lora_rank: int = 64,
               max_cpu_loras: int | None = None, tensor_parallel_size: int = 1, expert_parallel: bool = False,
               max_model_len: int | None = None, kv_offload_gb: float = 0.0,
               accelerator_type: str | None = None) -> dict:
    """LLMConfig(**this) serves `base_uri` as `base_name` with LoRA adapters loaded from `lora_root` on first use
    (max_loras of them in one batch on the GPU, max_cpu_loras kept in host memory, least recently used evicted)."""
    if max_loras < 1 or max_lora_rank < 1 or tensor_parallel_size < 1:
        raise ValueError("max_loras, max_lora_rank and tensor_parallel_size must be at least 1")
    engine_kwargs = {
        "enable_lora": True,
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "max_cpu_loras": max_cpu_loras or 4 * max_loras,
        "tensor_parallel_size": tensor_parallel_size,
        "enable_expert_parallel": expert_parallel,
    }
    if max_model_len is not None:
        engine_kwargs["max_model_len"] = max_model_len
    if kv_offload_gb > 0:  # KV blocks spill to host memory instead of being recomputed
        engine_kwargs["kv_offloading_size"] = kv_offload_gb
        engine_kwargs["kv_offloading_backend"] = "native"
    config = {
        "model_loading_config": {"model_id": base_name, "model_source": {"bucket_uri": base_uri}},
        "llm_engine": "vLLM",
        "engine_kwargs": engine_kwargs,
        "lora_config": {"dynamic_lora_loading_path": lora_root.rstrip("/"), "max_num_adapters_per_replica": max_loras},
        "deployment_config": {"name": f"vllm-{base_name}"},
    }
    if accelerator_type:
        config["accelerator_type"] = accelerator_type
    return config
