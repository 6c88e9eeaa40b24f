"""Every shipped config in configs/ loads and validates."""
from pathlib import Path

import pytest

from hpengine.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.out_dir
