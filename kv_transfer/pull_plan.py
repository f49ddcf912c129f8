"""`plan_pull` and `stage_at_export`: how one pull moves its blocks, chosen by a cost model.

A NIXL transfer costs a fixed price per descriptor (one per run of consecutive blocks, ~7 us on
cuda_ipc, a few us on cma) plus its bytes over the link; staging trades descriptors for a local
copy through the gather/scatter kernels (kv_transfer/staging.py). The four ways a pull can go:

    direct         remote blocks -> local blocks             runs of (remote, local) descriptors
    staged_source  sender's staging slots -> local blocks    runs of (slots, local)
    staged_local   remote blocks -> local slots, scatter     runs of remote blocks, + a scatter
    staged_both    sender's slots -> local slots, scatter    runs of slots (usually 1), + a scatter

The cheapest predicted one wins (`auto`); `always` prefers the most staged way that is
available, `never` keeps `direct` (CI forces each path this way). On CPU caches a copy costs as
much as the transfer, so `auto` stays per-descriptor there; on a GPU few blocks stay direct too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kv_transfer.descriptors import count_runs

PlanKind = Literal["direct", "staged_source", "staged_local", "staged_both"]
StagingMode = Literal["auto", "always", "never"]
STAGING_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class CostModel:
    """Seconds and bytes per second; the figures are measured ones (bench/kv_transfer.py,
    bench/kv_kernels.py) and only their ratios matter to the choice."""

    per_descriptor_s: float
    link_bytes_per_s: float
    copy_bytes_per_s: float  # gather/scatter payload rate on the device
    copy_fixed_s: float  # one kernel launch + its synchronisation

    def seconds(self, num_descriptors: int, num_bytes: int, copies: int) -> float:
        t = num_descriptors * self.per_descriptor_s + num_bytes / self.link_bytes_per_s
        return t + copies * (self.copy_fixed_s + num_bytes / self.copy_bytes_per_s)


# H200, cuda_ipc (issue 30): 255 descriptors 51 GB/s vs 1 descriptor 996 GB/s of the same bytes;
# gather/scatter ~3.7 TB/s counting read + write. CPU (cma, 2 cores): a few us a descriptor,
# copies about as fast as the link.
COSTS = {
    "cuda": CostModel(per_descriptor_s=7e-6, link_bytes_per_s=1.0e12, copy_bytes_per_s=1.8e12,
                      copy_fixed_s=15e-6),
    "cpu": CostModel(per_descriptor_s=3e-6, link_bytes_per_s=8e9, copy_bytes_per_s=6e9,
                     copy_fixed_s=5e-6),
}


@dataclass(frozen=True)
class PullPlan:
    kind: PlanKind
    num_descriptors: int
    predicted_s: float

    @property
    def stages_locally(self) -> bool:
        return self.kind in ("staged_local", "staged_both")

    @property
    def reads_staged_source(self) -> bool:
        return self.kind in ("staged_source", "staged_both")


def plan_pull(remote_block_ids: list[int], local_block_ids: list[int], block_bytes: int,
              costs: CostModel, mode: StagingMode = "auto", staged_slots: list[int] | None = None,
              local_staging_free: bool = False) -> PullPlan:
    """The way to move `remote_block_ids` into `local_block_ids`. `staged_slots`: where the sender
    staged each remote block (None: not staged); `local_staging_free`: this side could lease
    enough staging slots for the pull."""
    if mode not in STAGING_MODES:
        raise ValueError(f"unknown staging mode {mode!r}; choose from {', '.join(STAGING_MODES)}")
    n = len(remote_block_ids)
    if n == 1 and mode == "auto":  # one block is one descriptor: nothing to plan (~10 us saved)
        return PullPlan("direct", 1, costs.seconds(1, block_bytes, 0))
    nbytes = n * block_bytes
    options: list[tuple[PlanKind, int, int]] = [
        ("direct", count_runs(remote_block_ids, local_block_ids), 0)]
    if mode != "never":
        if staged_slots is not None:
            options.append(("staged_source", count_runs(staged_slots, local_block_ids), 0))
        if local_staging_free:
            options.append(("staged_local", count_runs(remote_block_ids), 1))
            if staged_slots is not None:
                options.append(("staged_both", count_runs(staged_slots), 1))
    priced = [PullPlan(kind, d, costs.seconds(d, nbytes, copies)) for kind, d, copies in options]
    if mode == "always":
        return priced[-1]  # the most staged way available
    return min(priced, key=lambda p: p.predicted_s)  # ties keep the earlier, simpler way


def stage_at_export(block_ids: list[int], block_bytes: int, costs: CostModel,
                    mode: StagingMode = "auto") -> bool:
    """Whether the sender gathers an export into staging slots: when a receiver reading the
    blocks where they are would pay for their runs more than a scatter of the whole pull."""
    if mode != "auto":
        return mode == "always"
    runs = count_runs(block_ids)
    direct = costs.seconds(runs, len(block_ids) * block_bytes, 0)
    staged = costs.seconds(1, len(block_ids) * block_bytes, 1)
    return staged < direct


# H200, SmolLM2 layout (bench/gpu_check.sh, third run): a 94 MB pull into local staging took
# 610 us as one READ and 884 us as six 16 MiB parts, while 1.5 GB pulls gained from parts: each
# part costs a completion poll and a scatter launch, which pays only once parts are large.
# 128 MiB keeps pulls up to that size whole; the next GPU check measures the split again.
PIPELINE_PART_BYTES = 128 << 20
MAX_PIPELINE_PARTS = 8


def pipeline_parts(num_blocks: int, block_bytes: int, part_bytes: int = PIPELINE_PART_BYTES,
                   max_parts: int = MAX_PIPELINE_PARTS) -> list[tuple[int, int]]:
    """(first, count) of the READs a pull into local staging slots is split into: all are posted
    at once and each part is scattered as soon as it has landed, while later parts are still
    being read (the scatter of the last part is all that is left after the READ). Parts of about
    `part_bytes` (whole blocks), at most `max_parts` of them."""
    if num_blocks < 1:
        return []
    if part_bytes < 1 or max_parts < 1:
        raise ValueError("parts need at least one byte and one part")
    num = max(1, min(max_parts, num_blocks, (num_blocks * block_bytes) // part_bytes))
    per = -(-num_blocks // num)
    return [(i, min(per, num_blocks - i)) for i in range(0, num_blocks, per)]
