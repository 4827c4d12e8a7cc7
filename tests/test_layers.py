"""The layering of the source tree (issue #22): every import, module-level or inside a function, goes down the
declared layer order or sideways within a layer, never up, and no set of modules imports itself in a circle.
Also the size limits a reader relies on: no source file over 450 lines, no function over 60 lines (tests aside).

The walk reads the files with ``ast`` (nothing is imported). ``train/`` and ``serve/`` install as
``medusa_lite.train`` and ``medusa_lite.serve`` (pyproject's package-dir mapping) and are walked under those names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"medusa_lite": ROOT / "medusa_lite", "medusa_lite.train": ROOT / "train", "medusa_lite.serve": ROOT / "serve"}

# Bottom first; a module may import modules of its own layer or of the layers below it. A name stands for the module
# or package of that name and everything under it (the longest match decides).
LAYERS: list[tuple[str, ...]] = [
    ("medusa_lite._version", "medusa_lite._hf", "medusa_lite.paths", "medusa_lite.machine",  # leaves
     "medusa_lite.specbench"),
    ("medusa_lite.tree",),
    ("medusa_lite.attention",),
    ("medusa_lite.verify", "medusa_lite.sampling", "medusa_lite.kernels", "medusa_lite.constraints"),
    ("medusa_lite.kv",),
    ("medusa_lite.config",),
    ("medusa_lite.drafters",),
    ("medusa_lite.decode",),
    ("medusa_lite.fit",),
    ("medusa_lite.calibrate",),
    ("medusa_lite.heads_io", "medusa_lite.model", "medusa_lite.targets"),
    ("medusa_lite.settings", "medusa_lite.cli"),
    ("medusa_lite",),                                    # the package's facade (__init__)
    ("medusa_lite.train", "medusa_lite.serve"),          # the scripts, on top of the library
]
EXACT = {"medusa_lite"}  # names that stand for that module alone (the facade is not its subpackages' layer)

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import's base (``from ..x import y`` in ``module``)."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (functions included)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                hit = known(target)
                if hit is not None and hit != module:
                    edges[module].add(hit)
    return edges


def layer_of(module: str) -> int:
    best, index = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            covers = module == name or (module.startswith(name + ".") and name not in EXACT)
            if covers and len(name) > best:
                best, index = len(name), i
    if index is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: declare where it belongs")
    return index


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return imports(_modules())


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_import_goes_up(graph):
    assert upward(graph) == set(), "imports that go up the layer order"


def test_no_import_circles(graph):
    assert circles(graph) == [], "import circles"


def test_the_layer_test_sees_an_upward_import():
    edges = {"medusa_lite.tree": {"medusa_lite.model"}, "medusa_lite.model": set()}
    assert upward(edges) == {("medusa_lite.tree", "medusa_lite.model")}


def test_the_walk_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from . import a\n")
    modules = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py"}
    assert circles(imports(modules)) == [["p.a", "p.b"]]


def _long_functions(path: Path, name: str) -> dict[str, int]:
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[f"{name}:{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return out


def test_files_and_functions_a_reader_can_hold():
    long_files, long_functions = [], []
    for path in _modules().values():
        rel = str(path.relative_to(ROOT))
        if len(path.read_text().splitlines()) > MAX_FILE_LINES:
            long_files.append(rel)
        long_functions += [key for key, length in _long_functions(path, rel).items() if length > MAX_FUNCTION_LINES]
    assert long_files == [], f"files over {MAX_FILE_LINES} lines"
    assert long_functions == [], f"functions over {MAX_FUNCTION_LINES} lines"


# ------------------------------------------------------------------ one descent per generate() call
def _package(module: str) -> str:
    """The unit a call path is checked at: ``medusa_lite.decode.batch`` -> ``medusa_lite.decode``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _call_paths(run) -> set[tuple[str, ...]]:
    """Every distinct stack of medusa_lite packages (outermost first, repeats of one package collapsed, frames of
    other libraries skipped) seen while ``run()`` executes."""
    import sys

    paths: set[tuple[str, ...]] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        stack, f = [], frame
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name.startswith("medusa_lite") and (not stack or stack[-1] != _package(name)):
                stack.append(_package(name))
            f = f.f_back
        paths.add(tuple(reversed(stack)))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return paths


