"""Staging slots, the pull planner and the UCX settings, one unit at a time (no processes)."""

import random

import pytest
import torch

from kv_transfer import ucx_config
from kv_transfer.descriptors import coalesce, count_runs
from kv_transfer.pull_plan import COSTS, pipeline_parts, plan_pull, stage_at_export
from kv_transfer.staging import StagingPool

SMOL_BLOCK = 368_640  # SmolLM2's bytes per block
LLAMA_BLOCK = 2 << 20


def test_staging_leases_are_bounded_contiguous_and_merge_back():
    pool = StagingPool(torch.zeros(4, 2, 3), num_slots=10)
    assert pool.buffer.shape == (10, 2, 3)
    a, b, c = pool.lease("a", 3), pool.lease("b", 4), pool.lease("c", 3)
    assert (a.start, b.start, c.start) == (0, 3, 7) and pool.num_leased_slots == 10
    assert pool.lease("d", 1) is None  # full: the caller goes without staging
    with pytest.raises(ValueError, match="already holds"):
        pool.lease("a", 1)
    assert pool.release("b") and not pool.release("b")
    assert pool.lease("e", 5) is None  # 4 free, not 5
    assert pool.release("a") and pool.release("c")
    assert pool.num_leased_slots == 0 and pool.num_leases == 0
    whole = pool.lease("f", 10)  # the three ranges merged back into one
    assert whole is not None and whole.start == 0
    assert pool.view(whole).shape == (10, 2, 3) and pool.view(whole).is_contiguous()


def test_staging_pool_survives_random_lease_churn():
    rng = random.Random(0)
    pool = StagingPool(torch.zeros(1, 1), num_slots=64)
    held: dict[str, tuple[int, int]] = {}
    for i in range(2000):
        if held and rng.random() < 0.5:
            owner = rng.choice(sorted(held))
            assert pool.release(owner)
            del held[owner]
        else:
            n = rng.randint(1, 12)
            lease = pool.lease(f"o{i}", n)
            if lease is not None:
                held[lease.owner] = (lease.start, n)
        taken = sorted(held.values())
        for (s0, n0), (s1, _) in zip(taken, taken[1:], strict=False):
            assert s0 + n0 <= s1  # no two leases overlap
        assert pool.num_leased_slots == sum(n for _, n in held.values())
    for owner in list(held):
        pool.release(owner)
    assert pool.lease("all", 64) is not None


def test_count_runs_matches_coalesce():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 40)
        src = [rng.choice([i, rng.randrange(100)]) for i in range(n)]
        dst = [rng.choice([i + 5, rng.randrange(100)]) for i in range(n)]
        assert count_runs(src, dst) == len(coalesce(src, dst))
        assert count_runs(src) == len(coalesce(src, list(range(n))))
    assert count_runs([]) == 0


@pytest.mark.parametrize("block_bytes", [SMOL_BLOCK, LLAMA_BLOCK])
def test_planner_stages_scattered_gpu_pulls_and_keeps_few_blocks_direct(block_bytes):
    gpu = COSTS["cuda"]
    scattered = random.Random(2).sample(range(10_000), 256)
    local = random.Random(3).sample(range(10_000), 256)
    slots = list(range(40, 296))
    plan = plan_pull(scattered, local, block_bytes, gpu, staged_slots=slots,
                     local_staging_free=True)
    assert plan.kind == "staged_both" and plan.num_descriptors == 1
    # Without local staging room the sender's slots still save the remote side's runs only.
    plan = plan_pull(scattered, list(range(256)), block_bytes, gpu, staged_slots=slots)
    assert plan.kind == "staged_source" and plan.num_descriptors == 1
    # One block, or a contiguous run, is one descriptor already: no copy pays for itself.
    assert (plan_pull([7], [9], block_bytes, gpu, staged_slots=[0], local_staging_free=True).kind
            == "direct")
    run = list(range(100, 356))
    assert plan_pull(run, list(range(256)), block_bytes, gpu, staged_slots=slots,
                     local_staging_free=True).kind == "direct"
    assert (stage_at_export(scattered, block_bytes, gpu)
            and not stage_at_export(run, block_bytes, gpu))
    assert not stage_at_export([3, 9], block_bytes, gpu)


def test_planner_keeps_cpu_caches_per_descriptor_unless_forced():
    cpu = COSTS["cpu"]
    scattered = random.Random(4).sample(range(1000), 64)
    plan = plan_pull(scattered, scattered, SMOL_BLOCK, cpu, staged_slots=list(range(64)),
                     local_staging_free=True)
    assert plan.kind == "direct" and plan.num_descriptors == 64
    assert not stage_at_export(scattered, SMOL_BLOCK, cpu)
    forced = plan_pull(scattered, scattered, SMOL_BLOCK, cpu, "always", list(range(64)), True)
    assert forced.kind == "staged_both"
    assert (plan_pull(scattered, scattered, SMOL_BLOCK, cpu, "always", None, True).kind
            == "staged_local")
    assert plan_pull(scattered, scattered, SMOL_BLOCK, COSTS["cuda"], "never", list(range(64)),
                     True).kind == "direct"
    assert (stage_at_export([1], SMOL_BLOCK, cpu, "always")
            and not stage_at_export(scattered, SMOL_BLOCK, cpu, "never"))
    with pytest.raises(ValueError, match="unknown staging mode"):
        plan_pull([1], [1], SMOL_BLOCK, cpu, "sometimes")


