"""Markdown reference of every service setting, generated from the settings classes (their
fields, defaults and descriptions: the same source as the generated CLI flags, tandem/flags.py).
The README embeds the output between `<!-- config-reference -->` markers;
tests/test_packaging.py checks it is current.

    python -m tandem.config_reference          # print
    python -m tandem.config_reference --write  # update README.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tandem.flags import flag_name, shown_default

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def table(cls, title: str, command: str, skip: tuple[str, ...] = ()) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    rows = [f"### {title}", "", f"`{command} --flag`, or the environment variable; a flag wins.",
            "", "| flag | env | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        rows.append(f"| `{flag_name(name)}` | `{prefix}{name.upper()}` | `{shown_default(field)!r}` "
                    f"| {(field.description or '').replace('|', '/')} |")
    return "\n".join(rows)


def reference() -> str:
    from router.settings import RouterSettings
    from worker.settings import WorkerSettings

    return "\n\n".join([table(RouterSettings, "Router (`tandem router`)", "tandem router"),
                        table(WorkerSettings, "Workers (`tandem prefill|decode|colocated`)",
                              "tandem decode", skip=("role",))])


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
