"""The vision transformers of Qwen2-VL and Qwen2.5-VL, in plain torch, with the checkpoint's parameter names.

An image arrives as its processor patches: [grid_t * grid_h * grid_w, C * T * P * P], rows laid out block-major
over `spatial_merge_size` x `spatial_merge_size` blocks (the image processor's order). A linear map over each
flattened patch (the checkpoint's Conv3d, whose stride equals its kernel), blocks of bidirectional attention
restricted to each image (2-D rotary over the patch's row and column), then the merger concatenates each block of
merge^2 patches into one language-model embedding. Qwen2-VL: LayerNorm + QuickGELU MLP blocks. Qwen2.5-VL:
RMSNorm + SwiGLU blocks, attention within windows of `window_size` pixels except in `fullatt_block_indexes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from pagoda.server.models.layers import Linear, MergedLinear, RMSNorm
from torch import Tensor, nn
from transformers import PretrainedConfig

Grid = tuple[int, int, int]  # (temporal, height, width) patches of one image
_EPS = 1e-6  # every norm of both towers


def _empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised storage: the loader fills every parameter."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _activation(x: Tensor, name: str) -> Tensor:
    """transformers' ACT2FN[name] for the activations these towers use."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    raise NotImplementedError(f"vision hidden_act {name!r} is not supported")


def patch_positions(grid: Grid, merge: int) -> Tensor:  # int64 [t * h * w, 2]: (row, column) of each patch
    """Each patch's row and column, in the processor's block-major order (merge x merge blocks)."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(1, 2).flatten()
    cols = cols.reshape(block).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_order(grid: Grid, merge: int, window: int) -> tuple[Tensor, list[int]]:
    """Qwen2.5-VL's windows of one image: the merged units (int64 [t * h * w / merge^2]) in window order, and
    each non-empty window's size in merged units; `window` is the side of a window in merged units."""
    t, h, w = grid
    lh, lw = h // merge, w // merge
    units = torch.arange(t * lh * lw).reshape(t, lh, lw)
    order: list[Tensor] = []
    sizes: list[int] = []
    for frame in range(t):
        for top in range(0, lh, window):
            for left in range(0, lw, window):
                cell = units[frame, top : top + window, left : left + window].flatten()
                order.append(cell)
                sizes.append(int(cell.numel()))
    return torch.cat(order), sizes


class LayerNorm(nn.Module):
    """LayerNorm with a bias (Qwen2-VL's vision norms), uninitialised until loaded."""

    def __init__(self, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_parameter(dim, dtype=dtype, device=device)
        self.bias = _empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:  # [..., dim] -> [..., dim]
        """(x - mean) / std * weight + bias."""
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, _EPS)


