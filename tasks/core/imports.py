"""What a stage's code imports, read from its source: the repository modules (its DVC code
dependencies) and the installed distributions (the tools in its cache key), so neither list is
written by hand.

A stage's closure is its module and every tasks/ or ortforge/ module it imports, at any depth and
at any level (imports inside functions count: that is where heavy ones live). Tools are the
distributions those modules import, plus what those distributions require, kept to the ones
versions.yaml pins.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "ortforge")
OWN = (*PACKAGES, "flows", "benchmarks", "tests")  # this repository's top-level packages, never a tool
# Tools that distributions import without declaring them as requirements (found in their installed
# files; tests/test_contract.py checks each is still imported there): onnxruntime's optimizer and
# quantizers and genai's builder import onnx_ir. (torch.onnx does too, but only its exporter, which
# reaches a stage through optimum and onnxruntime-genai's stages anyway.)
UNDECLARED = {"onnxruntime": ("onnx-ir",), "onnxruntime-genai": ("onnx-ir",)}


# Files a module reads as code, which imports cannot show: the C sources the runtime compiles into
# its attention kernel (ortforge/custom_ops.py). A stage that reaches the module depends on them.
COMPANIONS = {"ortforge/custom_ops.py": ("ortforge/csrc",)}


def is_package_file(path: str) -> bool:
    """tasks/' package files, which hold a docstring at most (tests/test_contract.py): the one part
    of a stage's imports that shapes nothing it writes. tasks/core/ counts like any module: it
    writes the JSON, the manifest's versions and the params' defaults."""
    return path.startswith("tasks/") and path.endswith("__init__.py")


def module_file(name: str, root: Path = REPO) -> Path | None:
    if name.split(".")[0] not in PACKAGES:
        return None
    for candidate in (root / (name.replace(".", "/") + ".py"), root / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, root: Path = REPO) -> list[str]:
    """Every module name the file imports; `from pkg import submodule` names the submodule."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if module_file(submodule, root) else node.module)
    return names


def closure(start: str, root: Path = REPO) -> set[str]:
    """Repository files (relative paths) start imports, transitively, start included; package
    files are neither included nor looked inside."""
    seen, todo = set(), [start]
    while todo:
        current = todo.pop()
        if current in seen or is_package_file(current):
            continue
        seen.add(current)
        for name in imported_names(root / current, root):
            found = module_file(name, root)
            if found is not None:
                todo.append(found.relative_to(root).as_posix())
    return seen


def stage_code(stage: str, root: Path = REPO) -> set[str]:
    """The stage's code: its modules' closure and their companion files."""
    modules = closure(f"tasks/{stage}.py", root)
    return modules | {companion for module in modules for companion in COMPANIONS.get(module, ())}


def normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


@functools.cache
def _providers() -> dict[str, tuple[str, ...]]:
    found = importlib.metadata.packages_distributions()
    return {module: tuple(map(normalized, dists)) for module, dists in found.items()}


def _requirements(distribution: str) -> list[str]:
    try:
        requires = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    # "name>=1; extra == 'x'": only what every install of the distribution needs.
    return [normalized(re.split(r"[ ;<>=!~\[(]", line, maxsplit=1)[0]) for line in requires if "extra ==" not in line]


def tools(stage: str, pinned: set[str], root: Path = REPO) -> tuple[str, ...]:
    """The pinned distributions the stage's code imports, and those they require, sorted."""
    found, todo = set(), []
    for file in closure(f"tasks/{stage}.py", root):
        for name in imported_names(root / file, root):
            top = name.split(".")[0]
            todo += () if top in OWN else _providers().get(top, ())
    while todo:
        distribution = todo.pop()
        if distribution not in found:
            found.add(distribution)
            todo += [*_requirements(distribution), *UNDECLARED.get(distribution, ())]
    return tuple(sorted(found & {normalized(tool) for tool in pinned}))
