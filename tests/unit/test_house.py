"""The house's rules that import-linter does not check: no function-local import of an hpengine module (a
late import hides a circle), late imports only for the optional dependencies, and no subpackage attribute
that shadows one of its modules."""
from __future__ import annotations

import ast
from pathlib import Path

import hpengine

PKG = Path(hpengine.__file__).parent
OPTIONAL = {"cupy", "cupyx", "cupy_backends", "matplotlib", "torch", "transformers", "safetensors", "tokenizers",
            "ml_dtypes", "tqdm"}


def _late_imports(path: Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    yield node.lineno, ("." * node.level) + (node.module or "")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        yield node.lineno, a.name


def test_no_function_local_import_of_hpengine_or_a_required_dependency():
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {mod} inside a function"
           for p in sorted(PKG.rglob("*.py")) for line, mod in _late_imports(p)
           if mod.startswith((".", "hpengine")) or mod.split(".")[0] not in OPTIONAL]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_late_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from hpengine.config import load_config\n    import cupy\n")
    assert [m for _, m in _late_imports(f)] == ["hpengine.config", "cupy"]


def test_no_package_export_shadows_one_of_its_modules():
    """`from hpengine.planner import search` must give the module whatever was imported before it."""
    shadowed = []
    for init in sorted(PKG.glob("**/__init__.py")):
        names = {n.value for node in ast.parse(init.read_text()).body if isinstance(node, ast.Assign)
                 and any(getattr(tg, "id", "") == "__all__" for tg in node.targets) for n in node.value.elts}
        subs = {p.stem for p in init.parent.glob("*.py")} | {p.parent.name for p in init.parent.glob("*/__init__.py")}
        shadowed += [f"{init.parent.name}.{n}" for n in names & subs]
    assert not shadowed


def test_every_subpackage_says_what_it_owns():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and 2 <= len(doc.splitlines()) <= 5, f"{init}: a 2-5 line docstring naming what it owns"


def _module_docstring_lines(path: Path) -> int:
    """Lines from the opening to the closing quotes of the module docstring, inclusive; 0 when there is none."""
    body = ast.parse(path.read_text()).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def test_every_module_docstring_is_two_to_five_lines():
    """A module docstring says what the file owns; longer reasoning lives next to the code it explains."""
    bad = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
           if not 2 <= (n := _module_docstring_lines(p)) <= 5]
    assert not bad, "module docstrings must be 2-5 lines:\n" + "\n".join(bad)


def test_the_docstring_count_includes_the_quote_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""One.\nTwo.\n"""\nx = 1\n')
    assert _module_docstring_lines(f) == 3
    f.write_text("x = 1\n")
    assert _module_docstring_lines(f) == 0
