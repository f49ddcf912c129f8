"""The fabric between the workers' localities: what pulling KV from one locality into another
costs, learned from the pulls that happen (issue 42; docs/architecture.md "Topology").

Each (source locality, destination locality) pair learns from the peer pulls it carries, each timed
as the request felt it: its bandwidth as the fastest recent pull of at least `MIN_BANDWIDTH_BYTES`
went (a rate a pull reached is one the link has; a slower one was slowed by something else, so the
estimate rises at once and decays slowly), and its fixed cost as an EWMA of what each pull took
beyond moving its bytes at that rate. Until a pair has measured a bandwidth, it is priced at its
link class's seed (`--link-*-bytes-per-s`, common/locality.py) where one is set, else at what the
caller knew before localities (the destination's measured transfer rate). A worker that reports no
locality is its own endpoint (`endpoint`: "#" and its id), so its peer pulls are learned per worker
pair instead of pooling every such link into one figure; such a pair has no link class, so no seed:
until it has measured its own pulls, it is priced at what all such pairs have measured together
(nothing is known of its link but that), so a fleet without localities does not pay for the first
pulls of every one of its pairs.

What a pull is taught by is the puller's side of it (reserving, moving and caching the blocks);
what the holder's export took is learned apart, fleet-wide (`export`: router/export_time.py), so a
holder slow to answer does not make its link look slow.

Bounded: at most `MAX_PAIRS` pairs are remembered (the least recently learned go first), so a
fleet of thousands of localities, or a Redis that invents them, costs bounded memory."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.locality import LINK_CLASSES, link_class
from router.export_time import ExportTime

MAX_PAIRS = 4096
MIN_BANDWIDTH_BYTES = 1 << 20  # smaller pulls are mostly fixed cost
ALPHA = 0.3  # weight of the newest pull in the fixed cost's EWMA
DECAY = 0.05  # how far a slower pull pulls the bandwidth down (a faster one sets it at once)


@dataclass
class Link:
    """What one (source, destination) pair has measured; None until measured."""

    fixed_s: float | None = None
    bytes_per_s: float | None = None
    num_pulls: int = 0


def endpoint(w) -> str:
    """What the fabric keys a worker's side of a pull by: its locality, or "#" and its worker id
    where it gave none ("#" is never in a locality, common/locality.py)."""
    return w.locality or f"#{w.worker_id}"


def _link_class(src: str, dst: str) -> str:
    return "unknown" if src.startswith("#") or dst.startswith("#") else link_class(src, dst)


def _per_worker(src: str, dst: str) -> bool:
    """A pair keyed by a worker without a locality (`endpoint`) at either end."""
    return src.startswith("#") or dst.startswith("#")


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


def _update(link: Link, num_bytes: int, seconds: float) -> None:
    """Teach `link` one pull of `num_bytes` that took `seconds` (see the module's docstring)."""
    link.num_pulls += 1
    if num_bytes >= MIN_BANDWIDTH_BYTES:
        rate = num_bytes / seconds  # the link moved at least this fast
        link.bytes_per_s = rate if link.bytes_per_s is None else max(
            rate, (1 - DECAY) * link.bytes_per_s + DECAY * rate)
    if link.bytes_per_s is not None:
        link.fixed_s = _ewma(link.fixed_s, max(seconds - num_bytes / link.bytes_per_s, 0.0))
    elif num_bytes < MIN_BANDWIDTH_BYTES:
        link.fixed_s = _ewma(link.fixed_s, seconds)  # a small pull: mostly fixed cost


class Fabric:
    """Learned and seeded pull costs per locality pair (see the module's docstring)."""

    def __init__(self, seeds: dict[str, float | None] | None = None, fixed_s: float = 0.005,
                 max_pairs: int = MAX_PAIRS) -> None:
        unknown = set(seeds or ()) - set(LINK_CLASSES)
        if unknown:
            raise ValueError(f"unknown link classes {sorted(unknown)}; choose from "
                             f"{', '.join(LINK_CLASSES)}")
        self.seeds = dict(seeds or {})
        self.fixed_s = fixed_s
        self.max_pairs = max_pairs
        self._links: OrderedDict[tuple[str, str], Link] = OrderedDict()
        self._unknown = Link()  # every pair keyed by a worker id, learned together
        self.export = ExportTime()  # what holders' exports take (router/export_time.py)

    @classmethod
    def from_settings(cls, s) -> Fabric:
        return cls({"same_node": s.link_same_node_bytes_per_s,
                    "same_rack": s.link_same_rack_bytes_per_s,
                    "same_zone": s.link_same_zone_bytes_per_s,
                    "cross_zone": s.link_cross_zone_bytes_per_s}, s.transfer_fixed_s)

    def link(self, src: str, dst: str) -> Link | None:
        """What the pair has measured (None: nothing yet)."""
        return self._links.get((src, dst))

    def pull_s(self, src: str, dst: str, num_bytes: float, fallback_bytes_per_s: float) -> float:
        """Predicted seconds to pull `num_bytes` from a worker at `src` into one at `dst`."""
        link = self._links.get((src, dst)) or Link()
        cls = _link_class(src, dst)
        prior = self._unknown if _per_worker(src, dst) else Link()
        fixed = _first(link.fixed_s, prior.fixed_s, self.fixed_s)
        rate = _first(link.bytes_per_s, prior.bytes_per_s, self.seeds.get(cls) or None,
                      fallback_bytes_per_s)
        return fixed + num_bytes / rate

    def learn(self, src: str, dst: str, num_bytes: int, seconds: float) -> Link | None:
        """One pull's outcome; returns the pair's link, or None where nothing was learned (an
        empty endpoint, a pull with no bytes or no time)."""
        if not src or not dst or num_bytes <= 0 or not 0 < seconds < 3600:
            return None
        key = (src, dst)
        link = self._links.pop(key, None) or Link()
        self._links[key] = link  # most recently learned last
        while len(self._links) > self.max_pairs:
            self._links.popitem(last=False)
        _update(link, num_bytes, seconds)
        if _per_worker(src, dst):
            _update(self._unknown, num_bytes, seconds)
        return link

    def links(self) -> list[tuple[str, str, Link]]:
        """Every remembered pair, least recently learned first."""
        return [(src, dst, link) for (src, dst), link in self._links.items()]
