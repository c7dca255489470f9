"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch (see the server README, "LoRA").

`LoRARequest` names an adapter (importable without torch); `manager.LoRAManager` hooks the model's projections
and owns the slot pool and the CPU cache; `engine_lora.EngineLoRA` is the engine's side (served names, loading
off the engine thread); `peft_loader` reads PEFT folders; the batched op is `pagoda.pagedkernel.lora`.
"""

from pagoda.server.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
