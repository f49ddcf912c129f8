"""Where a worker runs, as it reports it (`--locality`, docs/contract.md "Localities"): a path
of up to four levels, outermost first ("zone-a/rack-3/node-7"); "" for none reported.

What a pair of localities shares classes the link between them: the same path ("same_node"),
all but its last level ("same_rack"), all but its last two ("same_zone"), less or nothing at all
("cross_zone": so give whole paths, "zone/rack/node");
a worker that reports none makes the link "unknown". The router prices and learns KV pulls per
pair (router/fabric.py), seeded per class."""

from __future__ import annotations

MAX_LOCALITY_CHARS = 1024
MAX_LEVELS = 4
# Each level a DNS-name-like name (a Kubernetes node name, up to 253 characters, fits).
LOCALITY_PATTERN = (r"^([A-Za-z0-9][A-Za-z0-9._-]{0,252}(/[A-Za-z0-9][A-Za-z0-9._-]{0,252})"
                    r"{0,3})?$")

LINK_CLASSES = ("same_node", "same_rack", "same_zone", "cross_zone", "unknown")


def link_class(src: str, dst: str) -> str:
    """The class of the link between two localities (see above)."""
    if not src or not dst:
        return "unknown"
    a, b = src.split("/"), dst.split("/")
    if a == b:
        return "same_node"
    if len(a) != len(b):  # paths of different depths name different places
        return "cross_zone"
    shared = 0
    while a[shared] == b[shared]:
        shared += 1
    below = len(a) - shared  # levels that differ, counted from the innermost
    if shared == 0:  # nothing in common that the paths say
        return "cross_zone"
    return "same_rack" if below == 1 else "same_zone" if below == 2 else "cross_zone"
