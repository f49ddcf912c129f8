"""Markdown reference of every service setting, generated from the settings classes (their
fields, defaults, and the comment beside each field). The README embeds the output between
`<!-- config-reference -->` markers; tests/test_packaging.py checks it is current.

    python -m common.config_reference          # print
    python -m common.config_reference --write  # update README.md
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
_FIELD = re.compile(r"^    (\w+): [^=]+?(?:=\s*(.+?))?\s*(?:#\s*(.*))?$")


def _comments(cls) -> dict[str, str]:
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD.match(line)
        if m and m.group(3):
            out[m.group(1)] = m.group(3).strip()
    return out


def table(cls, title: str, flag_prefix: str) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    notes = _comments(cls)
    rows = [f"### {title}", "", f"Environment variables `{prefix}*`; CLI flags `{flag_prefix} --name-with-dashes`.",
            "", "| setting | env | default | notes |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        if isinstance(default, Path) and str(default).startswith(str(Path.home())):
            default = "~" + str(default)[len(str(Path.home())):]
        rows.append(f"| `{name}` | `{prefix}{name.upper()}` | `{default!r}` | {notes.get(name, '')} |")
    return "\n".join(rows)


def reference() -> str:
    from router.settings import RouterSettings
    from worker.settings import WorkerSettings

    return "\n\n".join([table(RouterSettings, "Router (`tandem router`)", "tandem router"),
                        table(WorkerSettings, "Workers (`tandem prefill|decode|colocated`)", "tandem decode")])


def write_readme(readme: Path) -> bool:
    text = readme.read_text()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), f"{START}\n{reference()}\n{END}", text, flags=re.S)
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_readme(Path(__file__).resolve().parents[1] / "README.md")
    else:
        print(reference())
