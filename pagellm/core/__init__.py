"""Pure-Python engine core: block pool, KV-cache manager, scheduler. Never imports torch."""
