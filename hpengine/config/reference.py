"""docs/configuration.md, generated from the config tree's field docs: one table per section with each key,
its default and its doc (`make docs` writes it; tests/unit/test_readme.py checks the committed file is this
text)."""
from __future__ import annotations

import dataclasses
import functools

from hpengine.config.fields import is_section, show, table_item, toml_key, type_hints
from hpengine.config.load import Config

REFERENCE_FILE = "docs/configuration.md"


def describe() -> str:
    """The markdown config reference, docs/configuration.md: one table per section with key, default and doc
    (`make docs` writes it; tests/unit/test_readme.py checks that the committed file is this text)."""
    lines = ["# Configuration reference", "",
             f"Generated from the field docs of `hpengine/config/tree.py` by `make docs` (`hpengine config "
             f"--reference > {REFERENCE_FILE}`): edit the docs there and regenerate, never this file.", "",
             "Every key is optional; `--set section.key=value` overrides any of them (the value is TOML: "
             "`--set optim.betas=[0.9,0.99]`). `hpengine config CONFIG` prints a config with every key resolved; "
             "`hpengine config CONFIG --world N` also checks it for N ranks and prints the layout.", "",
             "## Sections"]
    for path, cls in _sections(Config, []):
        header = f"[[{'.'.join(path)}]]" if _is_array(path) else f"[{'.'.join(path)}]"
        lines += ["", f"### `{header}`", "", cls.__doc__.strip().splitlines()[0], "",
                  "| key | default | doc |", "|---|---|---|"]
        defaults = cls()
        for f in dataclasses.fields(cls):
            if is_section(type_hints(cls)[f.name]):      # a table inside a section ([model.moe]) has its own
                continue
            doc = f.metadata["doc"]
            if "choices" in f.metadata:
                doc += "; one of " + ", ".join(f"`{show(c)}`" for c in f.metadata["choices"])
            doc = doc.replace("|", "\\|")
            lines.append(f"| `{toml_key(f)}` | `{show(getattr(defaults, f.name))}` | {doc} |")
    return "\n".join(lines) + "\n"


def _is_array(path: list[str]) -> bool:
    cls = functools.reduce(lambda c, part: type_hints(c)[part], path[:-1], Config)
    return table_item(type_hints(cls)[path[-1]]) is not None


def _sections(cls, path: list[str]) -> list[tuple[list[str], type]]:
    """(path, dataclass) for every section that holds values, in file order; an array of tables
    ([[data.sources]]) follows the section that holds it."""
    out = []
    for f in dataclasses.fields(cls):
        tp = type_hints(cls)[f.name]
        if table_item(tp) is not None:
            out.append((path + [f.name], table_item(tp)))
        elif is_section(tp):
            sub = path + [f.name]
            holds_values = any(not is_section(t) for t in type_hints(tp).values())
            out += ([(sub, tp)] if holds_values else []) + _sections(tp, sub)
    return out
