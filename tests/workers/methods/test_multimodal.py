"""The image path against transformers' own processor of each family that takes images (qwen3_5_moe: Qwen3-VL's;
glm5_next: Glm5NextProcessor) on its tiny multimodal checkpoint: the same input ids (image tokens placed and
repeated per merged patch), pixels, grids and token types; on qwen3_5_moe also: loss only on assistant tokens, rows
too long with their image tokens refused, the batch through the model."""

import pytest
import torch

from moetune.api.chat_content import image_urls
from moetune.workers.errors import DatasetError
from moetune.workers.families import REGISTRY
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.multimodal import ImageRows, collate_with_images, load_image
from moetune.workers.tiny import solid_png, tiny_image_rows, write_tiny_multimodal_checkpoint
from bench.support.image_batches import with_padding_mask
from tests.support.images import data_url, image_bytes, image_row

PROCESSORS = {"qwen3_5_moe": "Qwen3VLProcessor", "glm5_next": "Glm5NextProcessor"}


@pytest.fixture(scope="module", params=sorted(PROCESSORS))
def family_vl(request, tmp_path_factory):
    return write_tiny_multimodal_checkpoint(str(tmp_path_factory.mktemp(request.param)),
                                            REGISTRY[request.param].tiny_config)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return write_tiny_multimodal_checkpoint(str(tmp_path_factory.mktemp("tiny-vl")),
                                            REGISTRY["qwen3_5_moe"].tiny_config)


def rows_of(checkpoint: str) -> ImageRows:
    from transformers import AutoConfig, AutoTokenizer

    image_token_id = AutoConfig.from_pretrained(checkpoint).image_token_id
    return ImageRows(checkpoint, AutoTokenizer.from_pretrained(checkpoint), image_token_id)


def processor_of(checkpoint: str):
    """transformers' processor of the checkpoint's family from its image processor, tokenizer and template. Its
    video processor needs torchvision, which has no wheel for this CPU torch: only that attribute's class check is
    skipped (no video goes through it)."""
    from unittest import mock

    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    processor = getattr(transformers, PROCESSORS[AutoConfig.from_pretrained(checkpoint).model_type])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return processor(image_processor=AutoImageProcessor.from_pretrained(checkpoint), tokenizer=tokenizer,
                         video_processor=None, chat_template=tokenizer.chat_template)


@pytest.fixture(scope="module")
def image_rows(tiny_vl):
    return rows_of(tiny_vl)


@pytest.fixture(scope="module")
def reference(tiny_vl):
    return processor_of(tiny_vl)


ROWS = [image_row(data_url(solid_png("red", 32)), data_url(image_bytes(64, 48, colour=(0, 0, 200))),
                  question="two colours?", answer="red and blue"),
        tiny_image_rows(1, seed=3)[0]]


@pytest.mark.parametrize("row", ROWS, ids=["two images", "dataset row"])
def test_inputs_are_transformers_processors(family_vl, row):
    reference, image_rows = processor_of(family_vl), rows_of(family_vl)
    images = [load_image(url) for _, url in image_urls(row)]
    text = reference.tokenizer.apply_chat_template(row["messages"], tokenize=False)
    expected = reference(text=[text], images=images, return_tensors="pt")
    example = image_rows.example(row, seq_len=512)
    batch = collate_with_images([example], reference.tokenizer.pad_token_id, image_rows.image_token_id)

    assert example.input_ids == expected["input_ids"][0].tolist()
    # the driver's count of the row's tokens, from the image sizes alone, is the processor's
    sizes, n = [image.size for image in images], len(example.input_ids)
    assert image_rows.too_long(row, sizes, n) is None and f" is {n} tokens " in image_rows.too_long(row, sizes, n - 1)
    assert set(expected) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert "attention_mask" not in batch.inputs and expected["attention_mask"].all()  # one row: no padding
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(batch.inputs[key].to(expected[key].dtype), expected[key]), key


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


