"""The runner in the engine's own process: the message is handed over as it is, nothing is copied."""

from __future__ import annotations

from pagellm.core.step_message import StepMessage
from pagellm.executor.base import Executor
from pagellm.model.runner import ModelRunner, StepResult


class UniprocExecutor(Executor):
    name = "uni"

    def __init__(self, runner: ModelRunner):
        super().__init__(runner.block_size)
        self.runner = runner

    def run(self, msg: StepMessage) -> StepResult:
        return self.runner.execute(msg)
