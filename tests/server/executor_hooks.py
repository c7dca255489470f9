"""The tests' seam on the engine's model side: an Executor wrapping the engine's own, seeing (or editing) each step."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.executor import Executor
from pagoda.server.engine.model_runner import PromptHidden
from torch import Tensor

# (the step, its logits [num_rows, vocab]) -> the logits the engine samples from ([num_rows, vocab]).
StepHook = Callable[[SchedulerOutput, Tensor], Tensor]


class HookedExecutor(Executor):
    """Runs every call on `inner`; `on_step` sees each step's output and logits and returns the logits to use."""

    def __init__(self, inner: Executor, on_step: StepHook) -> None:
        self.inner = inner
        self.on_step = on_step
        self.driver = inner.driver
        self.num_blocks = inner.num_blocks
        self.num_host_blocks = inner.num_host_blocks

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """The inner step, its logits passed through the hook."""
        logits, prompt_hidden = self.inner.execute(output, prompt_lens)
        return self.on_step(output, logits), prompt_hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The inner LM head."""
        return self.inner.compute_logits(hidden)

    def collective_seconds(self) -> float:
        """The inner executor's."""
        return self.inner.collective_seconds()

    def check_health(self) -> None:
        """The inner executor's."""
        self.inner.check_health()

    def shutdown(self) -> None:
        """Stop the inner executor."""
        self.inner.shutdown()


def hook_steps(engine: LLMEngine, on_step: StepHook) -> HookedExecutor:
    """Wrap `engine`'s executor so that `on_step` sees every step from now on."""
    hooked = HookedExecutor(engine.executor, on_step)
    engine.executor = hooked
    return hooked
