"""Rows with images, through the family's own image processor loaded from the checkpoint folder (its
preprocessor_config.json; nothing from a hub). The chat template places one image token per image part; the
processor's grid says how many tokens that image becomes (one per merged patch), and the token is repeated as
transformers' processor repeats it (Qwen3-VL's and Glm5NextProcessor's rule alike). The batch carries pixel_values
and the grid inputs (image_grid_thw, mm_token_type_ids) into `model(**inputs)`. Image tokens never carry loss, and a
row that does not fit seq_len with its images is refused, never truncated through an image."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

from moetune.api import storage
from moetune.api.chat_content import DATA_URL_PREFIX, image_urls
from moetune.api.images import data_url_bytes
from moetune.workers.errors import DatasetError
from moetune.workers.methods.batch import IGNORE, Batch
from moetune.workers.methods.sft import (Example, SupervisedMethod, chat_example, collate, tokenize_row,
                                        with_loss)


@dataclass
class ImageExample(Example):
    pixel_values: object = None  # [patches, channels x temporal patch x patch x patch], this row's images in order
    image_grid_thw: object = None  # [images, 3]: each image's (frames, rows, columns) of patches
    image_starts: tuple[int, ...] = ()  # where each image's run of tokens starts in input_ids
    tokens_per_patch: int = 4  # patches merged into one token (merge_size squared)

    def truncated(self, seq_len: int) -> Example:
        """Within a shorter context (a staged context length's early stage), cut before the first image that
        does not fit whole: an image is never cut, and its pixels go with the images kept."""
        if len(self.input_ids) <= seq_len:
            return self
        counts = (self.image_grid_thw.prod(-1) // self.tokens_per_patch).tolist()
        kept = sum(start + n <= seq_len for start, n in zip(self.image_starts, counts))
        cut = min(seq_len, self.image_starts[kept]) if kept < len(counts) else seq_len
        if not kept:
            return Example(self.input_ids[:cut], self.labels[:cut])
        patches = int(self.image_grid_thw[:kept].prod(-1).sum())
        return ImageExample(self.input_ids[:cut], self.labels[:cut], self.pixel_values[:patches],
                            self.image_grid_thw[:kept], self.image_starts[:kept], self.tokens_per_patch)


def load_image(url: str):
    """A PIL image from a data: URL or storage (the driver checked every one before any worker started)."""
    from PIL import Image

    data = data_url_bytes(url) if url.startswith(DATA_URL_PREFIX) else storage.read_bytes(url)
    return Image.open(io.BytesIO(data))


class ImageRows:
    """Tokenizes chat rows with images as the family's processor does (the checkpoint's own, e.g. Qwen3-VL's)."""

    def __init__(self, local_dir: str, tokenizer, image_token_id: int):
        self.local_dir, self.tokenizer, self.image_token_id = local_dir, tokenizer, image_token_id
        self._processor = None
        self.blank = None  # (pixel_values, image_grid_thw) of the smallest blank image, once needed

    @property
    def image_processor(self):
        """Loaded on the first image row: a text-only job needs no processor file."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            if not self.has_processor:
                raise DatasetError("training_file", "rows have images but the model folder has no "
                                                    "preprocessor_config.json (the checkpoint's image processor)")
            self._processor = AutoImageProcessor.from_pretrained(self.local_dir)
        return self._processor

    @property
    def has_processor(self) -> bool:
        """Whether the model folder has the checkpoint's image processor (the driver refuses image rows without)."""
        return os.path.exists(os.path.join(self.local_dir, "preprocessor_config.json"))

    @property
    def tokens_per_patch(self) -> int:
        return self.image_processor.merge_size ** 2  # merged patches: one token each

    def example(self, row: dict, seq_len: int, param: str = "training_file") -> Example:
        urls = [url for _, url in image_urls(row)]
        if not urls:
            return tokenize_row(self.tokenizer, row, seq_len)
        vision = self.image_processor(images=[load_image(url) for url in urls], return_tensors="pt")
        counts = iter((vision["image_grid_thw"].prod(-1) // self.tokens_per_patch).tolist())
        text = chat_example(self.tokenizer, row["messages"])
        ids, labels, starts = [], [], []
        for token, label in zip(text.input_ids, text.labels):
            n = next(counts) if token == self.image_token_id else 1
            starts += [len(ids)] if token == self.image_token_id else []
            ids += [token] * n
            labels += [IGNORE if token == self.image_token_id else label] * n
        if problem := _over(len(ids), len(urls), seq_len):
            raise DatasetError(param, f"{param}: a row {problem}")
        return ImageExample(ids, labels, vision["pixel_values"], vision["image_grid_thw"], tuple(starts),
                            self.tokens_per_patch)


    def too_long(self, row: dict, sizes: list[tuple[int, int]], seq_len: int) -> str | None:
        """Why a row is over `seq_len` with its images of these (width, height), or None: the driver's check of
        every row before any worker starts, with the processor's own count of an image's patches (what vLLM uses
        too), without processing a pixel."""
        tokens = len(chat_example(self.tokenizer, row["messages"]).input_ids) + sum(
            self.image_processor.get_number_of_image_patches(height, width) // self.tokens_per_patch - 1
            for width, height in sizes)  # each image part's one token becomes the image's run
        return _over(tokens, len(sizes), seq_len)


def _over(tokens: int, images: int, seq_len: int) -> str | None:
    if tokens <= seq_len:
        return None
    return (f"with {images} image(s) is {tokens} tokens with its image tokens, over training.seq_len {seq_len}; "
            "rows are never cut through an image")


def collate_with_images(examples: list[Example], pad_id: int, image_token_id: int) -> Batch:
    """The text batch plus, when any row has images, their pixels and grids (rows in order) and the token types
    (1 on image tokens) from which the model computes its multimodal rotary positions. No padding mask, as for
    text (`collate`): the padding follows every real token, so neither the causal mask nor the rotary positions of
    a real token change without it."""
    import torch

    batch = collate(examples, pad_id)
    with_images = [e for e in examples if isinstance(e, ImageExample)]
    if with_images:
        batch.inputs["pixel_values"] = torch.cat([e.pixel_values for e in with_images])
        batch.inputs["image_grid_thw"] = torch.cat([e.image_grid_thw for e in with_images])
        batch.inputs["mm_token_type_ids"] = (batch.inputs["input_ids"] == image_token_id).int()
    return batch


class SupervisedImageMethod(SupervisedMethod):
    """SFT on a mix of text and image rows (`ImageRows`); the loss is SFT's, on assistant tokens."""

    def __init__(self, tokenizer, seq_len: int, images: ImageRows):
        super().__init__(tokenizer, seq_len)
        self.images = images

    def examples(self, rows: list[dict]) -> tuple[list[Example], int]:
        return with_loss([self.images.example(row, self.seq_len) for row in rows])

    def too_long(self, row: dict, sizes: list[tuple[int, int]]) -> str | None:
        return self.images.too_long(row, sizes, self.seq_len)

    def collate(self, examples: list[Example]) -> Batch:
        return collate_with_images(examples, self.tokenizer.pad_token_id, self.images.image_token_id)

    def loss_sum(self, model, batch: Batch):
        """SFT's loss. A micro-batch without images runs the vision tower too, on the processor's smallest blank
        image, adding 0 × its output: every rank then runs the same modules in the same order. Under ZeRO-3 each of
        the tower's modules gathers its weights with a collective, and a rank that skipped them would leave its
        peers waiting in those gathers (NCCL hangs until its watchdog). It runs where the family's forward runs
        the tower, right after the token embeddings (a tower run before the forward gathers in another order)."""
        if "pixel_values" in batch.inputs or not self.images.has_processor:  # without one no rank has images
            return super().loss_sum(model, batch)
        idle = []
        hook = model.get_input_embeddings().register_forward_hook(
            lambda *_: idle.append(self._idle_vision(model, batch.labels.device)))
        try:
            loss = super().loss_sum(model, batch)
        finally:
            hook.remove()
        return loss + idle[0]

    def _idle_vision(self, model, device):
        from PIL import Image

        if self.images.blank is None:  # 64 pixels: above every family's patch x merge; the processor resizes
            vision = self.images.image_processor(images=[Image.new("RGB", (64, 64))], return_tensors="pt")
            self.images.blank = vision["pixel_values"], vision["image_grid_thw"]
        pixel_values, grid = (t.to(device) for t in self.images.blank)
        features = model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid)
        return 0.0 * sum(t.float().sum() for t in _tensors(features))


def _tensors(output) -> list:
    """The tensors of a model output: a tensor, a tuple, or a transformers ModelOutput (a dict) of those."""
    import torch

    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for value in output for t in _tensors(value)] if isinstance(output, (tuple, list)) else []
