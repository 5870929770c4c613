from moetune.api import storage


def _tree(tmp_path):
    root = tmp_path / "src"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"\x00\x01" * 1000)
    (root / "sub" / "b.json").write_text('{"x": 1}')
    return root


def test_s3_round_trip(tmp_path, s3_bucket):
    uri = f"s3://{s3_bucket}/models/m"
    written = storage.upload_dir(str(_tree(tmp_path)), uri)
    assert sorted(written) == [f"{uri}/a.bin", f"{uri}/sub/b.json"]
    assert storage.exists(f"{uri}/sub/b.json") and not storage.exists(f"{uri}/nope")
    assert storage.read_text(f"{uri}/sub/b.json") == '{"x": 1}'

    local = storage.download_dir(uri, str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "a.bin").read_bytes() == b"\x00\x01" * 1000
    assert (tmp_path / "dst" / "sub" / "b.json").read_text() == '{"x": 1}'
    assert local == str(tmp_path / "dst")

    storage.write_bytes(f"s3://{s3_bucket}/x/y.txt", b"hi")
    assert storage.read_bytes(f"s3://{s3_bucket}/x/y.txt") == b"hi"


def test_file_and_memory_uris(tmp_path):
    src = _tree(tmp_path)
    for uri in (f"file://{tmp_path}/copy", "memory://moetune-test/copy"):
        storage.upload_dir(str(src), uri)
        assert storage.read_text(storage.join(uri, "sub/b.json")) == '{"x": 1}'


def test_download_of_missing_folder_fails(s3_bucket, tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError):
        storage.download_dir(f"s3://{s3_bucket}/none", str(tmp_path / "d"))
