"""The prefill service (DESIGN.md "Worker <-> router API"). Filled in by the workers issue."""
