"""Which worker may serve which model (router/models.py), the registration fields behind it
(common/registry.py) and the model digest (common/model_identity.py)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from prometheus_client import CollectorRegistry

from common.hashing import hash_seed
from common.model_identity import model_digest
from common.registry import WorkerRegistration
from router.models import ModelCatalog
from router.worker_info import WorkerInfo


def catalog(tiny_folder, only=None, salt=None) -> ModelCatalog:
    return ModelCatalog(only=only, tokenizer_path=None, model_dir=tiny_folder.parent,
                        hash_salt=salt, registry=CollectorRegistry())


def worker(wid, digest, names=("tiny-random",), started=1.0, block_size=4, salt=None, folder=None):
    return WorkerInfo(wid, "decode", f"http://{wid}", served_names=tuple(names), digest=digest,
                      block_size=block_size, started_at=started,
                      hash_seed=hash_seed(digest, block_size, salt), tokenizer_path=str(folder))


def refused(c: ModelCatalog, reason: str) -> float:
    return c.refused.labels(reason)._value.get()


def test_the_oldest_identity_owns_a_name_while_any_of_its_workers_lives(tiny_folder):
    c = catalog(tiny_folder)
    a = worker("a", "aaaaaaaaaaaaaaaa", started=1.0, folder=tiny_folder)
    b = worker("b", "bbbbbbbbbbbbbbbb", started=2.0, folder=tiny_folder)
    asyncio.run(c.reconcile([b, a]))
    assert a.accepted == {"tiny-random"} and b.accepted == frozenset()
    assert refused(c, "model_identity") == 1
    asyncio.run(c.reconcile([b, a]))
    assert refused(c, "model_identity") == 1  # logged and counted once per worker
    # A newer worker of the same identity joins; the name stays with it even if it is younger.
    a2 = worker("a2", "aaaaaaaaaaaaaaaa", started=3.0, folder=tiny_folder)
    asyncio.run(c.reconcile([b, a2]))
    assert a2.accepted == {"tiny-random"} and b.accepted == frozenset()
    # Once no worker of that identity is left, the name passes to the next one.
    asyncio.run(c.reconcile([b]))
    assert b.accepted == {"tiny-random"}
    assert c.get("tiny-random").identity == ("bbbbbbbbbbbbbbbb", 4)


def test_one_model_at_two_block_sizes_is_served_side_by_side(tiny_folder):
    # Tandem workers at 4 beside vLLM workers at 8 (16 and 128 on real fleets): one digest, one
    # name; each block size hashes with its own seed, and a seed from another salt is refused.
    c = catalog(tiny_folder)
    small = worker("tandem", "aaaaaaaaaaaaaaaa", started=1.0, block_size=4, folder=tiny_folder)
    big = worker("vllm", "aaaaaaaaaaaaaaaa", started=2.0, block_size=8, folder=tiny_folder)
    salted = worker("salted", "aaaaaaaaaaaaaaaa", started=3.0, block_size=8, salt="x",
                    folder=tiny_folder)
    asyncio.run(c.reconcile([small, big, salted]))
    assert small.accepted == big.accepted == {"tiny-random"} and salted.accepted == frozenset()
    model = c.get("tiny-random")
    assert model.hasher_for(4) is model.hasher and model.hasher_for(8).seed == big.hash_seed
    assert refused(c, "hash_seed") == 1 and refused(c, "model_identity") == 0


def test_aliases_and_models_are_independent(tiny_folder):
    c = catalog(tiny_folder)
    # Names without a tokenizer folder of their own use the worker's published folder.
    a = worker("a", "aaaaaaaaaaaaaaaa", names=("tiny-random", "tiny"), folder=tiny_folder)
    b = worker("b", "bbbbbbbbbbbbbbbb", names=("other",), folder=tiny_folder)
    asyncio.run(c.reconcile([a, b]))
    assert a.accepted == {"tiny-random", "tiny"} and b.accepted == {"other"}
    assert c.served([a, b]) == ["other", "tiny", "tiny-random"]
    assert (c.get("tiny").hasher.seed == c.get("tiny-random").hasher.seed
            != c.get("other").hasher.seed)


def test_a_worker_hashing_with_another_salt_is_refused(tiny_folder):
    c = catalog(tiny_folder, salt="tenant-a")
    ok = worker("ok", "aaaaaaaaaaaaaaaa", salt="tenant-a", folder=tiny_folder)
    bad = worker("bad", "aaaaaaaaaaaaaaaa", salt=None, folder=tiny_folder)
    asyncio.run(c.reconcile([ok, bad]))
    assert ok.accepted == {"tiny-random"} and bad.accepted == frozenset()
    assert refused(c, "hash_seed") == 1


def test_a_pinned_router_ignores_other_models_and_a_missing_tokenizer_refuses(
        tiny_folder, tmp_path):
    c = catalog(tiny_folder, only="tiny-random")
    other = worker("o", "bbbbbbbbbbbbbbbb", names=("other",), folder=tiny_folder)
    asyncio.run(c.reconcile([other]))
    assert other.accepted == frozenset() and c.get("other") is None
    c2 = ModelCatalog(only=None, tokenizer_path=None, model_dir=tmp_path, hash_salt=None,
                      registry=CollectorRegistry())
    lost = worker("l", "cccccccccccccccc", names=("nowhere",), folder=tmp_path / "missing")
    asyncio.run(c2.reconcile([lost]))
    assert lost.accepted == frozenset() and refused(c2, "tokenizer") == 1


def test_model_digest_covers_config_and_tokenizer_files(tiny_folder, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    assert model_digest(copy) == model_digest(tiny_folder)
    assert len(model_digest(copy)) == 16
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_theta"] = 5000.0
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_digest(copy) != model_digest(tiny_folder)
    with pytest.raises(FileNotFoundError):
        model_digest(tmp_path / "empty")


def test_registrations_are_bounded():
    base = {b"role": b"decode", b"url": b"http://127.0.0.1:1", b"model_digest": b"0123456789abcdef",
            b"served_model_names": b'["a", "b/c"]', b"hash_seed": b"123",
            b"tokenizer_path": b"None"}
    reg = WorkerRegistration.from_hash(base)
    assert reg.names == ["a", "b/c"] and reg.hash_seed == 123 and reg.tokenizer_path is None
    assert WorkerRegistration.from_hash({b"role": b"decode", b"url": b"http://h:1",
                                         b"model": b"m"}).names == ["m"]
    for field, value in ((b"served_model_names", b'["bad name"]'),
                         (b"served_model_names", b"not json"),
                         (b"served_model_names", json.dumps(["m"] * 33).encode()),
                         (b"model_digest", b"XYZ"), (b"hash_seed", str(1 << 64).encode())):
        with pytest.raises(ValueError):
            WorkerRegistration.from_hash({**base, field: value})

