"""Attention/FFN disaggregation: attention ranks 0..A-1 hold the KV cache and run attention, split over the heads
as tensor parallelism splits them (rank 0 is the engine's process, the driver); FFN ranks A..A+F-1 hold every
layer's MLP, split tensor-parallel among themselves when F > 1; activations cross every layer over
torch.distributed (gloo on the CPU, NCCL on CUDA), two micro-batches in ping-pong (engine/executor/afd_model.py,
afd_ffn.py).

The machinery is tensor parallelism's (distributed.py): the same worker program, launcher, CURVE-secured control
socket and process group, with the workers in the "afd_attention" and "ffn" roles. The driver keeps the
scheduler, the sampler, the embedding and the LM head (their vocabulary runs gathered from the attention ranks,
as under tensor parallelism); each step it sends the attention workers the step (`Execute`) as tensor parallelism
does, and each forward it announces the micro-batch sizes (and with LoRA every row's adapter) to the FFN workers
(`FFNForward`), then sends every FFN worker the MLP inputs; the first FFN worker sends every attention rank the
(all-reduced) outputs, point to point. A worker that dies fails the next exchange at once (its sockets close), a
wedged one after the group's timeout: the engine gets an ExecutorError naming it, never a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.afd_config import FLAG, AttentionFFNConfig
from pagoda.server.config import EngineConfig
from pagoda.server.engine.executor.afd_model import (
    ATTENTION_GROUP_PREFIX,
    AFDForward,
    AFDRanks,
    UnsupportedModelError,
    attention_side,
    check_model,
    split_model,
)
from pagoda.server.engine.executor.comm import ProcessGroupCollectives
from pagoda.server.engine.executor.distributed import DistributedExecutor, model_folder
from pagoda.server.engine.executor.messages import (
    ComputeLogits,
    Execute,
    FFNCounts,
    FFNForward,
    FFNReport,
    WorkerRole,
)
from pagoda.server.engine.model_runner import PromptHidden
from pagoda.server.engine.setup import (
    EngineConfigError,
    EngineParts,
    Placement,
    build_parts,
    select_device,
    with_lora,
)
from pagoda.server.lora.request import AdapterRun
from pagoda.server.models.parallel import ParallelGroup
from torch import Tensor
from transformers import AutoConfig

logger = logging.getLogger("pagoda.engine")
_REPORT_TIMEOUT_S = 30.0


def _ranks(config: EngineConfig) -> AFDRanks:
    """The AFD ranks of an engine config that asks for them."""
    afd = config.parallel_config.attention_ffn_disaggregation
    assert afd is not None
    return AFDRanks.of(afd)


def check_gpus(afd: AttentionFFNConfig, visible: int) -> None:
    """ValueError naming the flag when local workers on CUDA, one GPU each (rank r on GPU r), would need more GPUs
    than the `visible` ones."""
    ranks = afd.attention_workers + afd.ffn_workers
    if ranks > visible:
        raise ValueError(
            f"{FLAG} asks for {afd.attention_workers} attention + {afd.ffn_workers} FFN ranks, one GPU each, but "
            f"{visible} GPU(s) are visible; choose counts that sum to at most {visible}, or place the workers "
            "with --distributed-executor-backend ray"
        )


def check_launch(config: EngineConfig, folder: Path) -> None:
    """ValueError naming the flag for what the model's config or this machine refuses of the asked workers,
    before any weight loads: layers or heads that do not split over them, or too few GPUs for local workers."""
    afd = config.parallel_config.attention_ffn_disaggregation
    if afd is None:
        return
    check_model(AutoConfig.from_pretrained(folder), afd)
    local = config.parallel_config.distributed_executor_backend == "mp"
    if local and select_device(config).type == "cuda":
        check_gpus(afd, torch.cuda.device_count())


class AFDExecutor(DistributedExecutor):
    """Ranks 0..A-1 run attention (and hold the KV cache), ranks A..A+F-1 the MLPs; see the module docstring."""

    afd: AFDForward
    ranks: AFDRanks

    @classmethod
    def launch(cls, config: EngineConfig) -> tuple[DistributedExecutor, EngineParts]:
        """Start the attention and FFN workers beside the driver's model (its MLPs dropped), install the split
        forward."""
        ranks = _ranks(config)
        folder = model_folder(config)
        try:  # the CLI checked this before any load (exit 2); LLM(...) gets it here, before any worker starts
            check_launch(config, folder)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        attention: list[WorkerRole] = ["afd_attention"] * (ranks.attention - 1)
        ffn: list[WorkerRole] = ["ffn"] * ranks.ffn
        roles = attention + ffn
        executor, parts = cls.start(config, folder, roles)
        executor.ranks = ranks
        executor.afd = AFDForward(parts.model, executor.group, ranks, executor.announce, parts.lora)
        executor.driver.forward = executor.afd
        executor.driver.hooks = (*executor.driver.hooks, executor.afd)  # after LoRA's: the step is slotted
        logger.info(
            "attention/FFN disaggregation: attention on %d rank(s) (this process first), the MLPs on %d FFN "
            "rank(s); two micro-batches in ping-pong",
            ranks.attention,
            ranks.ffn,
        )
        return executor, parts

    @classmethod
    def shard_of(
        cls, config: EngineConfig, world: ProcessGroupCollectives
    ) -> tuple[ProcessGroupCollectives | None, str]:
        """The attention ranks' group (None with one attention rank: the driver's model is whole)."""
        ranks = _ranks(config)
        if ranks.attention == 1:
            return None, ""
        return ProcessGroupCollectives(0, ranks.attention), ATTENTION_GROUP_PREFIX

    @classmethod
    def driver_parts(
        cls, config: EngineConfig, group: ProcessGroupCollectives | None, placement: Placement
    ) -> EngineParts:
        """Attention rank 0's shard (the whole model with one attention rank) with its LoRA slots, its MLPs then
        dropped; the KV cache."""
        parts = with_lora(config, build_parts(config, group, placement))
        try:
            split_model(parts.model)
        except UnsupportedModelError as exc:
            raise EngineConfigError(str(exc)) from exc
        attention_side(parts.model, parts.lora)
        return parts

    def _attention_workers(self) -> range:
        """The ranks of the attention workers (none with one attention rank)."""
        return range(1, self.ranks.attention)

    def announce(self, num_tokens: tuple[int, ...], adapters: tuple[tuple[AdapterRun, ...], ...]) -> None:
        """Tell the FFN workers a forward of micro-batches of these many tokens comes next (with LoRA: the step's
        adapters and each micro-batch's chunks', for their MLP projections' hooks)."""
        lora = self.lora
        loras = () if lora is None else lora.requests_for([run for part in adapters for run in part])
        self._send(FFNForward(num_tokens, loras, adapters), self.ranks.ffn_ranks())

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[Tensor, dict[str, PromptHidden]]:  # ([num_rows, vocab], request id -> prompt hidden states)
        """Send the step to the attention workers; the driver's step, whose forward (if the step has one)
        exchanges the MLPs with the FFN workers."""
        self.check_health()
        lora = self.lora
        if self.ranks.attention > 1:
            loras = () if lora is None else lora.requests_for(output.scheduled)
            self._send(Execute(output, loras), self._attention_workers())
        self.steps += 1
        try:
            return self.driver.execute(output, prompt_lens)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [num_rows, vocab] from [num_rows, hidden_size]
        """The LM head: whole on the driver with one attention rank, else over the attention ranks' vocabulary
        runs as under tensor parallelism (ExecutorError once a worker has ended, as every call)."""
        self.check_health()
        shard = self.shard
        if shard is None:
            return self.driver.compute_logits(hidden)
        self._send(ComputeLogits(hidden.shape[0], hidden.shape[1]), self._attention_workers())
        try:
            return self.driver.compute_logits(shard.broadcast(hidden.contiguous()))
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def collective_seconds(self) -> float:
        """Wall time the driver spent in the activations' exchange and the attention ranks' collectives."""
        return self.group.seconds + (0.0 if self.shard is None else self.shard.seconds)

    def shard_group(self) -> ParallelGroup | None:
        """The attention ranks' group (None with one attention rank: the driver's model is whole)."""
        return self.shard

    def ffn_counts(self) -> list[FFNCounts]:
        """What each FFN worker has done so far (its forwards, micro-batches, time in MLPs and waiting), by rank."""
        ranks = self.ranks.ffn_ranks()
        self._send(FFNReport(), ranks)
        return self._gather_answers(FFNCounts, _REPORT_TIMEOUT_S, "no FFN counts", ranks)
