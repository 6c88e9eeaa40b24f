"""The configuration: one dataclass per TOML section (tree.py), loaded from TOML with --set overrides and
validated before any communicator exists (load.py), written back as TOML (toml_out.py).
Exports: Config, ConfigError, load_config, to_toml, validate."""
from hpengine.config.load import Config, ConfigError, load_config, to_toml, validate

__all__ = ["Config", "ConfigError", "load_config", "to_toml", "validate"]
