"""The engine channel: what an engine process and the sidecar share, and all they share.

`protocol`: the wire format (frames, strict request models, error codes, `PROTOCOL_VERSION`,
the layout summary checked in `hello`). `shm`: the sealed memfds the engine's KV pools live in
(`SharedPools` on the engine's side, `map_peer_fd` / `map_pools` on the sidecar's). `counters`:
the per-load layer counter files (`CounterFile`, `LoadState`).

Both ends import this package and nothing of each other: the client (and the demo engine and
the engine integrations) never import `hicache.service`, and the service never imports
`hicache.client`. It holds no state and starts nothing; its objects live as long as the engine
or the session that made them.
"""
