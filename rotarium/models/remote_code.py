"""Self-contained copies of rotarium's model code, for transformers' remote-code loader (``trust_remote_code=True``).

transformers copies a checkpoint's code files into its module cache and follows only same-folder relative imports
(``from .x import y``); before running a file it refuses one whose import statements name a package that is not
installed, skipping imports inside ``try`` blocks. So the bundle is generated, never written by hand:

- the modules the model needs are found by following rotarium's own import statements (eager and lazy) from
  :data:`ROOTS`, and listed dependencies first (:func:`module_order`). For the bundle to be what the model's forward and
  generate run and nothing else, the closure of those imports must hold only model code: the layers import each
  kernel from its own module (not the ops packages, which also gather the naive references), and the models are
  handed this bundler (``RotariumPreTrainedModel.code_writer``, set by :mod:`rotarium.models`) rather than import it;
- each module is copied flat into the folder (``rotarium.ops.gla.chunk`` -> ``rotarium_ops_gla_chunk.py``; the
  two entry points take transformers' usual names, :data:`ENTRY_FILES`), with ``from rotarium.a.b import x``
  rewritten to ``from .rotarium_a_b import x``;
- every import of an optional accelerator package (:data:`OPTIONAL_PACKAGES`: fla, triton) is wrapped in
  ``try: ... except ImportError: raise``: the statement and its behaviour stay the same (rotarium only reaches it
  after checking that fla works), but transformers no longer requires fla to load the model, so the code runs on
  CPU without fla and uses fla's kernels on CUDA where fla is installed.

Because the bundle is built from the library's source files at save time, an exported folder cannot drift from
the library that saved it. A model loaded from an exported folder saves without this module: transformers' own
``custom_object_save`` copies the code of remote-code models it loaded.
"""
from __future__ import annotations

import ast
import os
import warnings
from pathlib import Path
from typing import Any

from rotarium.utils.files import write_text_atomic

PACKAGE = "rotarium"
# What the exported model needs: the model classes and their configs.
ROOTS = ("rotarium.models.configuration", "rotarium.models.modeling")
ENTRY_FILES = {"rotarium.models.configuration": "configuration_rotarium.py",
               "rotarium.models.modeling": "modeling_rotarium.py"}
OPTIONAL_PACKAGES = ("fla", "triton")
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def flat_name(module: str) -> str:
    """The file name of ``module`` inside an exported folder."""
    return ENTRY_FILES.get(module, module.replace(".", "_") + ".py")


