"""KV tiers below the device pool (engine/kv_tiers.py): the block file format (golden), budgets,
LRU, host -> disk, files that must never be served, a full disk, offloads racing evictions, and
greedy answers through reloaded prefixes token-identical to answers without tiers."""

import errno
import random
import threading

import pytest
import torch

from common.block_events import BlockEvent
from common.hashing import BlockHasher
from engine import LLM
from engine.block_pool import BlockPool
from engine.disk_tier import DiskTier, write_atomically
from engine.host_tier import HostTier
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers import KVTiers
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.tier_file import BlockFormat, TierFileError, decode, encode_header, file_name
from kv_transfer.layout import KV_ORDER

BLOCK_SHAPE = (1, 2, 2, 1, 4)  # [layers, K/V, block_size, kv heads, head dim]: 16 floats


def block_format(**over) -> BlockFormat:
    fields = dict(model_digest="0123456789abcdef", layout=KV_ORDER, block_size=2,
                  hash_seed=7, dtype="float32", shape=BLOCK_SHAPE, element_size=4)
    return BlockFormat(**{**fields, **over})


def fill(kv: torch.Tensor, block_id: int, block_hash: int) -> None:
    """Contents that say which hash they belong to."""
    kv[block_id] = float(block_hash % 1_000_003)


def block_files(folder):
    return sorted(folder.glob("*.kvb"))


def holds(t: torch.Tensor, block_hash: int) -> bool:
    return bool((t == float(block_hash % 1_000_003)).all())


class Rig:
    """A pool over a small fake KV cache with tiers, driven by hand."""

    def __init__(self, tmp_path, num_blocks=8, host_slots=4, disk_bytes=None, writer=None,
                 fmt=None):
        self.kv = torch.zeros((num_blocks, *BLOCK_SHAPE))
        host = HostTier(host_slots, BLOCK_SHAPE, torch.float32)
        disk = None
        if disk_bytes is not None:
            disk = DiskTier(tmp_path / "disk", disk_bytes, fmt or block_format(),
                            writer=writer or write_atomically)
        self.tiers = KVTiers(self.kv, 2, host, disk)
        self.pool = BlockPool(num_blocks, offloader=self.tiers)

    def store(self, hashes: list[int]) -> None:
        """Compute blocks for `hashes`, cache them, free them, and let the offloads run."""
        for h in hashes:
            (b,) = self.pool.allocate(1)
            fill(self.kv, b, h)
            self.pool.cache_block(b, h)
            self.pool.free([b])
            assert self.tiers.wait_idle()

    def reload(self, hashes: list[int]) -> list[bool]:
        """Reload each of `hashes` found below the device into a scratch block."""
        media = self.tiers.lookup(hashes)
        out = []
        for h, m in zip(hashes, media, strict=False):
            (b,) = self.pool.allocate(1)
            self.kv[b] = -1.0
            ok = self.tiers.reload([h], [m], [b]) == 1
            out.append(ok and holds(self.kv[b], h))
            self.pool.free([b])
        return out

    def close(self):
        self.tiers.close()


# ---- the file format (golden) -----------------------------------------------------------------


def test_block_file_header_is_pinned():
    payload = bytes(range(64))
    header = encode_header(block_format(), 0x1122334455667788, payload)
    assert header == (
        b'TKVB\x01\x00\xdd\x00{"block_hash":"1122334455667788","block_size":2,'
        b'"checksum":269405836,"dtype":"float32","hash_seed":"0000000000000007",'
        b'"layout":"block_layer_kv_nhd","model_digest":"0123456789abcdef",'
        b'"payload_bytes":64,"shape":[1,2,2,1,4]}')
    assert bytes(decode(block_format(), 0x1122334455667788, header + payload)) == payload
    assert file_name(0x1122334455667788) == "1122334455667788.kvb"


