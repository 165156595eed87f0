"""An artifact modified in place after checkout is detected, is not pushed as the cached one, and
the runtime refuses to run it; the project's DVC settings keep the cache apart from the workspace."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ortforge.manifest import check_validated
from tests.conftest import REPO, dvc, fresh_clone

pytestmark = pytest.mark.e2e


def md5_named_objects_match(store: Path) -> int:
    """Check every object in a DVC cache or local remote holds the content its md5 name says."""
    checked = 0
    for path in (store / "files" / "md5").rglob("*"):
        if path.is_file():
            name = path.parent.name + path.name.removesuffix(".dir")
            assert hashlib.md5(path.read_bytes()).hexdigest() == name, path
            checked += 1
    return checked


def test_in_place_edit_is_detected_and_never_pushed(pushed):
    clone = fresh_clone(pushed, "tampered")
    dvc(clone, "pull")
    variant = clone / "artifacts" / "tiny" / "variants" / "int4"
    with open(variant / "model.onnx", "ab") as model:
        model.write(b"tampered")

    status = json.loads(dvc(clone, "status", "--json").stdout)
    assert {"changed outs": {"artifacts/tiny/variants/int4": "modified"}} in status["quantize@tiny-int4"]

    with pytest.raises(ValueError, match=r"changed after validation \(model.onnx differ"):
        check_validated(variant)

    dvc(clone, "push")
    remote = pushed.parent / "ortforge-dvc-remote"
    assert md5_named_objects_match(remote) > 10
    assert md5_named_objects_match(clone / ".dvc" / "cache") > 10  # the cache copy is untouched

    dvc(clone, "checkout", "--force")
    assert check_validated(variant)["passed"]


def test_project_cache_never_links_workspace_files_to_cache_objects():
    link_types = [kind.strip() for kind in dvc(REPO, "config", "cache.type").stdout.strip().split(",")]
    # hardlink and symlink make the workspace file *be* the cache object: an in-place write corrupts it.
    assert link_types and set(link_types) <= {"reflink", "copy"}
