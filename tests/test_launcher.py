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
