"""The library's layers (../shared/DESIGN.md, "Layers"), read from every import with `ast`: module-level and
function-local imports, relative ones resolved. No import cycle; each module imports only layers below its
own (or its own package); the core never imports a distribution module; checkpoint reading imports neither
the converter nor a runner; nothing in the library imports `convert/`, `experiments/` or the test oracles.

The checker runs on the package itself and on small packages built here that break each rule, so a rule it
stopped enforcing would fail here too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

# Each top-level module or subpackage of localleap_jax, by layer (lowest first). A module may import modules
# of lower layers and of its own package; leaves import nothing of the package but the base helpers.
LAYERS = {
    "base": {"errors", "hashing"},
    "leaves": {"config", "tokenizer", "trace", "rules", "compile_cache", "processes", "partition", "synthetic_math",
               "cli", "attention", "hlo_bytes"},
    "core": {"model", "families", "denoiser", "loaded", "decode", "dynamics", "likelihood", "moe"},
    "storage": {"checkpoint"},
    "conversion": {"convert_hf", "resolve"},
    "distribution": {"dist"},
    "front door": {"api", ""},  # "": the package face, localleap_jax/__init__.py
    "adapters": {"lm_eval", "gsm8k"},
    "commands": {"commands", "plan"},  # (plan: `python -m localleap_jax.plan`, the command's entry)  # each command line's logic (experiments/<name>.py is its entry); nothing imports it
}
LAYER_RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
RANK = {unit: LAYER_RANK[layer] for layer, units in LAYERS.items() for unit in units}
LEAF_EXCEPTIONS: set[tuple[str, str]] = set()
DISTRIBUTION_LEAVES = {"partition", "processes"}  # leaves the core must not import all the same


def module_name(root: Path, path: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def imports_of(path: Path, name: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in a file, function-local ones included."""
    tree = ast.parse(path.read_text(), str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (here[:len(here) - node.level + 1] if node.level else []) + ([node.module] if node.module else [])
            module = ".".join(base)
            out.append((module, node.lineno))
            out += [(f"{module}.{a.name}", node.lineno) for a in node.names]  # `from pkg import submodule`
    return out


def unit_of(module: str, package: str) -> str:
    """The layer unit of a package module: its top-level name under the package ('' for the face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def check(root: Path, package: str = "localleap_jax", outside: set[str] = frozenset()) -> list[str]:
    """Every broken layer rule in the package at `root`, as one line each (empty: all hold). `outside`:
    top-level names the library must never import (the command-line directories and their modules)."""
    files = sorted(p for p in root.rglob("*.py") if "assets" not in p.parts)
    modules = {module_name(root, p, package): p for p in files}
    problems, graph = [], {}
    for name, path in modules.items():
        deps = set()
        for imported, line in imports_of(path, name):
            top = imported.split(".")[0]
            where = f"{path.relative_to(root.parent)}:{line}"
            if top in outside:
                problems.append(f"{where}: the library imports {top} (a command line, above every layer)")
                continue
            if top != package:
                continue
            parts = imported.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules),
                          None)
            if target is None or target == name:
                continue
            deps.add(target)
            a, b = unit_of(name, package), unit_of(target, package)
            if a == b or target == package:  # within a package (or the face, which only re-exports)
                continue
            if b not in RANK or a not in RANK:
                problems.append(f"{where}: {b or a!r} is in no layer (add it to LAYERS)")
            elif a in LAYERS["leaves"] and RANK[b] >= RANK[a] and (a, b) not in LEAF_EXCEPTIONS:
                problems.append(f"{where}: the leaf {a} imports {b}")
            elif a in LAYERS["core"] and (b in DISTRIBUTION_LEAVES or RANK[b] >= LAYER_RANK["distribution"]):
                problems.append(f"{where}: the core ({a}) imports distribution ({b})")
            elif a == "checkpoint" and (b == "processes" or RANK[b] > RANK[a]):
                problems.append(f"{where}: checkpoint reading imports {b}")
            elif RANK[b] > RANK[a]:
                problems.append(f"{where}: {a} ({_layer(a)}) imports {b} ({_layer(b)}), a layer above it")
        graph[name] = deps
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return list(dict.fromkeys(problems))  # `from a import b` names a twice: one line each


def _layer(unit: str) -> str:
    return next(layer for layer, units in LAYERS.items() if unit in units)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module). A package's __init__
    importing its own submodules is not a cycle of layers: those edges are left out."""
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def command_line_names() -> set[str]:
    """`convert`, `experiments`, `oracles` (the tests' independent references, never installed) and every module
    of experiments/ (scripts put that directory on sys.path)."""
    return {"convert", "experiments", "oracles", *(p.stem for p in (REPO / "experiments").glob("*.py"))}


def test_the_library_keeps_its_layers():
    problems = check(REPO / "localleap_jax", outside=command_line_names())
    assert not problems, "\n".join(problems)


def test_every_module_of_the_library_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in (REPO / "localleap_jax").iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units - set(RANK) == set()


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "localleap_jax"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("files, wanted", [
    ({"config.py": "", "model.py": "from localleap_jax.config import X\n"}, None),  # a clean package
    ({"decode.py": "def f():\n    from localleap_jax.dist import mesh\n", "dist/__init__.py": "",
      "dist/mesh.py": "from localleap_jax.decode import f\n"}, "the core (decode) imports distribution (dist)"),
    ({"decode.py": "from localleap_jax import partition\n", "partition.py": ""}, "the core (decode) imports distribution"),
    ({"checkpoint.py": "from localleap_jax.convert_hf import c\n", "convert_hf.py": "from .checkpoint import x\n"},
     "checkpoint reading imports convert_hf"),
    ({"checkpoint.py": "import localleap_jax.processes\n", "processes.py": ""}, "checkpoint reading imports processes"),
    ({"model.py": "from . import denoiser\n", "denoiser.py": "from .model import m\n"}, "import cycle"),
    ({"rules/__init__.py": "from localleap_jax.rules.base import B\n", "rules/base.py": "import localleap_jax.trace\n",
      "trace.py": ""}, "the leaf rules imports trace"),
    ({"api.py": "import eval_gsm8k\n"}, "the library imports eval_gsm8k"),
    ({"config.py": "from oracles import rules\n"}, "the library imports oracles"),
    ({"convert_hf.py": "from localleap_jax.api import load\n", "api.py": ""}, "a layer above it"),
])
def test_the_checker_catches_each_broken_rule(tmp_path, files, wanted):
    problems = check(_package(tmp_path, files), outside={"eval_gsm8k", "oracles"})
    if wanted is None:
        assert problems == []
    else:
        assert any(wanted in p for p in problems), problems


TORCH_FREE = r"""
import importlib, pkgutil, sys
sys.modules["torch"] = None  # `import torch` raises ImportError; find_spec("torch") says it is absent
import localleap_jax
names = [m.name for m in pkgutil.walk_packages(localleap_jax.__path__, "localleap_jax.")
         if not m.name.startswith("localleap_jax.lm_eval")]  # lm-eval itself needs torch
for name in names:
    importlib.import_module(name)
assert "torch" not in {k for k, v in sys.modules.items() if v is not None}
print(len(names))
"""


def test_the_library_imports_without_torch():
    """`import localleap_jax` and every module under it, the lm-eval adapter aside, with torch unimportable (it is
    only in the test extra). Fails when any library module imports torch, even inside a function run at import."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) > 40  # every module was imported, not an empty walk


def test_the_package_namespace_shows_its_public_names_only():
    """Issue #47: dir(ll) listed `annotations`, `importlib` and `TYPE_CHECKING` (and every submodule imported so
    far). It shows __all__: the public names and the two documented submodules; each submodule stays reachable."""
    import localleap_jax as ll

    ll.generate, ll.rules.RuleBase, ll.tokenizer  # noqa: B018 - load some, as a session would
    assert dir(ll) == sorted(ll.__all__)
    assert {"generate", "load", "DecodeConfig", "rule", "LocalLeapError", "rules", "checkpoint"} <= set(dir(ll))
    assert not {"annotations", "importlib", "TYPE_CHECKING", "api", "tokenizer"} & set(dir(ll))
    assert all(hasattr(ll, name) for name in ll.__all__)
    with pytest.raises(AttributeError):
        ll.annotations  # noqa: B018
