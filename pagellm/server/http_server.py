"""uvicorn.Server with pagellm's shutdown: stop accepting, drain the engine, exit 0 on SIGINT/SIGTERM, exit 1
when the engine died."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

logger = logging.getLogger("pagellm")


def uvicorn_config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    # log_config=None keeps pagellm's logging setup; uvicorn's loggers just get a level.
    return uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level,
                          access_log=log_level in ("info", "debug", "trace"), timeout_graceful_shutdown=5,
                          lifespan="on")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine before closing connections and exits 0 on a signal."""

    def __init__(self, config: uvicorn.Config, engine, model_name: str, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the captured signal after a graceful shutdown, which would turn a clean
        # SIGTERM exit into death-by-signal; handle it here without re-raising.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            logger.info("ready: serving %s at http://%s:%d/v1", self.model_name, host, port)

    async def on_tick(self, counter: int) -> bool:
        # A dead engine serves nothing more: shut down (in-flight requests already got their error) and
        # exit non-zero, so that a supervisor restarts the process instead of it answering 503 forever.
        if self.engine.error is not None and not self.should_exit:
            logger.error("the engine failed (%s: %s): shutting down to exit with status 1",
                         type(self.engine.error).__name__, self.engine.error)
            self.should_exit = True
        return await super().on_tick(counter)

    @property
    def exit_code(self) -> int:
        """0 after a signal-driven shutdown, 1 when the engine died (also when it died while draining)."""
        return 0 if self.engine.error is None else 1

    async def shutdown(self, sockets=None) -> None:
        # Stop accepting first, then give in-flight requests their grace period; uvicorn's own shutdown
        # then only waits for the (now final) responses to flush.
        for server in self.servers:
            server.close()
        logger.info("shutting down: %d request(s) in flight", self.engine.num_in_flight)
        await self.engine.drain(self.shutdown_timeout, give_up=lambda: self.force_exit)
        await super().shutdown(sockets)
