"""Moving KV blocks between processes and hosts (NIXL, TCP fallback), leases, CUDA kernels.

Filled in by the kv_transfer issue; see DESIGN.md "KV transfer".
"""