@pytest.mark.parametrize(("change", "reason"), [
    (lambda h, p: h + p[:-1], "truncated"),
    (lambda h, p: h[:5], "truncated"),
    (lambda h, p: h + p[:10] + bytes([p[10] ^ 1]) + p[11:], "corrupt"),
    (lambda h, p: b"XKVB" + h[4:] + p, "corrupt"),
    (lambda h, p: h + p + b"x", "corrupt"),
    (lambda h, p: h[:4] + b"\x02" + h[5:] + p, "stale"),
])
def test_damaged_files_are_refused_with_their_reason(change, reason):
    payload = bytes(64)
    header = encode_header(block_format(), 5, payload)
    with pytest.raises(TierFileError) as e:
        decode(block_format(), 5, change(header, payload))
    assert e.value.reason == reason
    with pytest.raises(TierFileError, match="another block"):
        decode(block_format(), 6, header + payload)  # renamed


@pytest.mark.parametrize("other", [dict(model_digest="fedcba9876543210"), dict(block_size=4),
                                   dict(dtype="bfloat16"), dict(hash_seed=8),
                                   dict(layout="layer_block"), dict(shape=(2, 2, 2, 1, 2))])
def test_foreign_files_are_refused(other):
    payload = bytes(64)
    data = encode_header(block_format(**other), 5, payload) + payload
    with pytest.raises(TierFileError) as e:
        decode(block_format(), 5, data)
    assert e.value.reason == "foreign"


# ---- host and disk tiers ----------------------------------------------------------------------


def test_host_tier_keeps_its_budget_in_lru_order(tmp_path):
    rig = Rig(tmp_path, host_slots=3)
    rig.store([1, 2, 3])
    assert rig.tiers.lookup([1, 2, 3]) == ["host"] * 3
    rig.reload([1])  # 1 is now the most recently used
    rig.store([4])
    assert sorted(rig.tiers.host.hashes()) == [1, 3, 4]  # 2 was the LRU one
    assert len(rig.tiers.host) <= 3
    events = rig.tiers.drain_events()
    assert BlockEvent("removed", (2,), "host") in events
    assert rig.reload([1, 3, 4]) == [True, True, True]
    rig.close()


def test_host_spills_to_disk_and_both_budgets_hold_under_load(tmp_path):
    file_bytes = len(encode_header(block_format(), 0, bytes(64))) + 64
    rig = Rig(tmp_path, num_blocks=6, host_slots=4, disk_bytes=10 * file_bytes)
    rng = random.Random(1)
    for _ in range(200):
        rig.store([rng.randrange(1, 60)])
        assert len(rig.tiers.host) <= 4
        disk = rig.tiers.disk
        on_disk = sum(p.stat().st_size for p in block_files(disk.folder))
        assert on_disk <= disk.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    held = rig.tiers.hashes_by_medium()
    assert held["host"] and len(held["disk"]) == 10
    only_disk = [h for h in held["disk"] if h not in held["host"]]
    assert only_disk and all(rig.reload(only_disk))  # the disk serves the right contents
    s = rig.tiers.stats()["kv_tiers"]
    assert s["disk"]["offload_blocks"] > 10
    assert s["disk"]["reload_blocks"] == len(only_disk)
    rig.close()


def test_spilled_blocks_move_down_without_being_removed_from_the_worker(tmp_path):
    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    rig.store([1, 2])
    events = rig.tiers.drain_events()
    assert BlockEvent("stored", (1,), "disk") in events
    assert BlockEvent("removed", (1,), "host") in events
    assert not any(e.kind == "removed" and e.medium == "disk" for e in events)
    assert rig.tiers.lookup([1, 2]) == ["disk", "host"]
    rig.close()


def damage(path, how):
    data = path.read_bytes()
    if how == "corrupt":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif how == "truncated":
        path.write_bytes(data[:-5])


