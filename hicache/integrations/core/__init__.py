"""What every engine adapter needs, whatever the engine: one guarded link to the sidecar
(`sidecar_link`: connect, reconnect, outages, never an exception into the engine) and the
engine's own memory shared with the sidecar in place (`shared_memory`). Engine-specific code
lives beside it (`integrations/sglang/`, the vLLM connector's `integrations/vllm*.py`) and
imports it; nothing here imports an engine."""
