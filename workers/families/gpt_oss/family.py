from moetune.api.families import FAMILIES
from moetune.workers.families.gpt_oss.tiny import tiny_config
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


FAMILY = Family(FAMILIES["gpt_oss"], moe_block="GptOssMLP", shared_experts=None, tiny_config=tiny_config,
                router="router", expert_activation=expert_activation)