class PatchProjection(nn.Module):
    """The checkpoint's Conv3d weight [embed, C, T, P, P] (named `proj.weight`), applied as one linear map."""

    def __init__(
        self, embed: int, patch_dims: tuple[int, int, int, int], *, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.weight = _empty_parameter(embed, *patch_dims, dtype=dtype, device=device)

    def forward(self, patches: Tensor) -> Tensor:  # [num_patches, C * T * P * P] -> [num_patches, embed]
        """Each flattened patch times the kernel: a Conv3d whose stride is its kernel size."""
        weight = self.weight.reshape(self.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight)


class PatchEmbed(nn.Module):
    """`patch_embed.proj`: flattened patches to the tower's width."""

    def __init__(self, config: PretrainedConfig, embed: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        dims = (
            int(config.in_channels),
            int(config.temporal_patch_size),
            int(config.patch_size),
            int(config.patch_size),
        )
        self.proj = PatchProjection(embed, dims, dtype=dtype, device=device)

    def forward(self, patches: Tensor) -> Tensor:  # [num_patches, C * T * P * P] -> [num_patches, embed]
        """The patch embeddings."""
        out: Tensor = self.proj(patches)
        return out


def _rotate_half(x: Tensor) -> Tensor:  # [..., d] -> [..., d]
    """(-x2, x1) of the halves x1, x2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each segment (an image, or a window of one), 2-D rotary."""

    def __init__(self, dim: int, num_heads: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True, dtype=dtype, device=device)
        self.proj = Linear(dim, dim, bias=True, dtype=dtype, device=device)

    def forward(
        self,
        x: Tensor,  # [num_patches, dim]
        cos: Tensor,  # float32 [num_patches, head_dim]
        sin: Tensor,  # float32 [num_patches, head_dim]
        segments: Sequence[int],  # consecutive segment lengths, summing to num_patches
    ) -> Tensor:  # [num_patches, dim]
        """Each patch's attention over the patches of its segment."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotated in float32 and cast back, as transformers does.
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        outs = [
            F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            for qs, ks, vs in zip(
                q.split(list(segments)), k.split(list(segments)), v.split(list(segments)), strict=True
            )
        ]
        out: Tensor = self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))
        return out


class Qwen2VisionMLP(nn.Module):
    """fc2(act(fc1(x))): Qwen2-VL's block MLP."""

    def __init__(self, dim: int, inner: int, act: str, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.fc1 = Linear(dim, inner, bias=True, dtype=dtype, device=device)
        self.fc2 = Linear(inner, dim, bias=True, dtype=dtype, device=device)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:  # [n, dim] -> [n, dim]
        """The MLP."""
        out: Tensor = self.fc2(_activation(self.fc1(x), self.act))
        return out


class Qwen2_5VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with biases, gate and up fused (checkpoint gate_proj / up_proj)."""

    def __init__(self, dim: int, inner: int, act: str, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(dim, [inner, inner], bias=True, dtype=dtype, device=device)
        self.down_proj = Linear(inner, dim, bias=True, dtype=dtype, device=device)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:  # [n, dim] -> [n, dim]
        """The gated MLP."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: Tensor = self.down_proj(_activation(gate, self.act) * up)
        return out


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1: nn.Module
        self.norm2: nn.Module
        self.mlp: nn.Module
        act = str(config.hidden_act)
        if config.model_type == "qwen2_vl_vision":
            dim = int(config.embed_dim)
            self.norm1 = LayerNorm(dim, dtype=dtype, device=device)
            self.norm2 = LayerNorm(dim, dtype=dtype, device=device)
            inner = int(dim * config.mlp_ratio)
            self.mlp = Qwen2VisionMLP(dim, inner, act, dtype=dtype, device=device)
        else:
            dim = int(config.hidden_size)
            self.norm1 = RMSNorm(dim, _EPS, unit_offset=False, dtype=dtype, device=device)
            self.norm2 = RMSNorm(dim, _EPS, unit_offset=False, dtype=dtype, device=device)
            self.mlp = Qwen2_5VisionMLP(dim, int(config.intermediate_size), act, dtype=dtype, device=device)
        self.attn = VisionAttention(dim, int(config.num_heads), dtype=dtype, device=device)

    def forward(
        self,
        x: Tensor,  # [num_patches, dim]
        cos: Tensor,  # float32 [num_patches, head_dim]
        sin: Tensor,  # float32 [num_patches, head_dim]
        segments: Sequence[int],
    ) -> Tensor:  # [num_patches, dim]
        """One block."""
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merge x merge block, then Linear-GELU-Linear to the LM's width."""

    def __init__(
        self, config: PretrainedConfig, dim: int, out_dim: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.hidden = dim * int(config.spatial_merge_size) ** 2
        self.ln_q: nn.Module
        if config.model_type == "qwen2_vl_vision":
            self.ln_q = LayerNorm(dim, dtype=dtype, device=device)
        else:
            self.ln_q = RMSNorm(dim, _EPS, unit_offset=False, dtype=dtype, device=device)
        self.mlp = nn.Sequential(
            Linear(self.hidden, self.hidden, bias=True, dtype=dtype, device=device),
            nn.GELU(),
            Linear(self.hidden, out_dim, bias=True, dtype=dtype, device=device),
        )

    def forward(self, x: Tensor) -> Tensor:  # [num_patches, dim] -> [num_patches / merge^2, out_dim]
        """The merged embeddings, one per block of merge^2 consecutive patches."""
        out: Tensor = self.mlp(self.ln_q(x).view(-1, self.hidden))
        return out


class QwenVisionTransformer(nn.Module):
    """Qwen2-VL's or Qwen2.5-VL's vision tower (chosen by the vision config's model_type): patches in, LM
    embeddings out."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        qwen2 = config.model_type == "qwen2_vl_vision"
        dim = int(config.embed_dim if qwen2 else config.hidden_size)
        out_dim = int(config.hidden_size if qwen2 else config.out_hidden_size)
        self.merge = int(config.spatial_merge_size)
        # Qwen2.5-VL: window side in merged units, and the blocks that attend over the whole image.
        self.window: int | None = None
        self.full_blocks: frozenset[int] = frozenset(range(int(config.depth)))
        if not qwen2:
            self.window = int(config.window_size) // self.merge // int(config.patch_size)
            self.full_blocks = frozenset(int(i) for i in config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config, dim, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            VisionBlock(config, dtype=dtype, device=device) for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, dim, out_dim, dtype=dtype, device=device)
        head_dim = dim // int(config.num_heads)
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        # A quarter of the head per axis (row, column), each pair rotated by one frequency.
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        self.inv_freq: Tensor  # float32 [head_dim // 4]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        patches: Tensor,  # [num_patches, C * T * P * P], the images' patches one after another
        grids: Sequence[Grid],  # each image's (t, h, w) patch grid
    ) -> Tensor:  # [num_patches / merge^2, out_dim]
        """The LM embeddings of every image's merged patches, in the images' order."""
        x = self.patch_embed(patches)
        positions = torch.cat([patch_positions(g, self.merge) for g in grids]).to(x.device)
        freqs = positions[..., None].float() * self.inv_freq  # [n, 2, head_dim // 4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [n, head_dim // 2]: rows, then columns
        angles = torch.cat([half, half], dim=-1)  # [n, head_dim]
        cos, sin = angles.cos(), angles.sin()
        # One segment per frame of each image (transformers' cu_seqlens).
        full = [h * w for t, h, w in grids for _ in range(t)]
        windows = full
        order: Tensor | None = None
        if self.window is not None:
            parts, windows, offset = [], [], 0
            for grid in grids:
                index, sizes = window_order(grid, self.merge, self.window)
                parts.append(index + offset)
                windows += [size * self.merge**2 for size in sizes]
                offset += int(index.numel())
            order = torch.cat(parts).to(x.device)
            x, cos, sin = (self._by_unit(t, order) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full_blocks else windows)
        merged: Tensor = self.merger(x)
        if order is not None:  # back to the image's block-major order
            merged = merged[torch.argsort(order)]
        return merged

    def _by_unit(self, x: Tensor, order: Tensor) -> Tensor:  # [n, d] -> [n, d]
        """Rows of `x` regrouped by merged unit (merge^2 consecutive rows each) in `order`."""
        unit = self.merge**2
        return x.reshape(x.shape[0] // unit, unit, -1)[order].reshape(x.shape[0], -1)
