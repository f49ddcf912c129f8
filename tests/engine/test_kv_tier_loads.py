"""Reloads from the KV tiers off the engine's step (engine/kv_loader.py, the scheduler's loading
state): running streams decode while a disk reload is in flight; a reload cut short (a file
corrupt or gone) is computed instead; an abort during a load frees the blocks only once the copy
is over; a reload racing a KV export (blocks held for a P/D pull) leaves the exported bytes as
they were. Greedy answers stay token-identical to an engine without tiers throughout."""

import os
import random
import threading

import pytest

from engine import LLM
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from engine.tier_file import file_name

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompts(n, length=41, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


class Rig:
    """An engine whose prompt `target` (10 full blocks of 4 tokens) sits in its disk tier only,
    and whose disk reads on the loader's thread wait for `gate` while `gated`."""

    def __init__(self, folder, tmp_path, monkeypatch, num_blocks=32):
        # inline_load_s=0: every load runs off the step (the disk is slow: see `gate`)
        self.llm = LLM(str(folder), num_blocks=num_blocks, block_size=4,
                       host_kv_bytes=4 * 2048, disk_kv_dir=str(tmp_path / "disk"),
                       disk_kv_bytes=1 << 20, inline_load_s=0)
        self.engine = e = self.llm.engine
        self.target, *others = prompts(4, seed=7)
        for p in [self.target, *others]:  # the others push the target out of device and host
            self.llm.generate([p], GREEDY)
            assert e.tiers.wait_idle()
        self.hashes = e.hasher(self.target)[:10]
        assert e.pool.lookup(self.hashes) == []
        assert e.tiers.lookup(self.hashes) == ["disk"] * 10
        self.gated, self.gate, self.reading = True, threading.Event(), threading.Event()
        read = e.tiers.disk.read_into

        def gated_read(block_hash, dst):
            if self.gated and threading.current_thread().name == "kv-loader":
                self.reading.set()
                assert self.gate.wait(30)
            return read(block_hash, dst)

        monkeypatch.setattr(e.tiers.disk, "read_into", gated_read)

    def run(self, outputs: dict[str, list[int]], steps: int | None = None) -> None:
        """Step `steps` times (None: until nothing is left), collecting tokens by request."""
        n = 0
        while self.engine.has_unfinished() and (steps is None or n < steps):
            for out in self.engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            n += 1

    def disk_reloads(self) -> int:
        return self.engine.stats()["kv_tiers"]["disk"]["reload_blocks"]

    def close(self):
        self.gate.set()
        self.engine.close()


@pytest.fixture
def rig(tiny_folder, tmp_path, monkeypatch):
    r = Rig(tiny_folder, tmp_path, monkeypatch)
    yield r
    r.close()


def test_running_streams_decode_while_a_disk_reload_is_in_flight(rig, reference):
    engine, outputs = rig.engine, {}
    stream = prompts(1, length=9, seed=8)[0]
    engine.add_request("running", stream, LONG)
    rig.run(outputs, steps=2)
    assert len(outputs["running"]) == 2  # decoding
    engine.add_request("reload", rig.target, GREEDY)
    rig.run(outputs, steps=1)
    seq = engine.requests["reload"]
    assert seq.status == SequenceStatus.LOADING and engine.scheduler.loading == [seq]
    assert rig.reading.wait(10)  # the loader is inside a disk read, which waits
    rig.run(outputs, steps=10)
    # Ten steps of the running stream while the reload is in flight (it was one stalled
    # step when the reload ran on the engine's thread).
    assert len(outputs["running"]) == 13
    assert seq.status == SequenceStatus.LOADING and "reload" not in outputs
    assert all(engine.pool.blocks[b].ref_cnt > 0 for b in seq.block_table)
    assert engine.stats()["loading"] == 1
    rig.gate.set()
    rig.run(outputs)
    assert outputs["running"] == reference.generate(stream, LONG)[0].token_ids
    assert outputs["reload"] == reference.generate(rig.target, GREEDY)[0].token_ids
    assert seq.num_cached_tokens_by_medium == {"device": 0, "host": 0, "disk": 40}
    assert rig.disk_reloads() == 10
    assert engine.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("damage", ["corrupt", "vanished"])
def test_a_load_cut_short_computes_the_rest(rig, reference, damage):
    rig.gated = False
    path = rig.engine.tiers.disk.folder / file_name(rig.hashes[3])
    if damage == "corrupt":
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:
        os.remove(path)
    out = rig.llm.generate([rig.target], GREEDY)[0]
    assert out.token_ids == reference.generate(rig.target, GREEDY)[0].token_ids
    # blocks 0-2 came from disk; block 3 failed, so nothing past it was served
    assert out.num_cached_tokens_by_medium == {"device": 0, "host": 0, "disk": 12}
    assert rig.disk_reloads() == 3
    assert rig.engine.pool.num_free_blocks == rig.engine.num_blocks
    if damage == "corrupt":
        assert rig.engine.tiers.disk.num_rejected == {"corrupt": 1}


def test_an_abort_during_a_load_frees_its_blocks_once_the_copy_is_over(rig, reference):
    engine, outputs = rig.engine, {}
    engine.add_request("reload", rig.target, GREEDY)
    rig.run(outputs, steps=1)
    seq = engine.requests["reload"]
    loading = list(seq.block_table)
    assert seq.status == SequenceStatus.LOADING and len(loading) == 10
    assert rig.reading.wait(10)  # the copy into its first block has begun
    engine.abort_request("reload")
    assert engine.scheduler.loading == [] and seq.block_table == []
    # Still referenced: another request must not get a block the loader writes into.
    assert all(engine.pool.blocks[b].ref_cnt == 1 for b in loading)
    others = prompts(2, seed=9)
    for i, p in enumerate(others):
        engine.add_request(f"other-{i}", p, GREEDY)
    rig.run(outputs, steps=3)
    taken = {b for i in range(2) for b in engine.requests[f"other-{i}"].block_table}
    assert taken and not taken & set(loading)
    rig.gate.set()
    rig.run(outputs)
    assert rig.disk_reloads() <= 1  # cancelled after the block in progress
    for i, p in enumerate(others):  # no late copy landed in their blocks
        assert outputs[f"other-{i}"] == reference.generate(p, GREEDY)[0].token_ids
    assert engine.pool.num_free_blocks == engine.num_blocks
    assert engine.kv.num_loads == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("shared", [False, True])
def test_a_reload_racing_a_kv_export_leaves_the_exported_blocks_alone(rig, reference, shared):
    """A prefill-only request keeps its blocks for a P/D pull (as `run_prefill` exports them);
    a reload into other blocks, or sharing its leading ones, runs meanwhile."""
    engine, outputs = rig.engine, {}
    exported = rig.target[:20] + prompts(1, length=21, seed=10)[0] if shared \
        else prompts(1, seed=11)[0]
    rig.gated = False  # shared: the export's own leading blocks come from disk
    engine.add_request("export", exported, SamplingParams(temperature=0, max_tokens=1),
                       hold_blocks=True)
    rig.run(outputs)
    assert "export" in engine.held  # finished, its blocks held for the pull
    rig.gated = True
    held = engine.block_table("export")
    contents = engine.kv_cache[held].clone()
    engine.add_request("reload", rig.target, GREEDY)
    rig.run(outputs, steps=1)
    seq = engine.requests["reload"]
    assert seq.status == SequenceStatus.LOADING
    shares = set(seq.block_table) & set(held)
    assert (len(shares) == 5) if shared else not shares  # the leading 5 blocks are the export's
    assert rig.reading.wait(10)
    # The pull reads the exported blocks while the reload writes: what it reads is the prompt's.
    assert (engine.kv_cache[held] == contents).all()
    rig.gate.set()
    rig.run(outputs)
    assert outputs["reload"] == reference.generate(rig.target, GREEDY)[0].token_ids
    assert (engine.kv_cache[held] == contents).all()
    assert all(engine.pool.blocks[b].ref_cnt == 1 for b in held)  # still held, only by it
    assert engine.release("export")
    assert engine.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(("bytes_per_s", "loads"), [(1e12, False), (1e3, True)])
def test_a_reload_measured_to_be_quick_runs_at_admission(rig, reference, bytes_per_s, loads):
    """A load predicted (at the tier's measured rate) to take at most `inline_load_s` runs at
    admission, as a stall shorter than the step a loading sequence waits; a longer one does
    not."""
    engine, outputs = rig.engine, {}
    rig.gated = False
    engine.kv.inline_load_s = 0.002
    engine.tiers.stats_.reload_bytes_per_s["disk"] = bytes_per_s  # what earlier reloads measured
    engine.add_request("reload", rig.target, GREEDY)
    rig.run(outputs, steps=1)
    seq = engine.requests["reload"]
    assert (seq.status == SequenceStatus.LOADING) == loads
    if not loads:  # reloaded and computed in that same step: its first token is out
        assert outputs["reload"] and seq.num_cached_tokens_by_medium["disk"] == 40
    rig.run(outputs)
    assert outputs["reload"] == reference.generate(rig.target, GREEDY)[0].token_ids
    assert rig.disk_reloads() == 10
