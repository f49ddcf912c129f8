"""The router's settings for the SLOs and the SLO planner (router/planner.py, docs/planner.md):
part of `RouterSettings` (router/settings.py), so flags, TANDEM_ROUTER_* variables and the
configuration reference are theirs. Each model's desired prefill and decode replicas go on
/metrics (tandem_planner_desired_replicas), for an autoscaler."""

from __future__ import annotations

from pydantic import BaseModel, Field


class PlannerSettings(BaseModel):
    slo_ttft: float = Field(2.0, gt=0, description="time-to-first-token SLO (seconds) the SLO "
                            "planner sizes the prefill pool for")
    slo_itl: float = Field(0.1, gt=0, description="inter-token latency SLO (seconds, a "
                           "request's mean) the SLO planner sizes the decode pool for, and "
                           "kv_aware keeps a decode worker's batch within")
    slo_percentile: float = Field(95.0, gt=0, lt=100, description="share of requests (percent) "
                                  "each SLO must hold for")
    planner_interval_s: float = Field(10.0, ge=0, description="how often the SLO planner "
                                      "decides; 0: off (no tandem_planner_* series)")
    planner_min_prefill: int = Field(1, ge=0, description="fewest prefill replicas the planner "
                                     "asks for")
    planner_max_prefill: int = Field(16, ge=0, description="most prefill replicas the planner "
                                     "asks for")
    planner_min_decode: int = Field(1, ge=0, description="fewest decode replicas the planner "
                                    "asks for")
    planner_max_decode: int = Field(16, ge=0, description="most decode replicas the planner "
                                    "asks for")
    planner_max_step_up: int = Field(4, ge=1, description="replicas the planner adds to a pool "
                                     "in one decision at most")
    planner_max_step_down: int = Field(2, ge=1, description="replicas the planner removes from a "
                                       "pool in one decision at most")
    planner_cooldown_s: float | None = Field(None, ge=0, description="no scale-down sooner "
                                             "than this after a scale-up, nor below the highest "
                                             "need of this last window (default: the planner's "
                                             "horizon, startup plus interval)")
    planner_startup_s: float = Field(60.0, ge=0, description="how long a new worker takes to "
                                     "serve (model load, graph capture): the planner forecasts "
                                     "this far ahead")
    # Until the router has observed decode steps: a line from a benchmark of the hardware
    # (these: SmolLM2-135M on 2 CPU cores, bench/engine.py).
    planner_decode_step_base_s: float = Field(0.066, gt=0, description="decode step time at "
                                              "batch 1 assumed until measured")
    planner_decode_step_per_seq_s: float = Field(0.0064, ge=0, description="decode step time "
                                                 "per extra running sequence assumed until "
                                                 "measured")
