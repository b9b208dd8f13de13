"""`LoRARequest`: which adapter a request is served with (vLLM's type, field for field).

No JAX here: front ends build it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to serve a request with, as vLLM names it:
    `LoRARequest(lora_name, lora_int_id, lora_path)`.

    `lora_int_id` (a positive integer) is the adapter's identity in the engine: two
    requests with the same id use the same adapter, so an id names one directory
    for as long as the engine knows it (`LLMEngine.remove_lora` forgets it).
    `lora_path` is a local directory holding PEFT's `adapter_config.json` and
    `adapter_model.safetensors`. `name`, `id` and `path` read the same fields (and
    `adapter_id`, as vLLM's)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        i = self.lora_int_id
        if not isinstance(i, int) or isinstance(i, bool) or i < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {i!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path must be the adapter's directory, got {self.lora_path!r} "
                f"(adapter {self.lora_name!r})"
            )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
