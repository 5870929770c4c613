from moetune.api.families import FAMILIES
from moetune.workers.families.nemotron_h.tiny import tiny_config
from moetune.workers.families.spec import Family


def expert_activation(experts):
    return experts.act_fn  # plain MLP experts: act(x W_up), no gating


FAMILY = Family(FAMILIES["nemotron_h"], moe_block="NemotronHMoE", shared_experts="shared_experts",
                tiny_config=tiny_config, expert_activation=expert_activation,
                lora_unsupported=("out_proj",))  # PEFT: Mamba's out_proj bypasses its forward in the fused kernels
