"""`tandem vllm-bridge`: a vLLM worker's KV cache events, republished into Tandem's exact index."""
