"""A vLLM OpenAI server as the bridge reads it over HTTP: whether it is healthy (`/health`), the
model it serves (`/v1/models`), its block size, KV capacity, load and start time (`/metrics`),
and where its KV events are published (`/kv_event_sources`, vLLM >= 0.32).

Every answer comes from a peer: bodies are read up to a bound and every value is validated
(ValueError otherwise); a server that cannot be reached raises aiohttp's or asyncio's errors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from common.model_identity import is_name

MAX_BODY_BYTES = 8 << 20  # a /metrics page with many LoRA or histogram series stays far below
MAX_COUNT = 1 << 40


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=512)
    root: str | None = Field(None, max_length=4096)
    max_model_len: int | None = Field(None, ge=1, le=MAX_COUNT)


class _Models(BaseModel):
    model_config = ConfigDict(extra="ignore")

    data: list[_Model] = Field([], max_length=256)


class EventSource(BaseModel):
    """One data-parallel rank's KVEventsConfig, as `/kv_event_sources` reports it."""

    model_config = ConfigDict(extra="ignore")

    enable_kv_cache_events: bool = False
    publisher: str | None = Field(None, max_length=64)
    endpoint: str = Field("", max_length=512)
    replay_endpoint: str | None = Field(None, max_length=512)
    topic: str = Field("", max_length=1024)


_SOURCES = TypeAdapter(dict[int, EventSource])


@dataclass(frozen=True)
class ServedModel:
    names: list[str]  # every --served-model-name alias, the first one first
    root: str  # the model path vLLM loaded
    max_model_len: int | None

    @property
    def root_digest(self) -> str:
        """What routers probing a vLLM server take for its model digest
        (router/vllm_backend.py `VLLMBackend.probe`): sha256 of the model path."""
        return hashlib.sha256(self.root.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServerMetrics:
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None  # 0..1
    start_time: float | None = None  # of the API server process: a new one is a restart

    def load(self, cached_blocks: int | None = None) -> dict[str, int]:
        """The registration's `load` (common/registry.py WorkerLoad); `cached_blocks`: the GPU
        blocks its KV events say it holds. vLLM's free blocks include its cached unreferenced
        ones, which it does not count apart: `evictable_blocks` is taken as all cached blocks
        that fit among the free ones (exact while nothing runs, an upper bound otherwise)."""
        out = {"running": self.running, "waiting": self.waiting}
        if self.num_gpu_blocks:
            out["num_blocks"] = self.num_gpu_blocks
            if self.kv_cache_usage is not None:
                out["free_blocks"] = round((1 - self.kv_cache_usage) * self.num_gpu_blocks)
                if cached_blocks is not None:
                    out["evictable_blocks"] = min(cached_blocks, out["free_blocks"])
        return out


class VLLMServer:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _get(self, path: str) -> bytes:
        assert self._http is not None, "start() first"
        async with self._http.get(self.url + path) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {path}: HTTP {resp.status}")
            body = await resp.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"GET {path}: body over {MAX_BODY_BYTES} bytes")
            return body

    async def healthy(self) -> bool:
        """`/health` answers 200: the engine is alive (vLLM answers 503 once it died)."""
        try:
            await self._get("/health")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return True

    async def model(self) -> ServedModel:
        try:
            models = _Models.model_validate(orjson.loads(await self._get("/v1/models")))
        except (orjson.JSONDecodeError, ValidationError) as e:
            raise ValueError(f"/v1/models: unexpected answer: {e}") from e
        names = [m.id for m in models.data if is_name(m.id)]
        if not names:
            raise ValueError("/v1/models lists no model with a valid name")
        first = models.data[0]
        # Every alias is its own entry with the same root (the model path): the root is the model.
        return ServedModel(names, first.root or first.id, first.max_model_len)

    async def metrics(self) -> ServerMetrics:
        try:
            text = (await self._get("/metrics")).decode()
            samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"/metrics: unreadable: {e}") from e
        found: dict[str, float] = {}
        cache: dict[str, str] = {}
        for s in samples:
            if s.name == "vllm:cache_config_info" and not cache:
                cache = s.labels
            elif s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                found[s.name] = found.get(s.name, 0.0) + s.value  # summed over engines
            elif s.name in ("vllm:kv_cache_usage_perc", "process_start_time_seconds"):
                found.setdefault(s.name, s.value)
        usage = found.get("vllm:kv_cache_usage_perc")
        start = found.get("process_start_time_seconds")
        return ServerMetrics(
            block_size=_label_int(cache, "block_size", 1 << 16),
            num_gpu_blocks=_label_int(cache, "num_gpu_blocks", MAX_COUNT),
            running=_count(found.get("vllm:num_requests_running", 0)),
            waiting=_count(found.get("vllm:num_requests_waiting", 0)),
            kv_cache_usage=usage if usage is not None and 0 <= usage <= 1 else None,
            start_time=start if start is not None and 0 < start < 1e11 else None)

    async def event_sources(self) -> dict[int, EventSource]:
        """{data-parallel rank: its publisher's config}; empty if the server has none."""
        try:
            sources = _SOURCES.validate_json(await self._get("/kv_event_sources"))
        except ValidationError as e:
            raise ValueError(f"/kv_event_sources: unexpected answer: {e}") from e
        if len(sources) > 1024:
            raise ValueError("/kv_event_sources: more than 1024 ranks")
        return sources


def _label_int(labels: dict[str, str], name: str, bound: int) -> int | None:
    value = labels.get(name, "")
    return int(value) if value.isdigit() and len(value) <= 20 and 0 < int(value) <= bound else None


def _count(value: float) -> int:
    return int(value) if 0 <= value <= MAX_COUNT else 0
