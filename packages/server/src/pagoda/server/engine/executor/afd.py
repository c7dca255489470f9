"""Attention/FFN disaggregation: the engine's process (rank 0) holds the KV cache and runs attention, FFN workers
(ranks 1..F) hold every layer's MLP, split tensor-parallel among themselves when F > 1; activations cross every
layer over torch.distributed (gloo on the CPU, NCCL on CUDA), two micro-batches in ping-pong
(engine/executor/afd_model.py).

The machinery is tensor parallelism's (distributed.py): the same worker program, launcher, CURVE-secured control
socket and process group, with the workers in the "ffn" role. The driver keeps the scheduler, the sampler and the
LM head; each forward it announces the micro-batch sizes to the FFN workers (`FFNForward`), then sends every FFN
worker the MLP inputs and receives the (all-reduced) outputs from the first, point to point. A worker that dies
fails the next exchange at once (its sockets close), a wedged one after the group's timeout: the engine gets an
ExecutorError naming it, never a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pagoda.scheduler import SchedulerOutput
from pagoda.server.afd_config import FLAG
from pagoda.server.config import EngineConfig
from pagoda.server.engine.executor.afd_model import AFDForward, UnsupportedModelError, drop_mlps, split_model
from pagoda.server.engine.executor.comm import ProcessGroupCollectives
from pagoda.server.engine.executor.distributed import DistributedExecutor, model_folder
from pagoda.server.engine.executor.messages import FFNCounts, FFNForward, FFNReport
from pagoda.server.engine.model_runner import PromptHidden
from pagoda.server.engine.setup import EngineConfigError, EngineParts, Placement, build_parts, with_lora
from pagoda.server.models import TensorParallelError
from pagoda.server.models.parallel import ParallelGroup, check_tensor_parallel
from torch import Tensor
from transformers import AutoConfig

logger = logging.getLogger("pagoda.engine")
_REPORT_TIMEOUT_S = 30.0
_POLL_MS = 200


class AFDExecutor(DistributedExecutor):
    """Rank 0 runs attention (and holds the KV cache), rank 1 the MLPs; see the module docstring."""

    afd: AFDForward

    @classmethod
    def launch(cls, config: EngineConfig) -> tuple[DistributedExecutor, EngineParts]:
        """Start the FFN worker beside the driver's model (its MLPs dropped), install the split forward."""
        afd = config.parallel_config.attention_ffn_disaggregation
        assert afd is not None
        size = afd.attention_workers + afd.ffn_workers
        folder = model_folder(config)
        try:  # the FFN ranks load tensor-parallel shards among themselves (then keep their MLPs)
            check_tensor_parallel(AutoConfig.from_pretrained(folder).get_text_config(), afd.ffn_workers)
        except TensorParallelError as exc:
            raise EngineConfigError(f"{FLAG} ffn_workers {afd.ffn_workers}: {exc}") from exc
        executor, parts = cls.start(config, folder, size, "ffn")
        executor.afd = AFDForward(
            parts.model, executor.group, executor.announce, ping_pong=parts.lora is None
        )
        executor.driver.forward = executor.afd
        logger.info(
            "attention/FFN disaggregation: attention in this process, the MLPs on %d FFN rank(s); %s",
            afd.ffn_workers,
            "two micro-batches in ping-pong" if parts.lora is None else "one micro-batch a step (LoRA)",
        )
        return executor, parts

    @classmethod
    def driver_parts(
        cls, config: EngineConfig, group: ProcessGroupCollectives, placement: Placement
    ) -> EngineParts:
        """The whole model loaded unsplit, its MLPs dropped (before LoRA looks for its targets), the KV cache."""
        parts = build_parts(config, None, placement)
        try:
            _, layers, _ = split_model(parts.model)
        except UnsupportedModelError as exc:
            raise EngineConfigError(str(exc)) from exc
        drop_mlps(layers)
        return with_lora(config, parts)

    def announce(self, num_tokens: tuple[int, ...]) -> None:
        """Tell the FFN worker a forward of micro-batches of these many tokens comes next."""
        self._send(FFNForward(num_tokens))

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """The driver's step; its forward (if the step has one) exchanges the MLPs with the FFN worker."""
        self.check_health()
        self.steps += 1
        try:
            return self.driver.execute(output, prompt_lens)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The LM head is whole on the driver (ExecutorError once the FFN worker has ended, as every call)."""
        self.check_health()
        return self.driver.compute_logits(hidden)

    def shard_group(self) -> ParallelGroup | None:
        """The driver's model is not sharded."""
        return None

    def ffn_counts(self) -> list[FFNCounts]:
        """What each FFN worker has done so far (its forwards, micro-batches, time in MLPs and waiting), by rank."""
        self._send(FFNReport())
        return self._gather_answers(FFNCounts, _REPORT_TIMEOUT_S, "no FFN counts")