def test_ucx_settings_turn_on_cuda_ipc_get_for_vram_unless_the_operator_chose():
    s = ucx_config.decide({}, "lo", vram=True, proto_log=None, log_dir="/tmp/x")
    assert s.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on" and s.env["UCX_NET_DEVICES"] == "lo"
    assert s.env["UCX_PROTO_INFO"] == "y" and s.env["UCX_LOG_FILE"] == "/tmp/x/ucx.log.%p"
    assert s.log_file == "/tmp/x/ucx.log.%p"
    host = ucx_config.decide({}, "lo", vram=False, proto_log=None, log_dir="/tmp/x")
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in host.env
    mine = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off", "UCX_NET_DEVICES": "eth0", "UCX_LOG_FILE": "/l"}
    kept = ucx_config.decide(mine, "lo", vram=True, proto_log=None, log_dir="/tmp/x")
    assert kept.env == {} and kept.kept["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"
    assert kept.log_file is None  # their log without PROTO_INFO: the lane stays unknown
    with_info = ucx_config.decide({**mine, "UCX_PROTO_INFO": "y"}, None, True, None, "/tmp/x")
    assert with_info.log_file == "/l"
    environ: dict = {"OTHER": "1"}
    ucx_config.apply(s, environ)
    assert environ == {"OTHER": "1", **s.env}
    environ["UCX_NET_DEVICES"] = "eth1"  # changed since: not ours to remove
    ucx_config.restore(s, environ)
    assert environ == {"OTHER": "1", "UCX_NET_DEVICES": "eth1"}


TABLES = """
[1.1] [h:1 :0]   | D intra-node cfg#1                                               |
[1.1] [h:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.1] [h:1 :0]   +--------+-------------+-------------------------------------------+
[1.1] [h:1 :0]   | Range  | Description |                  Config                   |
[1.1] [h:1 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1.1] [h:1 :0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1.1] [h:1 :0]   | Range  | Description |                  Config                   |
[1.1] [h:1 :0]   | 0..inf | zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1.1] [h:1 :0]   | active message by ucp_am_send*(egr) from host memory |
[1.1] [h:1 :0]   |          0 | short              | tcp/lo             |
"""


def test_lane_is_read_from_the_proto_info_tables(tmp_path):
    assert ucx_config.lane_of(TABLES, "host") == "cma"
    assert ucx_config.lane_of(TABLES, "cuda") == "rc_mlx5"
    assert ucx_config.lane_of(TABLES) == "rc_mlx5"  # the latest read table
    assert ucx_config.lane_of("| active message | short | tcp/lo |") is None
    path = tmp_path / "ucx.log.%p"
    reader = ucx_config.UcxLog(str(path), "cuda")
    assert reader.refresh() is None
    real = tmp_path / f"ucx.log.{__import__('os').getpid()}"
    real.write_text(TABLES.split("| remote memory read by ucp_get*(multi) into cuda")[0])
    assert reader.refresh() == "cma"  # no cuda table yet: any read table
    with real.open("a") as f:
        f.write("[1.1] [h:1 :0]   | remote memory read by ucp_get*(multi) into cuda memory from "
                "cuda |\n[1.1] [h:1 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda |\n")
    assert reader.refresh() == "cuda_ipc"  # read incrementally


def test_pipeline_parts_split_a_pull_into_whole_block_reads():
    mib = 1 << 20
    assert (pipeline_parts(256, 368_640, 16 * mib)
            == [(i, 52) for i in range(0, 208, 52)] + [(208, 48)])
    assert (pipeline_parts(4096, 2 * mib, 16 * mib, max_parts=8)
            == [(i, 512) for i in range(0, 4096, 512)])
    assert pipeline_parts(1, 2 * mib, 1) == [(0, 1)]  # never more parts than blocks
    assert pipeline_parts(10, 100, 16 * mib) == [(0, 10)]  # small: one READ
    assert pipeline_parts(0, 100) == []
    # The default: a 94 MB pull stays one READ (parts cost more than they overlap there on an
    # H200), a 1.5 GB one is split in the most parts.
    assert pipeline_parts(256, 368_640) == [(0, 256)]
    assert len(pipeline_parts(4096, 368_640)) == 8
    for n, parts in ((10, pipeline_parts(10, 100, 300)), (4095, pipeline_parts(4095, 2 * mib))):
        assert (sum(c for _, c in parts) == n
                and all(f == sum(c for _, c in parts[:i]) for i, (f, _) in enumerate(parts)))
    with pytest.raises(ValueError):
        pipeline_parts(4, 100, 0)