def test_restart_serves_valid_files_and_deletes_every_other(tmp_path):
    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    rig.store([1, 2, 3, 4, 5])
    rig.close()
    folder = tmp_path / "disk"
    damage(folder / file_name(2), "corrupt")
    damage(folder / file_name(3), "truncated")
    (folder / ".0000000000000009.kvb.123.tmp").write_bytes(b"half")
    (folder / "README").write_text("not ours")
    other = DiskTier(tmp_path / "other", 1 << 20, block_format(model_digest="f" * 16))
    other.write(4, memoryview(bytes(64)))
    (folder / file_name(4)).write_bytes((tmp_path / "other" / file_name(4)).read_bytes())

    again = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    disk = again.tiers.disk
    assert sorted(disk.hashes()) == [1, 5]
    assert disk.num_rejected == {"corrupt": 1, "truncated": 1, "foreign": 1, "stale": 1}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [file_name(1), file_name(5), "README", ".lock"])
    assert again.tiers.drain_events() == [BlockEvent("stored", tuple(disk.hashes()), "disk")]
    assert again.reload([1, 5]) == [True, True]
    assert again.tiers.stats()["kv_tiers"]["files_rejected"]["corrupt"] == 1
    again.close()


def test_one_folder_serves_one_worker(tmp_path):
    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    rig.store([1, 2])
    second = DiskTier(tmp_path / "disk", 1 << 20, block_format(), lock_timeout_s=0.2)
    assert "in use by another process" in second.stopped
    assert second.scan() == [] and second.write(9, memoryview(bytes(64))) == (False, [])
    second.close()
    rig.close()  # lets the folder go
    third = DiskTier(tmp_path / "disk", 1 << 20, block_format())
    assert third.stopped is None and sorted(third.scan()) == [1, 2]
    third.close()


def test_a_file_damaged_after_the_start_is_never_served(tmp_path):
    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    rig.store([1, 2])
    damage(rig.tiers.disk.folder / file_name(1), "corrupt")
    assert rig.tiers.lookup([1]) == ["disk"]
    assert rig.reload([1]) == [False]
    assert 1 not in rig.tiers.disk and rig.tiers.disk.num_rejected == {"corrupt": 1}
    rig.close()


def test_a_smaller_budget_at_start_evicts_the_least_recently_used(tmp_path):
    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20)
    rig.store([1, 2, 3, 4, 5])  # on disk (written through), in this order of use
    rig.close()
    file_bytes = (tmp_path / "disk" / file_name(1)).stat().st_size
    again = Rig(tmp_path, host_slots=1, disk_bytes=2 * file_bytes)
    assert sorted(again.tiers.disk.hashes()) == [4, 5]  # mtime order: the oldest went
    assert len(block_files(tmp_path / "disk")) == 2
    again.close()


def test_disk_full_stops_the_disk_tier_not_the_worker(tmp_path):
    def full(path, chunks):
        raise OSError(errno.ENOSPC, "No space left on device")

    rig = Rig(tmp_path, host_slots=1, disk_bytes=1 << 20, writer=full)
    rig.store([1, 2, 3])
    disk = rig.tiers.disk
    assert disk.stopped is not None and "ENOSPC" in disk.stopped
    assert len(disk) == 0 and not block_files(disk.folder)
    assert rig.tiers.lookup([3]) == ["host"] and rig.reload([3]) == [True]  # host goes on
    s = rig.tiers.stats()["kv_tiers"]["disk"]
    assert s["stopped"] == 1 and s["dropped_offloads"] >= 1
    rig.close()
    # A budget smaller than one block stops it too, before writing anything.
    tiny = Rig(tmp_path / "t", host_slots=1, disk_bytes=10)
    tiny.store([1, 2])
    assert tiny.tiers.disk.stopped == "the budget holds no block"
    tiny.close()


def test_an_offload_not_started_when_its_block_is_reused_is_dropped(tmp_path):
    rig = Rig(tmp_path, num_blocks=1)
    (b,) = rig.pool.allocate(1)
    fill(rig.kv, b, 7)
    rig.pool.cache_block(b, 7)
    with rig.tiers._cond:  # the tiers' thread cannot take the copy meanwhile
        rig.pool.free([b])
        (again,) = rig.pool.allocate(1)  # evicts 7 while its copy is queued
        fill(rig.kv, again, 8)  # overwritten
    assert rig.tiers.wait_idle()
    assert 7 not in rig.tiers.host and rig.tiers.lookup([7]) == []
    assert rig.tiers.stats()["kv_tiers"]["host"]["dropped_offloads"] == 1
    rig.close()


