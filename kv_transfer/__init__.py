"""Moving KV blocks between processes and hosts (NIXL, TCP fallback), leases, CUDA kernels.

See docs/contract.md "KV transfer".
"""