# ------------------------------------------------------------------ the method a job gets


def test_method_for_takes_images_only_on_a_checkpoint_that_does(tiny_vl, tmp_path):
    from transformers import AutoTokenizer

    from moetune.workers.methods import method_for
    from moetune.workers.methods.multimodal import SupervisedImageMethod
    from moetune.workers.tiny import write_tiny_checkpoint
    from bench.support.harness import spec

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    job = spec(ep=1, zero=2)
    assert type(method_for(job.method, job.training, tokenizer, tiny_vl)) is SupervisedImageMethod
    text_dir = write_tiny_checkpoint(str(tmp_path / "text"))
    assert type(method_for(job.method, job.training, tokenizer, text_dir)).__name__ == "SupervisedMethod"
    assert type(method_for(job.method, job.training, tokenizer)).__name__ == "SupervisedMethod"


def test_mixed_batch_loss_through_the_loss_head(tiny_vl, image_rows):
    """A text row, a chat row and two image rows in one micro-batch through the job's interface (prepare installs
    the loss head, loss_sum takes the model): the stock model's cross-entropy over its logits, on assistant and text
    tokens only, and the same gradients."""
    import copy

    from transformers import AutoModelForImageTextToText

    from moetune.workers.methods.multimodal import SupervisedImageMethod
    from moetune.workers.methods.sft import token_loss_sum

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    plain = copy.deepcopy(model)
    method = SupervisedImageMethod(image_rows.tokenizer, 512, image_rows)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [{"text": "1 2 3 4"}, chat, *tiny_image_rows(2, seed=5)]
    examples, dropped = method.examples(rows)
    assert dropped == 0 and [type(e).__name__ for e in examples] == ["Example"] * 2 + ["ImageExample"] * 2
    batch = method.collate(examples)
    assert batch.inputs["image_grid_thw"].shape[0] == 2 and "attention_mask" not in batch.inputs
    want = token_loss_sum(plain(**with_padding_mask(batch.inputs, image_rows.tokenizer.pad_token_id)).logits,
                          batch.labels)
    want.backward()
    method.prepare(model)
    assert method.head is not None
    got = method.loss_sum(model, batch)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is not None and "lm_head" not in name:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_shorter_stage_never_cuts_an_image(image_rows):
    """Staged context length: a cut through an image ends the example before that image, its pixels dropped with
    it; a cut after every image keeps them all."""
    from moetune.workers.methods.multimodal import ImageExample

    example = image_rows.example(ROWS[0], seq_len=512)  # images of 1 and 4 tokens
    first, second = example.image_starts
    after_first = example.truncated(second + 2)  # through the second image
    assert isinstance(after_first, ImageExample) and len(after_first.input_ids) == second
    assert after_first.image_grid_thw.tolist() == [[1, 2, 2]] and after_first.pixel_values.shape[0] == 4
    assert after_first.input_ids.count(image_rows.image_token_id) == 1
    none = example.truncated(first)
    assert type(none).__name__ == "Example" and image_rows.image_token_id not in none.input_ids
    whole = example.truncated(second + 4)
    assert torch.equal(whole.pixel_values, example.pixel_values) and len(whole.input_ids) == second + 4
    batch = collate_with_images([after_first, none], image_rows.tokenizer.pad_token_id, image_rows.image_token_id)
    assert int(batch.inputs["mm_token_type_ids"].sum()) == 1  # tokens and pixels agree: the model can run it


def test_image_rows_without_a_processor_file_are_refused(tiny_vl, tmp_path, image_rows):
    import shutil

    bare = shutil.copytree(tiny_vl, tmp_path / "bare")
    (bare / "preprocessor_config.json").unlink()
    rows = ImageRows(str(bare), image_rows.tokenizer, image_rows.image_token_id)
    assert rows.example({"text": "no image"}, 64).input_ids  # a text row needs no processor
    with pytest.raises(DatasetError, match="no preprocessor_config.json"):
        rows.example(ROWS[1], 512)
