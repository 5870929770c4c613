"""Assets of the embedded demo, generated on the spot (nothing is ever downloaded).

A tiny random checkpoint of the seed family (`kimi_linear`: KDA linear attention + one full
attention layer, routed experts + a shared expert), a byte-level tokenizer with chat role
tokens, and a JSONL dataset whose patterns such a model picks up within a few dozen steps.
"""

from __future__ import annotations

import json
import os
import random

ROLES = ("system", "user", "assistant", "tool")
PAD, BOS, EOS, END = "<pad>", "<s>", "</s>", "<|end|>"
ROLE_TOKENS = [f"<|{role}|>" for role in ROLES]
# Renders every turn as `<|role|>content<|end|>`; the assistant header alone is the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_tokenizer(local_dir: str) -> None:
    """A byte-level BPE without merges: 256 byte tokens, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS, END, *ROLE_TOKENS])
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    ).save_pretrained(local_dir)


def tiny_config(vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    from transformers import KimiLinearConfig

    num_layers = 4
    return KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        # Same shape as the seed family: mostly KDA, one full-attention layer; first MLP dense.
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1),
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )


def write_tiny_checkpoint(local_dir: str, seed: int = 0) -> str:
    """Writes a sharded safetensors checkpoint (with index.json) plus tokenizer; returns the dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(local_dir, exist_ok=True)
    write_tiny_tokenizer(local_dir)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    # Vocab rounded up to a multiple of 8, as real checkpoints do.
    vocab_size = (len(tokenizer) + 7) // 8 * 8
    config = tiny_config(vocab_size, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Random init leaves the router at zero (uniform routing); give it a spread like a trained router.
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, config.initializer_range)
        # A trained model's output head spans a wide logit range; with the default 0.02 std the best
        # logits LoRA can reach stay near uniform (loss would stall near 4.7 instead of falling below 2).
        model.lm_head.weight.normal_(0.0, 0.1)
    model.save_pretrained(local_dir, max_shard_size="200KB")
    return local_dir


# ------------------------------------------------------------------ dataset

_NAMES = ["ada", "bob", "cy", "dee", "eve", "fox", "gus", "hal"]
_COLORS = ["red", "blue", "green", "gold"]


def _text_row(rng: random.Random) -> dict:
    # Counting runs and repeated phrases: easy for a tiny model to predict after a few steps.
    start = rng.randint(0, 5)
    count = " ".join(str(start + i) for i in range(8))
    name, color = rng.choice(_NAMES), rng.choice(_COLORS)
    return {"text": f"{count}. {name} likes {color}. {name} likes {color}."}


def _chat_row(rng: random.Random) -> dict:
    name, color = rng.choice(_NAMES), rng.choice(_COLORS)
    messages = [{"role": "user", "content": f"what does {name} like?"},
                {"role": "assistant", "content": f"{name} likes {color}."}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "answer briefly."})
    return {"messages": messages}


def tiny_rows(n_rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [_chat_row(rng) if i % 2 else _text_row(rng) for i in range(n_rows)]


def write_tiny_dataset(path: str, n_rows: int, seed: int = 0) -> str:
    """JSONL mixing `text` rows and chat `messages` rows; `path` is a local file path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in tiny_rows(n_rows, seed))
    return path