def test_a_generate_call_descends_without_returning_to_a_package_it_left(tmp_path, monkeypatch):
    """``generate`` calls visit each package once on the way down: the first one fits this machine (the probe), the
    next ones decode with fitted plans whose guards move every step, batch-1 and batched rows, greedy and sampling.
    Neither the loop nor the fit calls back into a package above it (the facade, the fit)."""
    import torch
    from test_fit import ADAPTIVE_TREES, _hydra_model, restless_fit

    from medusa_lite.fit import CyclingGuard

    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = _hydra_model()
    prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))

    def run():
        model.generate(prompt, max_new_tokens=12, do_sample=False)  # fits (probes) first
        for sample in (False, True):
            model.use_fit(restless_fit(ADAPTIVE_TREES), sample=sample, guard=CyclingGuard)
        model.generate(prompt, max_new_tokens=12, do_sample=False)
        model.generate(prompt, max_new_tokens=12, do_sample=True, num_return_sequences=3)

    paths = _call_paths(run)
    assert any(p[:3] == ("medusa_lite.model", "medusa_lite.decode", "medusa_lite.drafters") for p in paths)  # the loop
    assert any(p[:3] == ("medusa_lite.model", "medusa_lite.fit", "medusa_lite.decode") for p in paths)  # the probe
    returns = sorted(p for p in paths if len(set(p)) < len(p))
    assert not returns, f"call paths that return to a package they left: {returns[:5]}"


# ------------------------------------------------------------------ no object passed up and held
HIGHER_OBJECT_PARAMS = {"model"}  # what a MedusaModel is called where it is passed around


def _classes(modules: dict[str, Path]) -> dict[str, set[str]]:
    """class name -> the project modules that define a class of that name (top level)."""
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, set()).add(module)
    return found


def _annotation_names(node) -> set[str]:
    """The names an annotation mentions, those of string (forward) annotations included."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                names |= _annotation_names(ast.parse(n.value, mode="eval"))
            except SyntaxError:
                pass
    return names


def _annotations(tree: ast.AST):
    """(line, annotation) of every parameter, return and annotated assignment (``self.x: T`` included)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                if arg.annotation is not None:
                    yield arg.lineno, arg.annotation
            if node.returns is not None:
                yield node.lineno, node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.lineno, node.annotation


def held_upward(modules: dict[str, Path]) -> list[str]:
    """Where a module annotates a parameter or attribute with a class only a higher layer defines, or a constructor
    below the facade's layer takes a model (a parameter of :data:`HIGHER_OBJECT_PARAMS`) to keep."""
    classes, model_layer, out = _classes(modules), layer_of("medusa_lite.model"), []
    for module, path in modules.items():
        tree, layer = ast.parse(path.read_text()), layer_of(module)
        for line, annotation in _annotations(tree):
            for name in _annotation_names(annotation):
                owners = classes.get(name, set())
                if owners and min(layer_of(m) for m in owners) > layer:
                    out.append(f"{module}:{line} annotated with {name} of {sorted(owners)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__" and layer < model_layer:
                taken = {a.arg for a in node.args.args + node.args.kwonlyargs} & HIGHER_OBJECT_PARAMS
                out += [f"{module}:{node.lineno} __init__ takes {name}" for name in sorted(taken)]
    return out


def test_no_lower_layer_names_a_higher_layers_class_or_keeps_a_model():
    assert held_upward(_modules()) == [], "objects passed up the layer order to be kept"


def test_the_layer_test_sees_a_model_kept_below(tmp_path):
    (tmp_path / "session.py").write_text("class S:\n    def __init__(self, model):\n        self.model = model\n"
                                         "    owner: 'MedusaModel'\n")
    (tmp_path / "model.py").write_text("class MedusaModel:\n    pass\n")
    found = held_upward({"medusa_lite.fit.session": tmp_path / "session.py", "medusa_lite.model": tmp_path / "model.py"})
    assert len(found) == 2 and "takes model" in found[1] and "MedusaModel" in found[0]


def _reaches(root, kind, limit: int = 200_000) -> bool:
    """Whether an instance of ``kind`` is reachable from ``root`` through attributes, slots, containers and
    closures (tensors are leaves)."""
    import torch

    seen, todo = set(), [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type, torch.Tensor)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            return True
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        todo += list(getattr(obj, "__dict__", {}).values())
        todo += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ()) if isinstance(s, str)]
        todo += [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if c.cell_contents is not None]
        todo += [getattr(obj, "__self__", None)]
    return False


