"""Rules from a user's code, and what a rule's code is.

    ll.rules.load_rules("path/to/myrules.py")     # or "mypkg.rules"; several: a list, or "a.py,b.py" / "a.py;b.py"
    experiments/eval_gsm8k.py, sweep.py, analyze_dynamics.py --rules SOURCE    lm-eval: model_args rules=SOURCE

A source is a Python file (a path: it holds a '/' or ends in '.py') or the name of an importable module. Loading
runs it; the rules it registers (`@ll.register("name")`) are then known by name everywhere (specs, grids,
sweeps) like the built-in ones. Loading a file again runs it again only when its bytes changed, and its rules
are then replaced (a renamed rule's old name is forgotten); a name another source registered is refused. A
mistake (no such file or module, a module that fails to import, one that registers nothing) is one
`RulesError` line.

Installed packages offer rules through the entry point group `localleap_jax.rules` (in pyproject.toml:
`[project.entry-points."localleap_jax.rules"] steady = "mypkg.rules"`, or `"mypkg.rules:Steady"` for one object,
registered under the entry point's name when it does not register itself). They are loaded when a rule name is
not found: the entry point of that name first, then the others.

`code_identity(rule)`: what the rule's tokens depend on in code, for resume keys: a digest of the source of its
class or function, of the whole module that defines it (the bytes this process ran, for a file loaded here), of
the user's own modules that module uses (a helper beside it; not the standard library, installed packages or
this library), and of the library's version (the signals and helpers every rule reads); a combinator's covers
its sub-rules. Editing a rule's file changes the digest of every rule it defines, and of no other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import marshal
import re
import sys
import sysconfig
import traceback
import types
from pathlib import Path
from typing import Iterable

from localleap_jax.errors import RulesError, first_line
from localleap_jax.rules import registry

ENTRY_POINT_GROUP = "localleap_jax.rules"
FILE_MODULE_PREFIX = "localleap_jax_user_rules"  # the sys.modules name of a file loaded by path


@dataclasses.dataclass(frozen=True)
class Source:
    """A source loaded in this process: what was given (`text`, canonical: a resolved path or a module name),
    how (`kind`: "file", "module" or "entry point"), the module it became, the sha256 of the bytes that ran,
    and the rule names it registered."""

    text: str
    kind: str
    module: str
    digest: str
    names: tuple[str, ...]

    def to_json(self) -> dict:
        return {"source": self.text, "kind": self.kind, "digest": self.digest, "names": list(self.names)}


_LOADED: dict[str, Source] = {}  # by text
_BY_MODULE: dict[str, Source] = {}  # by module name
_TRIED_ENTRY_POINTS: set[tuple[str, str]] = set()


def split_sources(given: str | Iterable[str] | None) -> list[str]:
    """'a.py,b.py' / 'a.py;b.py' / ['a.py', 'b.py,c'] -> ['a.py', 'b.py', ...] (blanks dropped, each once)."""
    if given is None:
        return []
    pieces = [given] if isinstance(given, str) else list(given)
    out = [t.strip() for piece in pieces for t in re.split(r"[,;]", piece)]
    return list(dict.fromkeys(t for t in out if t))


def load_rules(given: str | Iterable[str]) -> list[str]:
    """Load each source (see the module's docstring); returns the rule names they registered, in order."""
    sources = split_sources(given)
    if not sources:
        raise RulesError("no file or module named (give path/to/rules.py or a module name such as mypkg.rules)")
    names: list[str] = []
    for text in sources:
        names += [n for n in load_source(text).names if n not in names]
    return names


def loaded_sources() -> list[Source]:
    return list(_LOADED.values())


def looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.endswith(".py") or text.startswith(("~", "."))


def load_source(text: str) -> Source:
    """One source: a file or a module, run (again, when a file's bytes changed) and its rules registered."""
    if looks_like_path(text):
        return _load_file(text)
    if not all(part.isidentifier() for part in text.split(".")):
        raise RulesError(f"{text!r} is neither a Python file (path/to/rules.py) nor a module name (mypkg.rules)")
    return _load_module(text)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _load_file(text: str) -> Source:
    path = Path(text).expanduser()
    if not path.exists():
        raise RulesError(f"{text}: no such file")
    if path.is_dir():
        raise RulesError(f"{text} is a directory: give a .py file, or a module name (mypkg.rules)")
    path = path.resolve()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RulesError(f"{text}: cannot read it ({e.strerror})") from None
    digest = _digest(data)
    old = _LOADED.get(str(path))
    if old is not None and old.digest == digest and old.module in sys.modules:
        return old
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"{FILE_MODULE_PREFIX}_{stem}_{_digest(str(path).encode())[:10]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)

    def run():
        sys.modules[module_name] = module  # before it runs: dataclasses look their module up there
        exec(compile(data, str(path), "exec"), module.__dict__)

    def undo():
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous

    names = _registering(text, module_name, run, path=str(path), undo=undo)
    return _record(Source(str(path), "file", module_name, digest, names))


def _load_module(name: str) -> Source:
    module = sys.modules.get(name)
    old = _LOADED.get(name)
    if module is not None:
        digest = module_digest(name)
        if old is not None and old.digest == digest:
            return old
        if old is None:  # imported before, not by this module (a wrapper, a notebook): its rules as they are
            if not _registered_by(name):
                raise RulesError(f"{name} registers no rule: decorate a rule class or function with "
                                 "@ll.register(\"name\")")
            return _record(Source(name, "module", name, digest, tuple(_registered_by(name))))
        # loaded here before and its file changed since: run it again
        names = _registering(name, name, lambda: importlib.reload(module), path=getattr(module, "__file__", None))
        return _record(Source(name, "module", name, module_digest(name), names))
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:  # a parent package that is missing or fails to import
        raise RulesError(f"{name}: no module named {name!r} ({first_line(e)}); give a path to a .py file, or a module "
                         "on sys.path") from None
    except Exception as e:  # noqa: BLE001 - a parent package's own import failed
        raise RulesError(f"{name}: importing it failed: {type(e).__name__}: {first_line(e)}") from None
    if found is None:
        raise RulesError(f"{name}: no module named {name!r}; give a path to a .py file, or a module on sys.path")
    names = _registering(name, name, lambda: importlib.import_module(name), path=found.origin)
    return _record(Source(name, "module", name, module_digest(name), names))


def _registered_by(module_name: str) -> list[str]:
    return [n for n, (module, _) in registry.ORIGINS.items()
            if module == module_name and dict.__contains__(registry.RULES, n)]


def _registering(text: str, module_name: str, run, path: str | None, undo=None) -> tuple[str, ...]:
    """Run a source with the registry listening: the names it registered (it must register one). Its earlier
    rules are forgotten first (so a renamed one does not linger) and put back if it fails."""
    before = {n: (dict.__getitem__(registry.RULES, n), registry.ORIGINS[n]) for n in _registered_by(module_name)}
    for n in before:
        registry.unregister(n)
    log: list[str] = []
    registry._LOGS.append(log)
    try:
        run()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code: any failure is reported in one line
        if undo is not None:
            undo()
        for n in set(log):
            registry.unregister(n)
        for n, (value, origin) in before.items():
            dict.__setitem__(registry.RULES, n, value)
            registry.ORIGINS[n] = origin
        raise RulesError(f"{text}: importing it failed{_where(e, path)}: {type(e).__name__}: {first_line(e)}") from None
    finally:
        registry._LOGS.remove(log)
    names = tuple(dict.fromkeys(log))
    if not names:
        raise RulesError(f"{text} registers no rule: decorate a rule class or function with @ll.register(\"name\")")
    return names


def _where(e: BaseException, path: str | None) -> str:
    """' (line N)' of the source's own line where the failure came from, when it is in the source."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f" (line {e.lineno})"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if path and f.filename == path]
    return f" (line {frames[-1].lineno})" if frames else ""


def _record(source: Source) -> Source:
    _LOADED[source.text] = source
    _BY_MODULE[source.module] = source
    return source


# ---------------------------------------------------------------- installed packages' entry points


def from_entry_points(name: str) -> bool:
    """Load the entry points of group `localleap_jax.rules` not tried yet (the one called `name` first); True when
    `name` is registered afterwards. A failing entry point called `name` is a RulesError; another one that fails
    is named in a note on stderr and skipped."""
    try:
        found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # noqa: BLE001 - a broken installation's metadata: no entry points
        return False
    for ep in sorted(found, key=lambda ep: ep.name != name):
        key = (ep.name, ep.value)
        if key in _TRIED_ENTRY_POINTS:
            continue
        _TRIED_ENTRY_POINTS.add(key)
        try:
            load_entry_point(ep)
        except RulesError as e:
            if ep.name == name:
                raise
            print(f"note: {e}; its rules are left out", file=sys.stderr)
        if dict.__contains__(registry.RULES, name):
            return True
    return False


registry.ON_MISS.append(from_entry_points)


def load_entry_point(ep) -> Source:
    dist = getattr(getattr(ep, "dist", None), "name", None)
    what = f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP}{f', package {dist}' if dist else ''})"
    module_name = ep.value.split(":")[0].strip()

    def run():
        obj = ep.load()
        if not isinstance(obj, types.ModuleType) and registry.origin_of(obj) not in registry.ORIGINS.values():
            registry.register(ep.name)(obj)  # a rule object the package did not register itself

    try:
        names = _registering(what, module_name, run, path=None)
    except RulesError as e:
        if "registers no rule" not in str(e) or not _registered_by(module_name):
            raise
        names = tuple(_registered_by(module_name))  # its module was imported before: its rules are there
    return _record(Source(ep.name, "entry point", module_name, module_digest(module_name), names))


# ---------------------------------------------------------------- what a rule's code is


def library_version() -> str:
    try:
        return importlib.metadata.version("localleap_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _code_bytes(obj) -> bytes:
    """Where no source can be read (a class typed into an interpreter): its functions' code and its fields."""
    parts = []
    if inspect.isclass(obj):
        for key, value in sorted(vars(obj).items()):
            value = getattr(value, "__func__", value)
            if isinstance(value, types.FunctionType):
                parts.append(key.encode() + marshal.dumps(value.__code__))
        if dataclasses.is_dataclass(obj):
            parts.append(repr([(f.name, f.default, f.metadata) for f in dataclasses.fields(obj)]).encode())
    elif isinstance(getattr(obj, "__code__", None), types.CodeType):
        parts.append(marshal.dumps(obj.__code__))
    else:
        parts.append(repr(obj).encode())
    return b"\0".join(parts)


def object_digest(obj) -> str:
    """sha256 of the source of a class or function (its code, where there is no source)."""
    try:
        return _digest(inspect.getsource(obj).encode())
    except (OSError, TypeError):
        return _digest(_code_bytes(obj))


def module_digest(module_name: str) -> str:
    """sha256 of the module's source: the bytes run here for a source loaded by this module, else its file now."""
    loaded = _BY_MODULE.get(module_name)
    module = sys.modules.get(module_name)
    if loaded is not None and loaded.kind == "file":
        return loaded.digest
    file = getattr(module, "__file__", None)
    if file:
        try:
            source = inspect.getsourcefile(module) or file
            return _digest(Path(source).read_bytes())
        except (OSError, TypeError):
            pass
    return "no source"


def _is_user_code(module_name: str) -> bool:
    """A module of the user's own (not this library, not the standard library or an installed package's files)."""
    if module_name.split(".")[0] == "localleap_jax":
        return False
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return False
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    path = str(Path(file).resolve())
    return not any(path.startswith(str(Path(root).resolve()) + "/") for root in installed)


def user_imports(module_name: str) -> list[str]:
    """The user's own modules a rule's module uses (a helper module beside it, a package of their own: what its
    globals hold or come from), transitively: an edit there changes the rule's code identity too."""
    seen, todo = set(), [module_name]
    while todo:
        module = sys.modules.get(todo.pop())
        for value in list(vars(module).values()) if module is not None else ():
            try:
                name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001 - an object whose attributes raise: nothing to follow
                continue
            if isinstance(name, str) and name != module_name and name not in seen and _is_user_code(name):
                seen.add(name)
                todo.append(name)
    return sorted(seen)


def _leaves(rule) -> list:
    """The classes and functions a rule object's code lives in (a combinator: its own class and its sub-rules')."""
    sub = getattr(rule, "rules", None)
    if isinstance(sub, tuple) and sub and all(callable(getattr(r, "update", None)) for r in sub):
        return [type(rule), *(leaf for r in sub for leaf in _leaves(r))]
    if isinstance(rule, registry.FunctionRule):
        return [rule.fn]
    return [rule if inspect.isclass(rule) else type(rule)]


def code_identity(rule) -> dict:
    """{"code": sha256 of what the rule's tokens depend on in code, "defined_in": ["module:qualname", ...] (a file
    loaded by path: the file), "library": this library's version}. See the module's docstring."""
    parts, where = [], []
    for obj in _leaves(rule):
        module, qualname = registry.origin_of(obj)
        loaded = _BY_MODULE.get(module)
        from_file = loaded is not None and loaded.kind == "file"
        where.append(f"{loaded.text if from_file else module}:{qualname}")
        # A file loaded here: the bytes it ran hold the object's source (the file on disk may have changed since).
        source = "in the module" if from_file else object_digest(obj)
        parts.append({"object": f"{module}:{qualname}", "source": source, "module": module_digest(module),
                      "imports": {m: module_digest(m) for m in user_imports(module)}})
    version = library_version()
    h = hashlib.sha256(repr((version, parts)).encode())
    return {"code": h.hexdigest(), "defined_in": where, "library": version}


def code_digest(rule) -> str:
    return code_identity(rule)["code"]


# ---------------------------------------------------------------- other processes (dist.multihost)


def sources_of(rule) -> list[dict]:
    """The loaded sources a rule's code comes from (none for the built-in rules), as JSON: what another process
    loads to rebuild it (`ensure_sources`)."""
    out = []
    for obj in _leaves(rule):
        module = registry.origin_of(obj)[0]
        source = _BY_MODULE.get(module)
        if source is not None:
            item = source.to_json()
        elif module.split(".")[0] == "localleap_jax" or module == "__main__" or module not in sys.modules:
            continue  # built in (the same library on every host), or nowhere another process could import it from
        else:  # a module imported some other way (a wrapper script): the other processes import it by name
            item = {"source": module, "kind": "module", "digest": module_digest(module),
                    "names": _registered_by(module)}
        if item not in out:
            out.append(item)
    return out


def ensure_sources(wanted: list[dict]) -> None:
    """Load each source another process used (`sources_of`) unless this process already runs the same bytes;
    a RulesError when they differ here (each host needs the same file or module)."""
    for item in wanted:
        have = _LOADED.get(item["source"])
        if have is None or have.digest != item["digest"]:
            if item["kind"] == "entry point":
                eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                       if ep.name == item["source"]]
                if not eps:
                    raise RulesError(f"entry point {item['source']} (group {ENTRY_POINT_GROUP}) is not installed here")
                have = load_entry_point(eps[0])
            else:
                have = load_source(item["source"])
        if have.digest != item["digest"]:
            raise RulesError(f"the rules in {item['source']} differ from process 0's (sha256 {have.digest[:12]} here, "
                             f"{item['digest'][:12]} there): every host needs the same file")


__all__ = ["ENTRY_POINT_GROUP", "RulesError", "Source", "code_digest", "code_identity", "ensure_sources",
           "from_entry_points", "library_version", "load_rules", "load_source", "loaded_sources", "module_digest",
           "object_digest", "sources_of", "split_sources"]