def module_path(module: str) -> Path:
    """The source file of a ``rotarium.*`` module (a package's ``__init__.py``)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise ValueError(f"{module!r} is not a {PACKAGE} module")
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no source file for module {module!r} under {PACKAGE_DIR}")


def _is_module(module: str) -> bool:
    try:
        module_path(module)
    except FileNotFoundError:
        return False
    return True


def _imports(module: str) -> list[ast.stmt]:
    """The import statements of ``module`` that name a rotarium module, at any depth (lazy imports included).

    Only the form ``from rotarium.a.b import name`` is bundled; the other forms would need transformers to follow
    more than same-folder ``from .x import y``, so they are refused here, where a library change would introduce
    them, rather than in a user's folder."""
    tree = ast.parse(module_path(module).read_text(encoding="utf-8"), filename=str(module_path(module)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(alias.name.split(".")[0] == PACKAGE for alias in node.names):
                raise ValueError(f"{module} line {node.lineno}: `import {PACKAGE}...` cannot be bundled; "
                                 f"use `from {PACKAGE}.x import name`")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ValueError(f"{module} line {node.lineno}: relative imports cannot be bundled; "
                                 f"use `from {PACKAGE}.x import name`")
            if node.module and node.module.split(".")[0] == PACKAGE:
                for alias in node.names:
                    if _is_module(f"{node.module}.{alias.name}"):
                        raise ValueError(f"{module} line {node.lineno}: importing the module "
                                         f"{node.module}.{alias.name} by name cannot be bundled; import names "
                                         "from it instead")
                found.append(node)
    return found


def dependencies(module: str) -> list[str]:
    """The rotarium modules ``module`` imports, in source order, without repeats."""
    return list(dict.fromkeys(node.module for node in _imports(module)))


def module_order(roots: tuple[str, ...] = ROOTS) -> tuple[str, ...]:
    """Every module reachable from ``roots``, each after the modules it imports.

    Raises ``ValueError`` on an import cycle, lazy imports included: rotarium's imports point one way
    (docs/design.md §6), and a checkpoint must not ship code that breaks it."""
    order: list[str] = []
    path: list[str] = []

    def visit(module: str) -> None:
        if module in order:
            return
        if module in path:
            cycle = " -> ".join(path[path.index(module):] + [module])
            raise ValueError(f"import cycle {cycle}: rotarium's imports must point one way to be bundled")
        path.append(module)
        for dep in dependencies(module):
            visit(dep)
        path.pop()
        order.append(module)

    for root in roots:
        visit(root)
    return tuple(order)


def _inside_try(tree: ast.Module) -> set[int]:
    """ids of the statements that sit inside the body of a ``try`` block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def rewrite(module: str) -> str:
    """The source of ``module`` as it goes into an exported folder."""
    path = module_path(module)
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    inside_try = _inside_try(tree)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line (1-based, inclusive), replacement)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        indent = " " * node.col_offset
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        rest = last[node.end_col_offset:].strip()
        if first[:node.col_offset].strip() or (rest and not rest.startswith("#")):
            raise ValueError(f"{path} line {node.lineno}: an import must stand alone on its line(s) to be bundled")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == PACKAGE:
            names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            relative = f"{indent}from .{flat_name(node.module)[:-3]} import {names}\n"
            edits.append((node.lineno, node.end_lineno, [relative]))
        else:
            top = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [(node.module or "").split(".")[0]]
            if any(t in OPTIONAL_PACKAGES for t in top) and id(node) not in inside_try:
                statement = [lines[i] for i in range(node.lineno - 1, node.end_lineno)]
                edits.append((node.lineno, node.end_lineno, [
                    f"{indent}try:  # optional package: hidden from transformers' check_imports, which skips try\n",
                    *[f"    {line}" if line.strip() else line for line in statement],
                    f"{indent}except ImportError:\n",
                    f"{indent}    raise\n",
                ]))
    for first, last, replacement in sorted(edits, reverse=True):
        lines[first - 1:last] = replacement
    rel = path.relative_to(PACKAGE_DIR.parent).as_posix()
    header = f"# Generated from {rel} by rotarium.models.remote_code when the checkpoint was saved; do not edit.\n"
    return header + "".join(lines)


def bundle(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """File name -> source of every file of the self-contained model code, dependencies first."""
    return {flat_name(module): rewrite(module) for module in module_order(roots)}


def auto_map(config_class: str, model_class: str, lm_class: str) -> dict[str, str]:
    """The ``auto_map`` of ``config.json`` pointing transformers' Auto classes at the bundled classes."""
    configuration, modeling = (ENTRY_FILES[root][:-3] for root in ROOTS)
    return {"AutoConfig": f"{configuration}.{config_class}", "AutoModel": f"{modeling}.{model_class}",
            "AutoModelForCausalLM": f"{modeling}.{lm_class}"}


def write_remote_code(folder: str | os.PathLike) -> list[Path]:
    """Writes the bundle into ``folder``; returns the files written."""
    written = []
    for name, text in bundle().items():
        write_text_atomic(Path(folder) / name, text)
        written.append(Path(folder) / name)
    return written


def prepare_save(config: Any, class_names: tuple[str, str, str], folder: str | os.PathLike) -> None:
    """Called by the models' ``save_pretrained`` before transformers writes the folder: sets ``config.auto_map``
    (so ``config.json`` carries it) and writes the code files, so that ``save_pretrained(..., push_to_hub=True)``
    and ``push_to_hub`` upload them too."""
    try:
        write_remote_code(folder)
    except (OSError, ValueError, SyntaxError) as error:
        # The weights matter more than the code: a training run must not lose a checkpoint to a bundling problem.
        # `rotarium export` bundles first and fails loudly instead.
        warnings.warn(f"saving without the self-contained model code (trust_remote_code loading will not work "
                      f"for this folder): {error}", stacklevel=3)
        return
    config.auto_map = auto_map(*class_names)

