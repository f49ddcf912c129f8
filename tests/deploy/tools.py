"""Where the deployment tests find helm, promtool and prometheus (`make tools` fetches helm)."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def find(name: str) -> str | None:
    local = ROOT / ".venv" / "tools" / name
    if local.exists():
        return str(local)
    return shutil.which(name)
