"""The package's dependencies point one way (docs/design.md §6): a subpackage imports only subpackages below it.

Every ``rotarium.*`` import counts, lazy ones inside functions included, since a lazy import that runs upward is
still a cycle a reader has to untangle. The package's own ``__init__`` is its public face: it may gather anything,
and modules that need the Auto-class registration (``import rotarium``) sit above the models.
"""
import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "rotarium"

# Lower numbers are lower layers; a module may import its own subpackage and any of a lower rank.
RANKS = {
    "utils": 0,
    "ops": 1,
    "layers": 2,
    "models": 3,
    "configs": 4,
    "data": 4,
    "rotarium": 4,  # `import rotarium` / `from rotarium import x`: the registered public face
    "evaluation": 5,
    "hub": 5,
    "training": 6,
    "synthetic": 7,
    "cli": 8,
    "__main__": 9,
}


def imported_subpackages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rotarium":
                found.add(parts[1] if len(parts) > 1 else "rotarium")
    return found


def subpackage(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).with_suffix("").parts[0]


MODULES = sorted(p for p in PACKAGE_DIR.rglob("*.py") if p != PACKAGE_DIR / "__init__.py")


def test_every_subpackage_has_a_rank():
    assert {subpackage(p) for p in MODULES} <= set(RANKS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_imports_point_down(path):
    own = subpackage(path)
    upward = {dep for dep in imported_subpackages(path) if dep != own and RANKS[dep] >= RANKS[own]}
    assert not upward, f"{path.relative_to(PACKAGE_DIR)} ({own}) imports {sorted(upward)}, which are not below it"
