"""The sidecar: `hicache serve` — the engine channel, shared-memory data plane, HTTP control
API and metrics (see `app.serve` for the process lifecycle)."""
