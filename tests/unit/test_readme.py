"""The README stays a user's document: the two commands first, and every config key documented."""
import dataclasses
from pathlib import Path

from hpengine.config import load as C

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_two_commands_come_first():
    first_block = README.split("```")[1]
    assert "make train" in first_block and "make test" in first_block


def test_every_config_key_is_in_the_reference():
    ref = README[README.index("## Configuration reference"):]
    for path, cls in C._sections(C.Config, []):
        name = ".".join(path)
        assert f"[{name}]" in ref, name
        for f in dataclasses.fields(cls):          # the keys of every model kind
            assert f"`{f.name}`" in ref, f"{name}.{f.name}"
