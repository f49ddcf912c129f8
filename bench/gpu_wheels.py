"""Fetch the wheels the GPU check needs on a GPU machine that has torch, Triton and transformers
but no network and none of the service packages (pydantic, fastapi, redis, nixl ...).

    .venv/bin/python bench/gpu_wheels.py [--dest .whl] [--python-version 3.12] [--nixl nixl-cu13]

Wheels are fetched for CPython `--python-version` on manylinux x86-64 (what the GPU machine runs),
pinned to the versions this venv has so both sides run the same code. The nixl wheel is slimmed:
its expert-parallel folder (`nixl_ep_*`, unused by Tandem) is dropped, which halves it. The folder
is never committed (`.whl/` is ignored); `bench/gpu_check.sh` installs from it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

# What the router, the workers and the transfer layer import beyond the GPU image's packages.
PACKAGES = ("pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "typing-inspection",
            "annotated-types", "fastapi", "starlette", "uvicorn", "redis", "orjson", "llguidance",
            "httptools", "opentelemetry-api", "importlib-metadata", "sniffio")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64")
NIXL_VERSION = "1.5.1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pinned(name: str) -> str:
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def download(specs: list[str], dest: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + specs, check=True)


def slim(wheel: Path, drop_prefix: str) -> Path:
    """Rewrite `wheel` without the top-level folders starting with `drop_prefix`."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.split("/", 1)[0].startswith(drop_prefix):
                continue
            dst.writestr(item, src.read(item.filename))
    tmp.replace(wheel)
    return wheel


def smollm2_tokenizer(folder: Path | None, dest: Path) -> None:
    """SmolLM2's tokenizer and chat template (3.5 MB) into `dest`: the GPU check's random-weight
    models of SmolLM2's shapes speak it."""
    from engine.model_store import prepare_smollm2
    from engine.tiny import copy_tokenizer

    copy_tokenizer(folder or prepare_smollm2(), dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dest", default=".whl")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--nixl", default="nixl-cu13", help="the nixl wheel for the GPU's CUDA major")
    ap.add_argument("--tokenizer-from", default=None, help="a model folder whose tokenizer files "
                    "go to DEST/tokenizer (default: the prepared SmolLM2)")
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    download([pinned(p) for p in PACKAGES] + [f"{args.nixl}=={NIXL_VERSION}"], dest,
             args.python_version)
    ep_prefix = args.nixl.replace("-", "_").replace("nixl_", "nixl_ep_")
    for wheel in dest.glob(f"{args.nixl.replace('-', '_')}-*.whl"):
        slim(wheel, ep_prefix)
    smollm2_tokenizer(Path(args.tokenizer_from) if args.tokenizer_from else None,
                      dest / "tokenizer")
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    for p in sorted(dest.glob("*.whl")):
        print(f"{p.stat().st_size / 2**20:7.1f} MiB  {p.name}")
    print(f"{total / 2**20:7.1f} MiB in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
