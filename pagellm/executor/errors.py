class WorkerFailedError(RuntimeError):
    """A worker process died or its step raised: the engine cannot go on."""


class EngineStartError(WorkerFailedError):
    """The engine core's own process died, or never answered, while starting."""
