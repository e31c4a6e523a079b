"""The bundler: the exported code is generated from rotarium's sources, complete, and free of rotarium / fla."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
from transformers.dynamic_module_utils import get_imports, get_relative_imports

from rotarium.models import remote_code
from rotarium.models.remote_code import ENTRY_FILES, bundle, dependencies, flat_name, module_order

ALLOWED = {"torch", "transformers"} | set(sys.stdlib_module_names)
# The packages of the model; the others (training, data, evaluation, synthetic, hub, configs, utils) are the library
# around it. Of the model's packages, what the model's forward and generate never run:
MODEL_PACKAGES = ("ops", "layers", "models")
NOT_RUN_BY_THE_MODEL = ("models/remote_code.py", "models/loading.py", "ops/__init__.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bundle")
    remote_code.write_remote_code(folder)
    return folder


@pytest.mark.slow
def test_bundle_covers_every_module_the_model_imports():
    # What importing the model really loads, in a fresh interpreter.
    script = ("import sys, rotarium.models.modeling\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rotarium'))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                           check=True).stdout.replace("'", '"')))
    # Parent packages run only because Python imports parents: `rotarium/__init__.py` exports the presets,
    # `rotarium/models/__init__.py` the checkpoint-loading helper and the bundler (the save hook), and the ops
    # packages gather their kernels and the naive references. The flat files of a bundle have no parents, and the
    # model uses none of that code.
    parents_only = {"rotarium", "rotarium.models", "rotarium.configs", "rotarium.configs.presets", "rotarium.utils",
                    "rotarium.models.loading", "rotarium.models.remote_code", "rotarium.utils.files",
                    "rotarium.ops", "rotarium.ops.gla", "rotarium.ops.delta_rule", "rotarium.ops.forgetting_attn",
                    "rotarium.ops.gla.naive", "rotarium.ops.delta_rule.naive", "rotarium.ops.forgetting_attn.naive"}
    assert set(module_order()) == loaded - parents_only
    assert set(ENTRY_FILES) <= set(module_order())


def test_the_bundle_holds_only_the_model_code(files):
    """An exported folder ships the configuration, the modeling file and the layers and kernels their forward and
    generate run: nothing of the library around the model (training, data, evaluation, the Hub tools, utils), the
    bundler itself or the kernels' test references."""
    sources = {}
    for path in files.glob("*.py"):
        header = re.match(r"# Generated from rotarium/(\S+) by ", path.read_text())
        sources[path.name] = header.group(1)
    outside = {name: source for name, source in sources.items() if source.split("/")[0] not in MODEL_PACKAGES}
    assert not outside
    assert not {name: source for name, source in sources.items()
                if source in NOT_RUN_BY_THE_MODEL or source.endswith("/naive.py")}
    assert {"configuration_rotarium.py", "modeling_rotarium.py"} <= set(sources)


def test_modules_come_after_their_dependencies():
    order = module_order()
    for position, module in enumerate(order):
        # top-level imports point backwards (module_order refuses cycles, so lazy ones do too)
        tree = ast.parse(remote_code.module_path(module).read_text())
        eager = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
                 and n.module.startswith("rotarium.")}
        assert all(order.index(dep) < position for dep in eager), module
        assert set(dependencies(module)) <= set(order)


def test_bundle_is_self_contained(files):
    names = {p.name for p in files.glob("*.py")}
    assert names == set(bundle())
    for path in files.glob("*.py"):
        source = path.read_text()
        tree = ast.parse(source)
        # what transformers requires to be installed before it runs the file: never rotarium, fla or triton
        assert set(get_imports(path)) <= ALLOWED, path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] != "rotarium", (path.name, node.lineno)
        for rel in get_relative_imports(path):
            assert f"{rel}.py" in names, (path.name, rel)
        assert source.startswith("# Generated from rotarium/")


def _fla_imports(source: str) -> tuple[int, int, int]:
    """(fla imports, those inside a ``try``, those inside a ``try`` whose handler re-raises) of ``source``."""
    def count(nodes) -> int:
        return sum(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fla.") for n in nodes)

    tree = ast.parse(source)
    tried = reraised = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            found = count(n for stmt in node.body for n in ast.walk(stmt))
            tried += found
            if any(isinstance(s, ast.Raise) for h in node.handlers for s in h.body):
                reraised += found
    return count(ast.walk(tree)), tried, reraised


def test_optional_imports_are_wrapped_and_still_reached(files):
    total = 0
    for module in module_order():
        source, source_tried, _ = _fla_imports(remote_code.module_path(module).read_text())
        bundled, tried, reraised = _fla_imports((files / flat_name(module)).read_text())
        # every fla import is still there, inside a try (which transformers' check_imports skips) ...
        assert bundled == tried == source, module
        # ... and the ones the bundler wrapped re-raise: the fla path behaves exactly as in rotarium
        assert reraised >= source - source_tried, module
        total += source
    assert total > 0


def test_unsupported_import_forms_are_refused(tmp_path, monkeypatch):
    package = tmp_path / "rotarium"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.setattr(remote_code, "PACKAGE_DIR", package)
    for text, message in (("import rotarium.sub.mod\n", "cannot be bundled"),
                          ("from .sub import mod\n", "relative imports"),
                          ("from rotarium.sub import mod\n", "importing the module")):
        (package / "bad.py").write_text(text)
        with pytest.raises(ValueError, match=message):
            dependencies("rotarium.bad")
    (package / "good.py").write_text("def f():\n    from rotarium.sub.mod import X as Y\n    return Y\n")
    assert dependencies("rotarium.good") == ["rotarium.sub.mod"]
    assert "    from .rotarium_sub_mod import X as Y\n" in remote_code.rewrite("rotarium.good")
    assert flat_name("rotarium.models.modeling") == "modeling_rotarium.py"
