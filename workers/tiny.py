"""Assets of the embedded demo, generated on the spot (nothing is ever downloaded).

A tiny random checkpoint of a demo family (its family's `tiny_config`, `Family.demo`: "text" for the tests' plain
checkpoint, "seed" for `moetune demo`'s seed model as released, "images"), a byte-level tokenizer with chat role
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


def image_chat_template(placeholder: str) -> str:
    """CHAT_TEMPLATE for content that may hold images: each image part rendered as the family's `placeholder` (its
    processor expands the image token in it to one token per merged patch)."""
    return (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
        "{% else %}" + placeholder + "{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def write_tiny_tokenizer(local_dir: str, extra_tokens: tuple[str, ...] = (),
                         chat_template: str = CHAT_TEMPLATE) -> None:
    """A byte-level BPE without merges: 256 byte tokens, then the special tokens (and `extra_tokens`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS, END, *ROLE_TOKENS, *extra_tokens])
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=chat_template,
        model_max_length=4096,
    ).save_pretrained(local_dir)


def write_tiny_checkpoint(local_dir: str, seed: int = 0, kind: str = "text", head_std: float = 0.1,
                          released: bool = True) -> str:
    """Writes a sharded safetensors checkpoint (with index.json) of the `kind` demo family plus tokenizer: fp32 as
    transformers saves it, then in the family's released format where it has one (`Family.as_released`) unless
    `released` is False; `head_std`: the output head's init (see _like_trained). Returns the dir."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from moetune.workers.families import demo_family

    family = demo_family(kind)
    os.makedirs(local_dir, exist_ok=True)
    write_tiny_tokenizer(local_dir)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    # Vocab rounded up to a multiple of 8, as real checkpoints do.
    config = family.tiny_config(vocab_size=(len(tokenizer) + 7) // 8 * 8, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, family.auto_class).from_config(config, dtype=torch.float32)
    _like_trained(model, config.get_text_config().initializer_range, head_std)
    model.save_pretrained(local_dir, max_shard_size="200KB")
    if released and family.as_released is not None:
        family.as_released(local_dir)
    return local_dir


def _like_trained(model, initializer_range: float, head_std: float = 0.1) -> None:
    import torch

    with torch.no_grad():
        # Random init leaves the router at zero (uniform routing); give it a spread like a trained router.
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, initializer_range)
        # A trained model's output head spans a wide logit range; with the default 0.02 std the best
        # logits LoRA can reach stay near uniform (loss would stall near 4.7 instead of falling below 2).
        model.get_output_embeddings().weight.normal_(0.0, head_std)


def write_tiny_multimodal_checkpoint(local_dir: str, tiny_config, seed: int = 0) -> str:
    """A vision-language checkpoint of `tiny_config()`'s family (its `tiny_vision`): random weights of its
    *ForConditionalGeneration, the byte tokenizer with the family's image tokens and a template that places them,
    and the family's image processor config. Returns the dir."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from moetune.workers.families import family_for

    vision = family_for(tiny_config()).tiny_vision
    os.makedirs(local_dir, exist_ok=True)
    write_tiny_tokenizer(local_dir, tuple(vision.tokens.values()), image_chat_template(vision.placeholder))
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    config = tiny_config(vocab_size=(len(tokenizer) + 7) // 8 * 8, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    for key, token in vision.tokens.items():
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    vision.image_processor(config.vision_config).save_pretrained(local_dir)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _like_trained(model, config.get_text_config().initializer_range)
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


_RGB = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (240, 220, 40)}


def solid_png(colour: str, size: int = 32) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), _RGB[colour]).save(out, format="PNG")
    return out.getvalue()


def tiny_image_rows(n_rows: int, seed: int) -> list[dict]:
    """Chat rows asking for the colour of a solid-colour image (inline as a data: URL); the answer is its name."""
    import base64

    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        colour = rng.choice(list(_RGB))
        url = "data:image/png;base64," + base64.b64encode(solid_png(colour, rng.choice((32, 64)))).decode()
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what colour is this?"}]},
            {"role": "assistant", "content": colour}]})
    return rows


def write_tiny_dataset(path: str, n_rows: int, seed: int = 0, rows=tiny_rows) -> str:
    """JSONL of `rows(n_rows, seed)` (by default `text` and chat `messages` rows mixed; tiny_image_rows for the
    image rows); `path` is a local file path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows(n_rows, seed))
    return path
