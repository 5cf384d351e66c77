"""Configuration: the pydantic models behind the Python API (`tuning`) and YAML tuning files (`file`)."""
from autotune.config.file import FileConfig, load_config, parse_config
from autotune.config.tuning import (
                                    DEFAULT_STORAGE,
                                    DEFAULT_STUDIES_DIR,
                                    ConfigModel,
                                    LatencyInput,
                                    MixedPrecisionConfig,
                                    StrictModel,
                                    TuningConfig,
)

__all__ = ["DEFAULT_STORAGE", "DEFAULT_STUDIES_DIR", "ConfigModel", "FileConfig", "LatencyInput",
           "MixedPrecisionConfig", "StrictModel", "TuningConfig", "load_config", "parse_config"]
