"""Persistence: Optuna's RDB storage (`rdb`), what the tuner keeps on a study (`study`), and who runs what
across processes and machines (`claims`)."""
from autotune.storage.rdb import open_storage, sqlite_path

__all__ = ["open_storage", "sqlite_path"]
