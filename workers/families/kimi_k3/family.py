from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.kimi_k3.release import as_released
from moetune.workers.families.kimi_k3.stage import KimiK3Stage
from moetune.workers.families.kimi_k3.tiny import TINY_VISION, tiny_config
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family


def _register() -> None:
    """transformers' auto classes build moetune's K3 classes from a `kimi_k3` config (the loader, the planner and
    the serving engine build every family through them); importing `modeling` registers the per-expert ->
    fused-experts conversion both loaders read."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

    from moetune.workers.families.kimi_k3 import configuration, modeling, processor

    AutoConfig.register("kimi_k3", configuration.KimiK3Config, exist_ok=True)
    AutoConfig.register("kimi_k3_text", configuration.KimiK3TextConfig, exist_ok=True)
    AutoModelForImageTextToText.register(configuration.KimiK3Config, modeling.KimiK3ForConditionalGeneration,
                                         exist_ok=True)
    AutoModelForCausalLM.register(configuration.KimiK3TextConfig, modeling.KimiK3ForCausalLM, exist_ok=True)
    AutoImageProcessor.register(configuration.KimiK3Config,
                                image_processor_classes={"pil": processor.KimiK3ImageProcessor}, exist_ok=True)


def expert_activation(experts):
    return experts.act  # SiTU-GLU: beta·tanh(gate/beta)·sigmoid(gate) times the bounded up half


_register()

FAMILY = Family(FAMILIES["kimi_k3"], moe_block="KimiK3MoE", shared_experts="shared_experts",
                tiny_config=tiny_config, auto_class="AutoModelForImageTextToText", lora_scope=".language_model.",
                vision_scopes=(".vision_tower.", ".mm_projector."), tiny_vision=TINY_VISION,
                swaps=(kda_swap("KimiK3DeltaAttention"), segment_attention_swap("KimiK3Attention")),
                model_type_aliases=("kimi_k3_text",), expert_activation=expert_activation,
                # the Attention Residuals' projections: their weight is the mix's pseudo-query, never called
                lora_unsupported=("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"),
                demo="seed", as_released=as_released, pipeline_stage=KimiK3Stage)
