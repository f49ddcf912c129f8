"""`tandem bench`: a load generator that drives any OpenAI-compatible endpoint and reports
TTFT / ITL / end-to-end latency, throughput, goodput under an SLO and the router's own counters."""
