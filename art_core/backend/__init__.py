"""Backends: `LocalBackend` (engine + trainer in this process) and `RemoteBackend` (HTTP client)."""
