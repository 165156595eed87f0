"""Hard-linked outputs (cache.type hardlink: one copy of each multi-GB file, not two) stay safe: a
file rewritten in place, which changes DVC's cache object with it, is caught before the next build,
the object and the file are removed, and DVC runs the stage again instead of trusting them."""

from __future__ import annotations

import pytest

from flows import cache_links
from flows.preflight import before_build
from tests.conftest import dvc
from tests.test_cache_integrity import md5_named_objects_match
from tests.test_faults import built_clone  # noqa: F401  (a fixture)


@pytest.mark.e2e
def test_a_file_written_in_place_loses_its_cache_object_and_its_stage_reruns(built_clone):  # noqa: F811
    assert dvc(built_clone, "config", "cache.type").stdout.split(",")[0].strip() == "hardlink"
    data = built_clone / "artifacts" / "tiny" / "variants" / "int4" / "model.onnx.data"
    assert data.stat().st_nlink > 1  # the workspace file is the cache object
    before_build(built_clone, say=lambda line: pytest.fail(f"nothing was written in place, yet: {line}"))

    with open(data, "r+b") as handle:  # in place, as onnx.save or a careless tool would
        handle.seek(100)
        handle.write(b"\xff\xff\xff\xff")
    said = []
    before_build(built_clone, say=said.append)
    assert len(said) == 1 and "model.onnx.data was changed in place" in said[0] and "runs again" in said[0]
    assert not data.exists()
    assert md5_named_objects_match(built_clone / ".dvc" / "cache") > 10  # what is left is whole
    status = dvc(built_clone, "status", "quantize@tiny-int4").stdout
    assert "artifacts/tiny/variants/int4" in status  # DVC runs the stage again


@pytest.mark.e2e
def test_a_build_keeps_one_copy_of_each_file(pushed):
    """The checkpoint the export links and the outputs DVC caches are each one file on disk."""
    artifacts, cache = pushed / "artifacts" / "tiny", pushed / ".dvc" / "cache"
    hf, onnx = artifacts / "hf" / "model.safetensors", artifacts / "onnx" / "model.safetensors"
    assert hf.stat().st_ino == onnx.stat().st_ino == (artifacts / "optimized" / "model.safetensors").stat().st_ino
    cached = {path.stat().st_ino for path in cache.rglob("*") if path.is_file()}
    for path in [hf, *(artifacts / "variants").rglob("model.onnx*")]:
        assert path.stat().st_ino in cached, path  # the workspace file is the cache object
    # What the cache holds alone is DVC's own bookkeeping (directory listings, the run cache), a
    # few KB each; a weight file there would be a second copy.
    alone = [path for path in cache.rglob("*") if path.is_file() and path.stat().st_nlink == 1]
    assert all(path.stat().st_size < 64 * 1024 for path in alone), alone
    assert max(path.stat().st_size for path in (artifacts / "variants").rglob("model.onnx.data")) > 64 * 1024


def test_expected_hash_reads_the_object_path():
    assert cache_links.expected_hash("ab/cdef0123") == "abcdef0123"
    assert cache_links.expected_hash("ab/cdef0123.dir") == "abcdef0123"
