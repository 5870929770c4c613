"""What a checkpoint folder must hold besides its weights for a job to train on it (torch-free: the control plane
checks it at submission, the driver again before any worker starts)."""

from __future__ import annotations

from moetune.api.models.base import SpecError

# The files transformers builds a tokenizer from (fast, SentencePiece, BPE, WordPiece, tiktoken vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


def check_tokenizer_files(names: list[str], model_uri: str) -> None:
    """`names`: the files directly under the checkpoint folder. Without a tokenizer, transformers builds an empty
    one and a job trains on the few special tokens alone, flat at ln(vocab), and "succeeds"."""
    if not any(name in TOKENIZER_FILES or name.endswith(".tiktoken") for name in names):
        raise SpecError("model", f"model: {model_uri} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                                 "add the tokenizer the model was trained with to the checkpoint folder")


def text_vocab_size(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    size = config.get("vocab_size") or text.get("vocab_size")
    return size if isinstance(size, int) else None


def check_tokenizer_size(tokens: int, config: dict, model_uri: str) -> None:
    """A tokenizer with more tokens than the embedding has rows produces ids the model cannot look up; one with
    less than half of them is not the model's own (a placeholder or another model's)."""
    vocab = text_vocab_size(config)
    if vocab is not None and not vocab // 2 <= tokens <= vocab:
        raise SpecError("model", f"model: the tokenizer in {model_uri} has {tokens} tokens but the model's "
                                 f"vocab_size is {vocab}: it is not this model's tokenizer")
