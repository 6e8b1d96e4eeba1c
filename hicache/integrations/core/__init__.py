"""What every engine adapter needs, whatever the engine: one guarded link to the sidecar
(`sidecar_link`: connect, reconnect, outages, never an exception into the engine), the
engine's own memory shared with the sidecar in place (`shared_memory`), a load's end
(`load_end`) and the engine's free-form settings checked alike (`extra_config`).
Engine-specific code lives beside it (`integrations/sglang/`, the vLLM connector's
`integrations/vllm/`) and imports it; nothing here imports an engine."""
