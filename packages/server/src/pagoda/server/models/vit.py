"""The vision towers of the vision-language models: CLIP (Llava) and SigLIP (Gemma 3), in plain torch.

Both are pre-norm ViT encoders with the same layer (`layer_norm1`, `self_attn` of q/k/v/out projections with biases,
`layer_norm2`, `mlp` of fc1/fc2); they differ in their embeddings (CLIP adds a class token and has no patch bias)
and their norms (CLIP's `pre_layrnorm` before the encoder, SigLIP's `post_layernorm` after). Parameter names follow
transformers' `CLIPVisionModel` / `SiglipVisionModel`, so the checkpoints' `vision_tower.*` tensors load by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pagoda.server.models.layers import Linear
from torch import Tensor, nn
from transformers import PretrainedConfig


class VisionAttention(nn.Module):
    """Full (non-causal) multi-head self-attention over one image's patches."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        self.q_proj = Linear(hidden, hidden, bias=True, dtype=dtype, device=device)
        self.k_proj = Linear(hidden, hidden, bias=True, dtype=dtype, device=device)
        self.v_proj = Linear(hidden, hidden, bias=True, dtype=dtype, device=device)
        self.out_proj = Linear(hidden, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:  # [images, patches, hidden] -> [images, patches, hidden]
        """Every patch attends to every patch of its image."""
        batch, patches, hidden = x.shape
        shape = (batch, patches, self.num_heads, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        result: Tensor = self.out_proj(out.transpose(1, 2).reshape(batch, patches, hidden))
        return result


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), the activation named by `hidden_act` (quick_gelu, gelu, gelu_pytorch_tanh)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        # Imported here: transformers.activations takes 0.6 s, which a text model's start must not pay.
        from transformers.activations import ACT2FN

        self.act: Any = ACT2FN[config.hidden_act]  # transformers' own, for the same numerics
        self.fc1 = Linear(hidden, inner, bias=True, dtype=dtype, device=device)
        self.fc2 = Linear(inner, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden] -> [..., hidden]
        """The feed-forward block."""
        out: Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionEncoderLayer(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.self_attn = VisionAttention(config, dtype=dtype, device=device)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.mlp = VisionMLP(config, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:  # [images, patches, hidden] -> [images, patches, hidden]
        """One encoder block."""
        x = x + self.self_attn(self.layer_norm1(x))
        out: Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class VisionEncoder(nn.Module):
    """The first `num_layers` encoder layers (a tower whose later layers no feature reads keeps only these)."""

    def __init__(
        self, config: PretrainedConfig, num_layers: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(config, dtype=dtype, device=device) for _ in range(num_layers)
        )

    def forward(self, x: Tensor) -> list[Tensor]:  # [images, patches, hidden] -> num_layers + 1 of those
        """The hidden states entering the encoder and after each layer (transformers' `hidden_states`)."""
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return states


def unused_layer_weights(config: PretrainedConfig, kept: int, prefix: str) -> frozenset[str]:
    """Checkpoint names of the encoder layers from `kept` on, which the tower does not build."""
    suffixes = [
        f"{module}.{attr}"
        for module in (
            "layer_norm1",
            "layer_norm2",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        )
        for attr in ("weight", "bias")
    ]
    return frozenset(
        f"{prefix}encoder.layers.{i}.{suffix}"
        for i in range(kept, int(config.num_hidden_layers))
        for suffix in suffixes
    )


class ClipVisionEmbeddings(nn.Module):
    """Class token, patch convolution (no bias) and learned position embeddings."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, patch = int(config.hidden_size), int(config.patch_size)
        self.image_size = int(config.image_size)
        self.class_embedding = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.patch_embedding = nn.Conv2d(
            int(config.num_channels), hidden, patch, stride=patch, bias=False, dtype=dtype, device=device
        )
        num_positions = (self.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype, device=device)

    def forward(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, 1 + patches, hidden]
        """The embedded patches after the class token, positions added."""
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"image size {tuple(pixels.shape[-2:])} != the tower's {self.image_size}")
        patches = (
            self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        )
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        out: Tensor = torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]
        return out


class ClipVisionTower(nn.Module):
    """CLIP's vision model up to the last layer a feature reads (no post-norm: Llava reads hidden states)."""

    def __init__(
        self, config: PretrainedConfig, num_layers: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.embeddings = ClipVisionEmbeddings(config, dtype=dtype, device=device)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=float(config.layer_norm_eps), dtype=dtype, device=device)
        self.encoder = VisionEncoder(config, num_layers, dtype=dtype, device=device)

    def forward(
        self, pixels: Tensor
    ) -> list[Tensor]:  # [images, 3, H, W] -> [images, 1 + patches, hidden] each
        """transformers' `hidden_states`: the pre-normed embeddings, then each built layer's output."""
        states: list[Tensor] = self.encoder(self.pre_layrnorm(self.embeddings(pixels)))
        return states


class SiglipVisionEmbeddings(nn.Module):
    """Patch convolution (with bias) and learned position embeddings; no class token."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, patch = int(config.hidden_size), int(config.patch_size)
        self.image_size = int(config.image_size)
        self.patch_embedding = nn.Conv2d(
            int(config.num_channels), hidden, patch, stride=patch, bias=True, dtype=dtype, device=device
        )
        self.position_embedding = nn.Embedding(
            (self.image_size // patch) ** 2, hidden, dtype=dtype, device=device
        )

    def forward(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, patches, hidden]
        """The embedded patches, positions added."""
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"image size {tuple(pixels.shape[-2:])} != the tower's {self.image_size}")
        patches = (
            self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        )
        out: Tensor = patches + self.position_embedding.weight[None]
        return out


class SiglipVisionTower(nn.Module):
    """SigLIP's vision model without its pooling head: embeddings, encoder, post-layernorm."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.embeddings = SiglipVisionEmbeddings(config, dtype=dtype, device=device)
        self.encoder = VisionEncoder(config, int(config.num_hidden_layers), dtype=dtype, device=device)
        self.post_layernorm = nn.LayerNorm(
            hidden, eps=float(config.layer_norm_eps), dtype=dtype, device=device
        )

    def forward(self, pixels: Tensor) -> Tensor:  # [images, 3, H, W] -> [images, patches, hidden]
        """The last hidden state (post-normed)."""
        out: Tensor = self.post_layernorm(self.encoder(self.embeddings(pixels))[-1])
        return out
