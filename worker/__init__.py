"""Machinery shared by the prefill, decode and colocated services: settings, the FastAPI app
with its lifespan (engine thread, KV connector, Redis publisher), metrics and the endpoints."""
