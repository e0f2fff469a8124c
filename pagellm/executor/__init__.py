"""Executors: how the engine's step reaches the model. One interface (`base.Executor`), two implementations:
`uniproc.UniprocExecutor` (the runner in the engine's process) and `multiproc.MultiprocExecutor` (tensor x
pipeline parallel worker processes joined by torch.distributed). Both receive the same plain-data
`StepMessage` (pagellm/core/step_message.py). Nothing is imported here, so `errors` loads without torch."""
