"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch (see the server README, "LoRA").

`LoRARequest` names an adapter (importable without torch); `manager.LoRAManager` hooks the model's projections
and owns the slot pool and the CPU cache (`build.build_manager` makes one rank's); the engine's side (served
names, loading off the engine thread) is the engine extension `pagoda.server.engine.lora_extension.EngineLoRA`;
`peft_loader` reads PEFT folders; the batched op is `pagoda.pagedkernel.lora`.
"""

from pagoda.server.lora.request import AdapterRun, LoRAError, LoRARequest

__all__ = ["AdapterRun", "LoRAError", "LoRARequest"]
