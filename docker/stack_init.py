"""First start of the compose stack (docker/compose.yaml): the database password and the files that carry it.

Writes into SECRETS_DIR (a named volume, mounted read-only by the other services):
  db_password     the PostgreSQL password (POSTGRES_PASSWORD_FILE of the database service)
  storage_url     postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (AUTOTUNE_STORAGE_FILE of the workers)
  dashboard.toml  the same URL for `optuna-dashboard --from-config`

The password is $AUTOTUNE_DB_PASSWORD if set at the first start, else 32 random URL-safe characters; it is
kept from then on (the database is initialised with it once), so later starts only rewrite the two URL files.
No password is ever printed or put on a command line.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote


def write(path: Path, text: str) -> None:
    """Atomically, readable by the other services' users (postgres, autotune) through the read-only volume."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


def main() -> None:
    folder = Path(os.environ.get("SECRETS_DIR", "/run/autotune"))
    folder.mkdir(parents=True, exist_ok=True)
    password_file = folder / "db_password"
    if not password_file.exists():
        write(password_file, os.environ.get("AUTOTUNE_DB_PASSWORD") or secrets.token_urlsafe(24))
        print(f"stack_init: new database password in {password_file}")
    password = password_file.read_text()
    user, db = os.environ.get("POSTGRES_USER", "autotune"), os.environ.get("POSTGRES_DB", "autotune")
    host, port = os.environ.get("POSTGRES_HOST", "postgres"), os.environ.get("POSTGRES_PORT", "5432")
    url = f"postgresql+psycopg://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/{quote(db, safe='')}"
    write(folder / "storage_url", url + "\n")
    write(folder / "dashboard.toml", f"[optuna_dashboard]\nstorage = {json.dumps(url)}\n")
    print(f"stack_init: storage postgresql+psycopg://{user}:***@{host}:{port}/{db}")


if __name__ == "__main__":
    main()
