"""The seam between the engine and the model: one step's forward pass, on one process or on several ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from pagoda.pagedkernel.sampling import SampleOutput, SamplingTensors
from pagoda.scheduler import SchedulerOutput
from pagoda.server.engine.model_runner import ModelRunner, PromptHidden
from pagoda.server.models.parallel import ParallelGroup
from torch import Tensor


class ExecutorError(RuntimeError):
    """A worker died or a collective failed: the engine cannot run another step."""


class Executor(ABC):
    """Runs the scheduler's steps on the model; the scheduler and block manager stay with the engine.

    `driver` is the runner in the engine's own process (rank 0, holding the whole model or its first shard):
    its logits come back to the engine, which samples them. The KV sizes are those every rank allocated.
    """

    driver: ModelRunner
    num_blocks: int
    num_host_blocks: int

    @abstractmethod
    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """One step on every rank: see `ModelRunner.execute`; the logits are whole-vocabulary.

        Tests observe or edit the steps by wrapping an engine's executor (`LLMEngine.executor`) in their own.
        """

    def execute_sampled(
        self,
        output: SchedulerOutput,
        prompt_lens: Mapping[str, int],
        draw: SamplingTensors,  # one row per sample id of the step, in schedule order; only tokens wanted
    ) -> tuple[SampleOutput, dict[str, PromptHidden]] | None:
        """One step whose rows' tokens come straight from the LM head (`ModelRunner.execute_sampled`); None when
        this executor does not draw fused (the default: a wrapper or several ranks), and the engine runs `execute`.
        """
        return None

    @abstractmethod
    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The LM head over final hidden states the driver holds (prompt logprobs)."""

    def collective_seconds(self) -> float:
        """Wall time the driver spent in collectives so far (0 on one process)."""
        return 0.0

    def check_health(self) -> None:  # noqa: B027 (a no-op where there are no workers, not an abstract method)
        """Raise ExecutorError if a worker has ended; cheap, so an idle engine can call it periodically."""

    def shard_group(self) -> ParallelGroup | None:
        """The driver's tensor-parallel group (its shard is read back with it at wake); None on one process."""
        return None

    # Sleep mode's followers (engine/sleep.py `SleepFollowers`): the workers' shards sleep with the driver's.
    def send_sleep(self, level: int) -> None:  # noqa: B027 (no workers: nothing to tell)
        """Tell every worker to sleep at `level`."""

    def send_wake(self, tags: Sequence[str]) -> None:  # noqa: B027 (no workers: nothing to tell)
        """Tell every worker to wake what `tags` name."""

    def wait_sleep_states(self) -> Sequence[object]:
        """Every worker's state once it has slept or woken (none without workers)."""
        return ()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers, if any (idempotent)."""


class UniProcExecutor(Executor):
    """Today's path: the whole model in the engine's process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.driver = runner
        self.num_blocks = runner.kv_cache.num_blocks
        self.num_host_blocks = runner.kv_cache.num_host_blocks

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """The runner's step."""
        return self.driver.execute(output, prompt_lens)

    def execute_sampled(
        self,
        output: SchedulerOutput,
        prompt_lens: Mapping[str, int],
        draw: SamplingTensors,  # one row per sample id of the step, in schedule order; only tokens wanted
    ) -> tuple[SampleOutput, dict[str, PromptHidden]] | None:
        """The runner's step with its tokens drawn from the LM head, where its model and the step allow."""
        return self.driver.execute_sampled(output, prompt_lens, draw)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The runner's LM head."""
        return self.driver.compute_logits(hidden)

    def shutdown(self) -> None:
        """Nothing to stop: the model lives as long as the engine."""
