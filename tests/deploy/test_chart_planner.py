"""The chart's per-pool autoscaling that follows the routers' SLO planner (docs/planner.md):
KEDA ScaledObjects whose Prometheus trigger is `tandem_planner_desired_replicas`, rendered and
validated like the rest of the chart (tests/deploy/test_chart.py)."""

from __future__ import annotations

import copy
import subprocess

import pytest

from tests.deploy.test_chart import CHART, HELM, IMAGES, by_kind, render, validate, validate_custom

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (run `make tools`)")


def test_planner_autoscaling_follows_the_routers_desired_replicas_per_pool():
    from tandem.cli import build_parser

    docs = render()
    assert not by_kind(docs, "ScaledObject")  # off by default
    deps = by_kind(docs, "Deployment")
    router_args = deps["rel-tandem-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--slo-ttft=2", "--slo-itl=0.1", "--slo-percentile=95"} <= set(router_args)
    assert deps["rel-tandem-decode"]["spec"]["replicas"] == 1

    docs = render("--set", "planner.autoscaling.enabled=true",
                  "--set", "planner.autoscaling.decode.maxReplicas=12",
                  "--set-json", "planner.sloItlS=0.05")
    validate(docs)
    deps, scaled = by_kind(docs, "Deployment"), by_kind(docs, "ScaledObject")
    assert set(scaled) == {"rel-tandem-prefill", "rel-tandem-decode"}
    for pool in ("prefill", "decode"):
        spec = scaled[f"rel-tandem-{pool}"]["spec"]
        assert spec["scaleTargetRef"]["name"] in deps and spec["scaleTargetRef"]["kind"] \
            == "Deployment"
        assert "replicas" not in deps[spec["scaleTargetRef"]["name"]]["spec"]  # KEDA owns it
        (trigger,) = spec["triggers"]
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
        assert query.startswith("sum(tandem_planner_desired_replicas{")
        assert f'pool="{pool}"' in query and 'model="smollm2-135m-instruct"' in query
        assert 'pod=~"rel-tandem-router-.*"' in query
    assert scaled["rel-tandem-decode"]["spec"]["maxReplicaCount"] == 12
    assert scaled["rel-tandem-prefill"]["spec"]["minReplicaCount"] == 1
    # Each router sizes for its share (KEDA sums them): no floor of its own; the flags parse.
    router_args = deps["rel-tandem-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--planner-min-prefill=0", "--planner-min-decode=0", "--planner-max-decode=12",
            "--slo-itl=0.05"} <= set(router_args)
    settings = build_parser().parse_args(["router", *router_args])
    assert settings.slo_itl == 0.05 and settings.planner_max_decode == 12

    # The ScaledObjects were checked against KEDA's CRD above; that check refuses what KEDA would.
    for field, value in (("maxReplicaCnt", 3), ("maxReplicaCount", "many")):
        wrong = copy.deepcopy(scaled["rel-tandem-decode"])
        wrong["spec"][field] = value
        with pytest.raises((AssertionError, ValueError)):
            validate_custom(wrong)

    vllm = by_kind(render("--set", "planner.autoscaling.enabled=true", "--set", "engine=vllm"),
                   "ScaledObject")
    assert vllm["rel-tandem-decode"]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    for bad, message in ((["--set", "planner.autoscaling.prefill.minReplicas=9"],
                          "minReplicas 9 is above maxReplicas 8"),
                         (["--set", "planner.sloTtftS=0"], "sloTtftS")):
        r = subprocess.run([HELM, "template", "rel", str(CHART), *IMAGES,
                            "--set", "planner.autoscaling.enabled=true", *bad],
                           capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr, r.stderr
