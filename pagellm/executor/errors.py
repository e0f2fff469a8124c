class WorkerFailedError(RuntimeError):
    """A worker process died or its step raised: the engine cannot go on."""