class GatedCache:
    """A KV cache whose next block read by the tiers' thread waits for `go`."""

    def __init__(self, kv):
        self.kv, self.started, self.go = kv, threading.Event(), threading.Event()

    def __getitem__(self, i):
        if threading.current_thread().name == "kv-tiers":
            self.started.set()
            self.go.wait(30)
        return self.kv[i]


def test_a_copy_in_progress_is_waited_for_before_its_block_is_reused(tmp_path):
    rig = Rig(tmp_path, num_blocks=2)
    gate = GatedCache(rig.kv)
    rig.tiers.offloader.kv_cache = gate
    b, spare = rig.pool.allocate(2)
    fill(rig.kv, b, 7)
    rig.pool.cache_block(b, 7)
    rig.pool.free([b])
    assert gate.started.wait(30)  # the copy of 7 has begun
    reused = []
    t = threading.Thread(target=lambda: reused.append(rig.pool.allocate(1)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not reused  # allocate waits for the copy
    gate.go.set()
    t.join(30)
    assert reused == [[b]]
    fill(rig.kv, b, 8)
    rig.tiers.offloader.kv_cache = rig.kv
    rig.pool.free([spare])
    assert rig.reload([7]) == [True]  # the copy holds 7's contents, not 8's
    rig.close()


def test_offloads_racing_reuse_never_serve_wrong_contents(tmp_path):
    rig = Rig(tmp_path, num_blocks=4, host_slots=6, disk_bytes=1 << 20)
    rng = random.Random(3)
    held: list[int] = []
    for i in range(400):
        h = rng.randrange(1, 40)
        if rng.random() < 0.5 and rig.pool.num_free_blocks:
            (b,) = rig.pool.allocate(1)  # may evict a block whose copy is queued or running
            fill(rig.kv, b, h)
            if rig.pool.lookup([h]) == []:
                rig.pool.cache_block(b, h)
            held.append(b)
        elif held:
            rig.pool.free([held.pop(rng.randrange(len(held)))])
        if i % 50 == 0:
            assert rig.tiers.wait_idle()
    rig.pool.free(held)
    assert rig.tiers.wait_idle()
    found = [h for h in range(1, 40) if rig.tiers.lookup([h])]
    assert found and all(rig.reload(found))
    rig.close()


def test_a_reload_cut_short_keeps_what_loaded_and_frees_the_rest(tmp_path):
    rig = Rig(tmp_path, num_blocks=8, host_slots=1, disk_bytes=1 << 20)
    kv = KVCacheManager(rig.pool, 2, BlockHasher("m", 2), rig.tiers)
    seq = Sequence("a", list(range(9)), SamplingParams())
    kv.update_hashes(seq, 8)
    rig.store(seq.block_hashes)  # 4 blocks: 3 on disk, the last in host
    for _ in range(8):
        rig.store([1000 + _])  # push them out of the device pool
    assert rig.pool.lookup(seq.block_hashes) == []
    damage(rig.tiers.disk.folder / file_name(seq.block_hashes[1]), "corrupt")
    prefix = kv.computed_prefix(seq)
    assert len(prefix) == 1  # block 0 reloaded; block 1 failed its check; nothing past it
    assert seq.reloaded_media == {seq.block_hashes[0]: "disk"}
    assert rig.pool.num_free_blocks == 8  # the blocks of the failed reload went back
    assert kv.allocate(seq, 7, prefix)
    assert seq.num_cached_tokens_by_medium == {"device": 0, "host": 0, "disk": 2}
    kv.free(seq)
    assert rig.pool.num_free_blocks == 8
    rig.close()


# ---- the engine: greedy answers through reloaded prefixes ------------------------------------


def prompts(n=6, length=41):
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def run_twice(llm, batch):
    """Each prompt alone, twice round (the second round finds them evicted from the device)."""
    outs = []
    for _ in range(2):
        for p in batch:
            outs.append(llm.generate([p], GREEDY)[0])
            assert llm.engine.tiers.wait_idle()
    return outs


@pytest.mark.parametrize(("medium", "tiers"), [
    ("host", dict(host_kv_bytes=1 << 20)),
    # a host tier of 6 blocks of 2 KiB: the second round finds its prefixes on disk
    ("disk", dict(host_kv_bytes=6 * 2048, disk_kv_bytes=1 << 20)),
])
def test_greedy_answers_through_reloaded_prefixes_are_token_identical(
        tiny_folder, reference, tmp_path, medium, tiers):
    batch = prompts()
    want = [o.token_ids for o in reference.generate(batch, GREEDY)]
    if medium == "disk":
        tiers["disk_kv_dir"] = str(tmp_path / "disk")
    llm = LLM(str(tiny_folder), num_blocks=16, block_size=4, **tiers)
    try:
        outs = run_twice(llm, batch)
        assert [o.token_ids for o in outs] == want + want
        second = outs[len(batch):]
        assert all(o.num_cached_tokens_by_medium[medium] == 40 for o in second)
        s = llm.engine.stats()
        assert s["kv_tiers"][medium]["reload_blocks"] >= 10 * len(batch)
        assert s["reload_tokens_per_s"][medium] > 0
        held = llm.engine.cached_hashes_by_medium()
        assert set(held) == {"device", "host", "disk"} and held[medium]
    finally:
        llm.engine.close()


def test_disk_blocks_survive_a_restart_of_the_engine(tiny_folder, reference, tmp_path):
    batch = prompts(3)
    want = [o.token_ids for o in reference.generate(batch, GREEDY)]
    cfg = dict(num_blocks=64, block_size=4, disk_kv_dir=str(tmp_path / "disk"))
    llm = LLM(str(tiny_folder), **cfg)
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == want
    llm.engine.close()  # the device and host copies are gone; the disk ones stay
    again = LLM(str(tiny_folder), **cfg)
    try:
        outs = again.generate(batch, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert all(o.num_cached_tokens_by_medium["disk"] == 40 for o in outs)
    finally:
        again.engine.close()
    other = LLM(str(tiny_folder), **{**cfg, "block_size": 8})  # another layout: never served
    try:
        assert other.engine.tiers.disk.num_rejected["foreign"] > 0
        assert [o.token_ids for o in other.generate(batch, GREEDY)] == want
    finally:
        other.engine.close()


def test_an_abort_after_a_reload_frees_every_block(tiny_folder, tmp_path):
    llm = LLM(str(tiny_folder), num_blocks=16, block_size=4, host_kv_bytes=1 << 20)
    try:
        batch = prompts(3)
        run_twice(llm, batch[:2])
        engine = llm.engine
        engine.add_request("x", batch[0], GREEDY)
        seq = engine.requests["x"]
        while seq.status != SequenceStatus.RUNNING:
            engine.step()  # loading from host, then admitted with the reloaded prefix
        assert seq.reloaded_media
        engine.abort_request("x")
        assert engine.pool.num_free_blocks == engine.num_blocks
    finally:
        llm.engine.close()


def test_an_import_on_the_decode_side_reloads_its_prefix_from_the_tiers(tiny_folder, reference):
    batch = prompts(4)
    want = reference.generate(batch[0], GREEDY)[0].token_ids
    llm = LLM(str(tiny_folder), num_blocks=16, block_size=4, host_kv_bytes=1 << 20)
    try:
        run_twice(llm, batch)  # batch[0]'s blocks went to host and back, and out again
        engine = llm.engine
        assert engine.pool.lookup(engine.hasher(batch[0])[:1]) == []
        _, num_local = engine.add_imported_request("r", batch[0], GREEDY, want[:1])
        assert num_local == 10  # every full block but the last token's, reloaded from host
        engine.finish_import("r", success=False)  # nothing came: the rest is computed here
        out = None
        while engine.has_unfinished():
            for o in engine.step():
                out = o
        assert out.token_ids == want
        assert out.num_cached_tokens_by_medium == {"device": 0, "host": 40, "disk": 0}
        assert engine.pool.num_free_blocks == engine.num_blocks
    finally:
        llm.engine.close()