def test_a_fit_and_the_decoder_hold_no_model(tmp_path, monkeypatch):
    """The fit is a value (:func:`medusa_lite.fit.fit_machine`): neither it, the state a model keeps with it, nor
    the decoder a model hands to the loop reaches back to the model."""
    import torch
    from test_fit import _hydra_model

    from medusa_lite import MedusaModel
    from medusa_lite.fit import fit_machine

    monkeypatch.setenv("MEDUSA_LITE_CACHE", str(tmp_path))
    model = _hydra_model()
    fit = fit_machine(model.base_model, model.drafter, model.config, model.acceptance, progress=False)
    assert fit is not None and not _reaches(fit, MedusaModel)
    model.generate(torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0)), max_new_tokens=6)
    assert model.fits and not _reaches(list(model.fits.values()), MedusaModel)
    assert not _reaches(model.decoder(), MedusaModel)
    assert _reaches([{"x": (model.drafter, model)}], MedusaModel)  # the walk finds one where there is one


# ------------------------------------------------------------------ no forwarding-only methods on the facade
def forwarding(path: Path, class_name: str) -> list[str]:
    """The methods of ``class_name`` whose whole body (docstring aside) is one call of a method of one of its
    attributes (``return self.x.f(...)``, ``self.x.f(...)``): what a caller could call on ``self.x`` itself."""
    out = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(cls, ast.ClassDef) and cls.name == class_name):
            continue
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
            if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
                continue
            call = body[0].value
            func = call.func if isinstance(call, ast.Call) else None
            owner = func.value if isinstance(func, ast.Attribute) else None
            while isinstance(owner, ast.Attribute) and not (isinstance(owner.value, ast.Name)
                                                            and owner.value.id == "self"):
                owner = owner.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                out.append(fn.name)
    return out


def test_medusa_model_has_no_method_that_only_forwards():
    assert forwarding(ROOT / "medusa_lite" / "model.py", "MedusaModel") == []


def test_the_forwarding_check_sees_one(tmp_path):
    (tmp_path / "m.py").write_text("class M:\n    def f(self, x):\n        '''doc'''\n        return self.s.f(x)\n"
                                   "    def g(self):\n        self.s.t.g()\n    def h(self):\n        return self.k()\n")
    assert forwarding(tmp_path / "m.py", "M") == ["f", "g"]


# ------------------------------------------------------------------ the drafter's runtime contract
def drafter_uses(modules: dict[str, Path], packages: tuple[str, ...]) -> set[str]:
    """The attributes used of anything called ``drafter`` (``drafter.x``, ``self.drafter.x``, ``model.drafter.x``)
    in the modules of ``packages``."""
    used = set()
    for module, path in modules.items():
        if not any(module == p or module.startswith(p + ".") for p in packages):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            owner = node.value if isinstance(node, ast.Attribute) else None
            if (isinstance(owner, ast.Name) and owner.id == "drafter") or (isinstance(owner, ast.Attribute)
                                                                           and owner.attr == "drafter"):
                used.add(node.attr)
    return used


def test_decoding_and_the_fit_use_only_the_drafters_runtime_contract():
    from medusa_lite.drafters import DRAFTERS, RUNTIME, DraftRuntime

    members = {n for n in vars(DraftRuntime) if not n.startswith("_")} | set(DraftRuntime.__annotations__)
    assert members == set(RUNTIME) and len(RUNTIME) <= 8
    assert drafter_uses(_modules(), ("medusa_lite.decode", "medusa_lite.fit")) <= set(RUNTIME)
    for name, cls in DRAFTERS.items():
        assert all(hasattr(cls, member) for member in RUNTIME), name
