"""Resilience: heartbeats, the hang judge and fail-fast (a failure published, every node's job ended)."""
