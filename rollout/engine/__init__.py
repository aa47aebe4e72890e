"""The engine loop: `EngineCore` (schedule -> run -> sample -> update, one step), the
`ContinuousBatchingManager` (inbox, outbox, its thread, the caller-stepped `collect`), OpenMP team
handling and tensor-parallel lockstep."""
