"""A Hugging Face Hub mirror of local folders, for tests: the part of the Hub's HTTP API that
huggingface_hub's `snapshot_download` uses (repo info, file tree, resolve with HEAD and GET).
No hub is reachable from this machine; HF_ENDPOINT pointed at a mirror is also how clusters
without internet access use the chart's `model.source: huggingface`."""
import hashlib
from pathlib import Path

from fastapi import FastAPI, Request, Response

SHA = "0123456789abcdef0123456789abcdef01234567"


def make_app(repos: dict[str, Path]) -> FastAPI:
    app = FastAPI()

    @app.get("/api/models/{org}/{name}/revision/{revision}")
    def info(org: str, name: str, revision: str):
        folder = repos[f"{org}/{name}"]
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        return {"id": f"{org}/{name}", "sha": SHA, "siblings": [{"rfilename": f} for f in files]}

    @app.get("/api/models/{org}/{name}/tree/{revision}")
    def tree(org: str, name: str, revision: str):
        folder = repos[f"{org}/{name}"]
        return [{"type": "file", "path": p.name, "size": p.stat().st_size,
                 "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                for p in sorted(folder.iterdir()) if p.is_file()]

    @app.api_route("/{org}/{name}/resolve/{revision}/{filename}", methods=["GET", "HEAD"])
    def resolve(org: str, name: str, revision: str, filename: str, request: Request):
        data = (repos[f"{org}/{name}"] / filename).read_bytes()
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        headers = {"X-Repo-Commit": SHA, "ETag": etag, "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return Response(status_code=200, headers=headers)
        return Response(data, headers=headers, media_type="application/octet-stream")

    return app
