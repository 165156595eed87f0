"""An artifact modified in place after checkout is detected, the runtime refuses to run it, and the
damaged bytes are never pushed: the workspace files are hard links to the cache objects (one copy
on disk), so the build's check (flows/cache_links.py) removes the damaged object before DVC or a
push can trust it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flows.preflight import before_build
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

    said = []
    before_build(clone, say=said.append)  # what `ortforge build` and the scheduled push run first
    assert len(said) == 1 and "model.onnx was changed in place" in said[0]
    assert md5_named_objects_match(clone / ".dvc" / "cache") > 10  # the damaged object is gone
    dvc(clone, "push")
    remote = pushed.parent / "ortforge-dvc-remote"
    assert md5_named_objects_match(remote) > 10

    dvc(clone, "pull", "--force")  # the remote's true copy comes back
    assert check_validated(variant)["passed"]


def test_project_cache_links_workspace_files_to_cache_objects():
    link_types = [kind.strip() for kind in dvc(REPO, "config", "cache.type").stdout.strip().split(",")]
    # Never symlink; hard links only with flows/cache_links.py's check in front of every build.
    assert link_types == ["hardlink", "copy"]
