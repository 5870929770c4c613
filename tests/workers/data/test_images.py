"""Rows with images (OpenAI's vision fine-tuning format), as the driver checks them before any worker starts: every
bad image gets an error naming the file, the row and the field, and only URIs the tenant may read are read."""

import json

import pytest

from moetune.api import storage
from moetune.api.families import images_refusal
from moetune.api.images import ImageLimits
from moetune.api.uri_access import UriAccess
from moetune.workers.data.images import ImageCheck
from moetune.workers.data.rows import load_rows
from moetune.workers.errors import DatasetError
from moetune.workers.families import REGISTRY
from tests.support.images import data_url, image_bytes, image_row, noise_png

PNG = image_bytes()
URL = "messages[0].content[1].image_url.url"
LIMITS = ImageLimits(max_image_bytes=20_000, max_images_per_row=2, max_image_pixels=64 * 64)


@pytest.fixture
def images(s3_bucket):
    """Objects in the tenant's bucket (a PNG, a text file) and a check that may read only that bucket."""
    storage.write_bytes(f"s3://{s3_bucket}/img/red.png", PNG)
    storage.write_bytes(f"s3://{s3_bucket}/img/notes.png", b"not an image at all")
    storage.write_bytes(f"s3://{s3_bucket}/img/big.png", noise_png(90, 90))
    return s3_bucket, ImageCheck(UriAccess(prefixes=[f"s3://{s3_bucket}/img"]), LIMITS, refusal=None)


def _file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"file://{path}"


def _refusal(tmp_path, check, bad_row: dict) -> str:
    uri = _file(tmp_path, [image_row(data_url(PNG)), bad_row])
    with pytest.raises(DatasetError) as err:
        load_rows(uri, "training_file", check)
    assert (err.value.code, err.value.param) == ("invalid_training_file", "training_file")
    prefix = f"training_file {uri} row 2: "
    assert str(err.value).startswith(prefix), str(err.value)
    return str(err.value).removeprefix(prefix)


def test_good_images_inline_and_in_storage_pass(tmp_path, images):
    bucket, check = images
    rows = [image_row(data_url(PNG), f"s3://{bucket}/img/red.png"),
            image_row(data_url(image_bytes(fmt="JPEG"), "image/jpeg")),
            image_row(data_url(image_bytes(fmt="WEBP"), "image/webp"), question="and this one?")]
    assert load_rows(_file(tmp_path, rows), "training_file", check) == rows


@pytest.mark.parametrize("url, problem", [
    ("data:image/png;base64,%%%not-base64", "holds data that is not valid base64"),
    (data_url(b"plain text, base64-encoded"), "is not an image (supported formats: JPEG, PNG, WEBP)"),
    (data_url(image_bytes(fmt="GIF"), "image/gif"), "is a GIF image; supported formats: JPEG, PNG, WEBP"),
    (data_url(image_bytes(fmt="BMP"), "image/bmp"), "is a BMP image; supported formats: JPEG, PNG, WEBP"),
    (data_url(noise_png()[:1500]), "cannot be decoded (image file is truncated)"),
    (data_url(image_bytes(65, 64)), "is 65x64 pixels, over the limit of 4,096 pixels per image"),
    (data_url(noise_png(90, 90)), "bytes, over the limit of 20,000 bytes (0.02 MB) per image"),
    ("data:text/plain;base64,aGk=", "must be a data:image/...;base64, URL or an object-storage URI"),
    ("https://example.com/cat.png", "is a web URL: the workers fetch nothing from the internet"),
    ("ftp://example.com/cat.png", "must be a data:image/...;base64, URL or an object-storage URI"),
])
def test_bad_inline_images_name_row_and_field(tmp_path, images, url, problem):
    message = _refusal(tmp_path, images[1], image_row(url))
    assert message.startswith(f"'{URL}' ") and problem in message, message


def test_storage_images_are_read_only_within_the_tenants_access(tmp_path, images):
    """Security: a row cannot make the driver read another bucket, a sibling prefix, a path with '..', or the
    workers' disks; every refusal happens before the object is read."""
    bucket, check = images
    outside = f"is outside this tenant's storage locations (s3://{bucket}/img)"
    for url, problem in [
        (f"s3://{bucket}-other/img/red.png", f"is refused: s3://{bucket}-other/img/red.png {outside}"),
        (f"s3://{bucket}/imgs/red.png", f"is refused: s3://{bucket}/imgs/red.png {outside}"),
        (f"s3://{bucket}/img/../secret.png", "is refused: '..' path segments are not allowed"),
        ("file:///etc/passwd", "is refused: file:// URIs are disabled on this server; use s3://"),
        (f"s3://{bucket}/img/missing.png", f"names s3://{bucket}/img/missing.png, which does not exist"),
        (f"s3://{bucket}/img/notes.png", f"names s3://{bucket}/img/notes.png, which is not an image (supported "
                                         "formats: JPEG, PNG, WEBP)"),
        (f"s3://{bucket}/img/big.png", f"names s3://{bucket}/img/big.png, which is {len(noise_png(90, 90)):,} bytes, "
                                       "over the limit of 20,000 bytes (0.02 MB) per image"),
    ]:
        assert _refusal(tmp_path, check, image_row(url)) == f"'{URL}' {problem}", url


def test_too_many_images_in_a_row(tmp_path, images):
    assert _refusal(tmp_path, images[1], image_row(*[data_url(PNG)] * 3)) == (
        "holds 3 images, over the limit of 2 per row")


def test_images_sent_to_a_text_only_model(tmp_path):
    """kimi_linear has no vision tower: the first image of the file is refused, text-only parts are fine."""
    check = ImageCheck(UriAccess(), LIMITS, images_refusal(REGISTRY["kimi_linear"].tiny_config().to_dict()))
    text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}
    uri = _file(tmp_path, [text_parts, image_row(data_url(PNG))])
    with pytest.raises(DatasetError) as err:
        load_rows(uri, "training_file", check)
    assert str(err.value) == (f"training_file {uri} row 2: '{URL}' is an image, but moetune trains 'kimi_linear' "
                              "models on text only (no image input for this family)")
    assert images_refusal({"model_type": "qwen3_5_moe", "text_config": {}}) is not None


@pytest.mark.parametrize("content, problem", [
    ([], "'messages[0].content' must be a string or a non-empty list of content parts"),
    ([{"type": "text"}], "'messages[0].content[0].text' must be a string"),
    ([{"type": "audio", "audio": "..."}], "'messages[0].content[0].type' must be 'text' or 'image_url'"),
    (["hi"], "'messages[0].content[0]' must be an object with a 'type'"),
    ([{"type": "image_url", "image_url": "s3://b/x.png"}],
     "'messages[0].content[0].image_url.url' must be a non-empty string"),
    ([{"type": "image_url", "image_url": {"url": "s3://b/x.png", "detail": "max"}}],
     "'messages[0].content[0].image_url.detail' must be one of auto, low, high"),
])
def test_malformed_content_parts(tmp_path, content, problem):
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}
    assert _refusal(tmp_path, None, row) == problem


def test_images_in_assistant_turns_are_refused(tmp_path):
    row = {"messages": [{"role": "user", "content": "draw a cat"},
                        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}]}
    assert _refusal(tmp_path, None, row) == ("'messages[1].content[0]' is an image in an assistant turn; images are "
                                             "allowed in user and system turns only")
