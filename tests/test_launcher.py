"""`tandem up` (tandem/launcher.py): what it gives its workers."""

from tandem.cli import build_parser
from tandem.settings import local_cluster, worker_settings


def test_tandem_up_passes_the_kv_tiers_and_a_disk_folder_per_worker(tmp_path, monkeypatch):
    args = build_parser().parse_args([
        "up", "--model", "tiny-random", "--port", "0", "--no-redis", "--prefill", "2",
        "--host-kv-gb", "1", "--disk-kv-dir", str(tmp_path / "kv"), "--disk-kv-gb", "2"])
    cluster = local_cluster(args)
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, argv, env=None: spawned.setdefault(name,
                                                                                         argv))
    monkeypatch.setattr(cluster, "_wait", lambda *a, **kw: None)
    cluster.up()
    folders = set()
    for name in ("prefill-0", "prefill-1", "decode-0"):
        settings = worker_settings(build_parser().parse_args(spawned[name]))
        assert settings.host_kv_gb == 1 and settings.disk_kv_gb == 2
        # its own subfolder, named after it: a restart of that worker finds its blocks again
        assert settings.disk_kv_dir == tmp_path / "kv" / name
        config = settings.engine_config()
        assert config.host_kv_bytes == 1 << 30 and config.disk_kv_bytes == 2 << 30
        folders.add(config.disk_kv_dir)
    assert len(folders) == 3
    # Without the flags the workers keep their own settings (TANDEM_HOST_KV_GB, ...).
    plain = local_cluster(build_parser().parse_args(["up", "--model", "m", "--port", "0",
                                                "--no-redis"]))
    spawned.clear()
    monkeypatch.setattr(plain, "_spawn", lambda name, argv, env=None: spawned.setdefault(name,
                                                                                       argv))
    monkeypatch.setattr(plain, "_wait", lambda *a, **kw: None)
    plain.up()
    assert not any(a.startswith(("--host-kv", "--disk-kv")) for a in spawned["decode-0"])


def test_a_cluster_without_a_redis_starts_its_own_and_waits_for_it(tmp_path):
    """No Redis answers at the URL given: `local_redis` starts a redis-server on a free loopback
    port, and `wait_listening` returns once it accepts connections (tandem/ports.py
    `wait_open`); a port nothing listens on is reported as not open within the timeout."""
    import shutil
    import socket

    import pytest
    import redis

    from tandem.local_redis import local_redis
    from tandem.ports import free_port, wait_open

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (CI installs it with Redis)")
    nothing = free_port()
    assert not wait_open("127.0.0.1", nothing, timeout_s=0.3)
    started = local_redis(f"redis://127.0.0.1:{nothing}/0", False, tmp_path)
    try:
        assert started.proc is not None and started.url != f"redis://127.0.0.1:{nothing}/0"
        assert "started redis-server" in started.note
        started.wait_listening()
        assert redis.Redis.from_url(started.url).ping()
        with socket.socket() as s:  # a listening port is open at once
            s.bind(("127.0.0.1", 0))
            s.listen()
            assert wait_open("127.0.0.1", s.getsockname()[1], timeout_s=0.0)
    finally:
        if started.proc is not None:
            started.proc.terminate()
            started.proc.wait(10)
    assert (tmp_path / "redis.log").exists()
