"""The configuration: one dataclass per TOML section (tree.py, read by reflection in fields.py), loaded from TOML
with --set overrides (load.py), validated once before any communicator exists (rules.py), written back as TOML.
Exports: Config, ConfigError, load_config, to_toml, validate."""
from hpengine.config.load import Config, ConfigError, load_config, to_toml, validate

__all__ = ["Config", "ConfigError", "load_config", "to_toml", "validate"]
