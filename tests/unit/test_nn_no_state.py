"""The layer library holds no module-level mutable state (DESIGN.md: layers are pure function pairs, precision is
passed, not global): no module of hpengine/nn rebinds a name through `global`, and none mutates a module-level
dict, list or set from a function. Constant lookup tables, read only, are fine. Checked on the source with ast.
"""
from __future__ import annotations

import ast
from pathlib import Path

import hpengine.nn

NN = Path(hpengine.nn.__file__).parent
CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
            "remove", "sort", "reverse", "appendleft", "popleft", "extendleft", "rotate"}


def _mutable(value) -> bool:
    if isinstance(value, CONTAINERS):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) in FACTORIES
    return False


def _module_containers(tree) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _mutable(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _mutable(node.value) and \
                isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _root_name(node):
    """The name an expression like a[i].b[j] starts from."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str, filename: str = "<nn>") -> list[str]:
    """Where source keeps module-level mutable state: a `global` statement, or a function that mutates a
    module-level container (a mutating method call, an item or attribute store or delete, an augmented
    assignment into it)."""
    tree = ast.parse(source, filename)
    shared = _module_containers(tree)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            where = f"{filename}:{getattr(node, 'lineno', fn.lineno)}"
            if isinstance(node, ast.Global):
                found.append(f"{where} global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in MUTATORS and _root_name(node.func.value) in shared:
                found.append(f"{where} {_root_name(node.func.value)}.{node.func.attr}()")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and _root_name(t) in shared:
                        found.append(f"{where} {_root_name(t)}[...] written")
    return found


def test_nn_modules_hold_no_mutable_state():
    files = sorted(NN.glob("*.py"))
    assert len(files) > 10
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert not found, "module-level mutable state in hpengine/nn:\n" + "\n".join(found)


def test_the_check_catches_a_module_switch_and_registry():
    # the shapes a global precision switch takes: a dict updated in place, a registry written by item, a
    # rebinding through global; a read-only table passes
    switch = '_STATE = {"on": False}\ndef operands(on):\n    _STATE.update(on=on)\n'
    registry = '_HELD: dict = {}\ndef hold(p, v):\n    _HELD[p] = v\ndef drop(p):\n    del _HELD[p]\n'
    rebound = '_ON = False\ndef switch(on):\n    global _ON\n    _ON = on\n'
    table = 'TILES = {"f32": (32, 4)}\ndef tile(s):\n    return TILES[s]\n'
    assert len(violations(switch)) == 1 and len(violations(registry)) == 2 and len(violations(rebound)) == 1
    assert violations(table) == []
