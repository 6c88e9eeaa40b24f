"""The README stays a newcomer's page and docs/ holds the rest: the two commands first, a short README whose
docs map names every guide, links and file paths that resolve inside the repository, and a generated
configuration reference that is current and documents every key in its own section."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpengine.config import fields as F
from hpengine.config import load as C
from hpengine.config import reference as R

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
REFERENCE = ROOT / R.REFERENCE_FILE

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")                  # [text](target), images excluded
CODE_PATH = re.compile(r"`((?:hpengine|tests|benchmarks|configs|jobs|kernels|docs|mpirun_examples|clusters)/"
                       r"[\w./-]+\.(?:py|md|toml|cu|sh|sbatch|pbs|json))(?:::\w+)?`")
ROOMS = "|".join(p.name for p in (ROOT / "hpengine").iterdir() if (p / "__init__.py").exists())
ROOM_PATH = re.compile(rf"`((?:{ROOMS})/[\w./-]+\.py)(?:: \w+)?`")      # relative to hpengine/: `nn/gemm.py`


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_what_it_is_and_the_two_commands_with_their_durations_come_first():
    text = README.read_text()
    before, first_block = text.split("```")[:2]
    assert "is an MPI training engine" in before, "the README's opening says what hpengine is"
    for command in ("make train", "make test"):
        line = next(line for line in first_block.splitlines() if line.startswith(command))
        assert re.search(r"about [\d-]+ minutes on 2 cores", line), line
    # the durations are measured: a dated section of docs/benchmarks.md, which the README links
    assert "docs/benchmarks.md#the-two-commands" in text
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    section = bench[bench.index("\n## The two commands\n"):].split("\n## ")[1]
    assert re.search(r"20\d\d-\d\d-\d\d", section) and "`make train`" in section and "`make test`" in section


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move the detail into docs/"


def test_readme_docs_map_lists_every_guide():
    text = README.read_text()
    mapped = {t.split("#")[0] for t in LINK.findall(text[text.index("## Documentation"):])}
    missing = [_rel(d) for d in DOCS if _rel(d) not in mapped]
    assert not missing, f"README's docs map leaves out {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):    # http(s), mailto; an anchor on this page
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, f"{_rel(page)}: links that do not resolve to a file in the repository: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_file_paths_in_code_exist(page):
    """A path such as `hpengine/run/train.py` (or `run/train.py`, inside the package) names a file that exists:
    the package moves, the docs follow."""
    text = page.read_text()
    missing = sorted({p for p in CODE_PATH.findall(text) if not (ROOT / p).exists()} |
                     {p for p in ROOM_PATH.findall(text) if not (ROOT / "hpengine" / p).exists()})
    assert not missing, f"{_rel(page)} names files that do not exist: {missing}"


def test_configuration_reference_is_current():
    assert REFERENCE.read_text() == R.describe(), (
        f"{R.REFERENCE_FILE} is out of date: regenerate it with `make docs`")


def _reference_sections() -> dict[str, str]:
    """Section name (model, strategy.pipeline, data.sources) -> its part of docs/configuration.md."""
    parts = re.split(r"^### `\[+([\w.]+)\]+`$", REFERENCE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_config_key_is_in_its_own_section():
    """Each section's table holds exactly that dataclass's fields: a key documented only in another
    section (or a stale key) fails here, which the file-is-current test alone would not say by name."""
    sections = _reference_sections()
    for path, cls in R._sections(C.Config, []):
        name = ".".join(path)
        assert name in sections, f"[{name}] has no section in {R.REFERENCE_FILE}"
        keys = re.findall(r"^\| `(\w+)` \|", sections[name], flags=re.M)
        assert keys == [F.toml_key(f) for f in dataclasses.fields(cls) if not F.is_section(F.type_hints(cls)[f.name])], name


def test_python_api_example_runs():
    """The README's Python API block, run as printed from the checkout (5 steps of a d_model 64 GPT)."""
    text = README.read_text()
    code = text[text.index("## Python API"):].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 10, "the README's Python example grew past 10 lines"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if not ln.startswith("[r")]       # the engine's log lines
    assert [ln.split()[0] for ln in lines[:5]] == ["1", "2", "3", "4", "5"] and lines[5].startswith("validation loss")
