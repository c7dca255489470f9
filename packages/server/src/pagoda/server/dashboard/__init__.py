"""The live dashboard: `/dashboard` (a canvas page) and `/dashboard/events` (SSE frames of the KV block map,
queues and time series). Submodules: snapshot (engine-thread copies), encoder (frames), series (time series),
producer (one per app, shared by viewers), routes (HTTP) and auth (the key in a cookie)."""
