"""gpt-oss: attention with sinks (alternating sliding-window / full layers), a biased softmax-top-k router and
biased experts stored transposed ([E, in, out]) with gate and up interleaved, under a clamped SwiGLU. Its released
checkpoints keep the experts in MXFP4."""

from moetune.api.families import FAMILIES
from moetune.workers.families.spec import Family


class ClampedSwiGLU:
    """gpt-oss's expert activation over interleaved [g0, u0, g1, u1, ...] columns: gate clamped above at `limit`,
    up to ±limit, (up + 1) · gate · σ(alpha · gate) (transformers' GptOssExperts._apply_gate)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up):
        import torch

        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def expert_activation(experts) -> ClampedSwiGLU:
    return ClampedSwiGLU(experts.alpha, experts.limit)


def tiny_config(**overrides):
    from transformers import GptOssConfig

    values = {"vocab_size": 272, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
              "num_experts_per_tok": 2, "sliding_window": 8, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return GptOssConfig(**{**values, **overrides})


FAMILY = Family(FAMILIES["gpt_oss"], moe_block="GptOssMLP", shared_experts=None, tiny_config=tiny_config,
                router="router", expert_activation=expert_activation)
