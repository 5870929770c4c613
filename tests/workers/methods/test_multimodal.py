"""The image path of qwen3_5_moe against transformers' own Qwen3-VL processor on the tiny multimodal checkpoint:
the same input ids (image tokens placed and repeated per merged patch), pixels, grids and token types; loss only on
assistant tokens; rows too long with their image tokens refused; the batch runs through the model."""

import pytest
import torch

from moetune.api.chat_content import image_urls
from moetune.workers.errors import DatasetError
from moetune.workers.families import REGISTRY
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.multimodal import ImageRows, collate_with_images, load_image
from moetune.workers.tiny import solid_png, tiny_image_rows, write_tiny_multimodal_checkpoint
from tests.support.images import data_url, image_bytes, image_row


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return write_tiny_multimodal_checkpoint(str(tmp_path_factory.mktemp("tiny-vl")),
                                            REGISTRY["qwen3_5_moe"].tiny_config)


@pytest.fixture(scope="module")
def image_rows(tiny_vl):
    from transformers import AutoConfig, AutoTokenizer

    image_token_id = AutoConfig.from_pretrained(tiny_vl).image_token_id
    return ImageRows(tiny_vl, AutoTokenizer.from_pretrained(tiny_vl), image_token_id)


@pytest.fixture(scope="module")
def reference(tiny_vl):
    """transformers' Qwen3VLProcessor from the checkpoint's image processor, tokenizer and template. Its video
    processor needs torchvision, which has no wheel for this CPU torch: only that attribute's class check is skipped
    (no video goes through it)."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(tiny_vl), tokenizer=tokenizer,
                                video_processor=None, chat_template=tokenizer.chat_template)


ROWS = [image_row(data_url(solid_png("red", 32)), data_url(image_bytes(64, 48, colour=(0, 0, 200))),
                  question="two colours?", answer="red and blue"),
        tiny_image_rows(1, seed=3)[0]]


@pytest.mark.parametrize("row", ROWS, ids=["two images", "dataset row"])
def test_inputs_are_transformers_processors(image_rows, reference, row):
    images = [load_image(url) for _, url in image_urls(row)]
    text = reference.tokenizer.apply_chat_template(row["messages"], tokenize=False)
    expected = reference(text=[text], images=images, return_tensors="pt")
    example = image_rows.example(row, seq_len=512)
    batch = collate_with_images([example], reference.tokenizer.pad_token_id, image_rows.image_token_id)

    assert example.input_ids == expected["input_ids"][0].tolist()
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(batch.inputs[key].to(expected[key].dtype), expected[key]), key
    assert expected["attention_mask"].all() and "attention_mask" not in batch.inputs  # one row: no padding


def test_image_tokens_repeat_per_merged_patch(image_rows):
    """16-pixel patches merged 2x2: 32x32 is one image token; 64x48 is resized to 64x64 (sides rounded to whole
    merged patches of 32), 4x4 patches, four tokens."""
    example = image_rows.example(ROWS[0], seq_len=512)
    assert example.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 4]]
    assert example.input_ids.count(image_rows.image_token_id) == 1 + 4


def test_loss_only_on_assistant_tokens(image_rows):
    example = image_rows.example(ROWS[0], seq_len=512)
    trained = [t for t in example.labels if t != IGNORE]
    assert image_rows.tokenizer.decode(trained) == "red and blue<|end|>"
    assert all(label == IGNORE for token, label in zip(example.input_ids, example.labels)
               if token == image_rows.image_token_id)


def test_rows_too_long_with_their_image_tokens_are_refused(image_rows):
    n = len(image_rows.example(ROWS[0], seq_len=512).input_ids)
    assert image_rows.example(ROWS[0], seq_len=n).input_ids  # fits exactly
    with pytest.raises(DatasetError, match=f"a row with 2 image\\(s\\) is {n} tokens with its image tokens, over "
                                           f"training.seq_len {n - 1}"):
        image_rows.example(ROWS[0], seq_len=n - 1)


def test_mixed_batch_runs_through_the_model(tiny_vl, image_rows, reference):
    """A text row and an image row in one batch: the model reads the pixels (other pixels, other logits on the
    image row only) and the loss is finite."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    text_row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "assistant", "content": "yo"}]}
    red = image_row(data_url(solid_png("red", 32)))
    green = image_row(data_url(solid_png("green", 32)))
    pad = reference.tokenizer.pad_token_id
    with torch.no_grad():
        logits = [model(**collate_with_images([image_rows.example(text_row, 512), image_rows.example(r, 512)],
                                              pad, image_rows.image_token_id).inputs).logits for r in (red, green)]
    n_text = len(image_rows.example(text_row, 512).input_ids)
    assert torch.allclose(logits[0][0, :n_text], logits[1][0, :n_text], atol=1e-5)
    assert not torch.allclose(logits[0][1], logits[1][1])
    assert torch.isfinite(logits[0]).all()
