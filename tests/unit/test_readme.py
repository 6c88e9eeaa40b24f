"""The README stays a user's document: the two commands first, and every config key documented."""
from pathlib import Path

from hpengine import config as C

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_two_commands_come_first():
    first_block = README.split("```")[1]
    assert "make train" in first_block and "make test" in first_block


def test_every_config_key_is_in_the_reference():
    ref = README[README.index("## Configuration reference"):]
    for section, value in C.to_dict(C.Config()).items():
        for name, table in ([(section, value)] if section != "strategy" else
                            [(f"strategy.{k}", v) for k, v in value.items()]):
            assert f"[{name}]" in ref, name
            for key in table:
                assert f"`{key}`" in ref, f"{name}.{key}"
