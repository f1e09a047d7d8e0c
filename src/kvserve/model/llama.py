"""Llama-family forward (RMSNorm, RoPE, GQA, SwiGLU) over one flat batch of tokens from many sequences.

No nn.Module: weights are plain tensors prepared once (q/k/v and gate/up fused into single matmuls,
stored transposed as [in, out] because `x @ w` streams that layout faster on CPU: 15.7 vs 11.6 GB/s for
one-token decode, and no slower for batches or prefill (benchmarks in the git history of this file),
and the forward is a short loop over layers. The per-step context (slots, block tables) arrives as
an `AttentionMetadata` argument.

The hot ops go through a `Kernels` object (native C++ or the torch reference): quantized projections
(`QuantWeight`, GGUF blocks kept as stored; with int8 activations on AVX-512 pre-arranged once for that
kernel, `PackedI8Weight`) run in the native matmul, RMSNorm is fused with the residual
add, and decode attention reads the pool in place; RoPE + the KV write and SwiGLU are one fused call each.
A step the native layer loop covers (`layer_loop.py`: quantized weights, float32, no LoRA, up to 512 rows
of decodes and prefill chunks, 4,096 with int8 activations or in a server, which pins glibc's mmap
threshold) runs every layer in one C call instead of this loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.kernels.bf16pack import PackedBf16Weight
from kvserve.kernels.i8pack import PackedI8Weight
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import QuantWeight, concat_rows
from kvserve.kv.attention import AttentionMetadata, paged_attention
from kvserve.kv.pool import KVPool
from kvserve.model.config import ModelConfig, rope_inv_freq
from kvserve.model.layer_loop import PROJECTIONS, LayerLoop

Weight = torch.Tensor | QuantWeight | PackedI8Weight  # packed: int8-path projections only (kernels/i8pack.py)

if TYPE_CHECKING:
    from kvserve.lora.batch import LayerLoRA, LoRABatch

SMALL_BATCH_ROWS = 4  # up to this many rows the transposed head wins; beyond it F.linear's GEMM does


@dataclass(slots=True)
class LayerWeights:
    """One layer's weights; dense projections transposed to [in, out], quantized ones as stored [out, in]."""

    input_norm: torch.Tensor
    qkv_proj: Weight  # [hidden, (heads + 2 * kv_heads) * head_dim]
    o_proj: Weight  # [heads * head_dim, hidden]
    post_attention_norm: torch.Tensor
    gate_up_proj: Weight  # [hidden, 2 * intermediate]
    down_proj: Weight  # [intermediate, hidden]
    # `--prefill-dtype bfloat16` on the native kernels: PROJECTIONS' bf16 tiles for prefill rows (bf16pack.py)
    prefill_bf16: dict[str, PackedBf16Weight] | None = None

    def prefill_tiles(self, name: str) -> PackedBf16Weight | None:
        """Projection `name`'s bf16 tiles, or None (no bf16 prefill here, or its torch twin)."""
        return self.prefill_bf16[name] if self.prefill_bf16 is not None else None


class LlamaModel:
    """A Llama causal LM that reads and writes a paged `KVPool`."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, Weight], dtype: torch.dtype, device: str = "cpu",
        kernels: Kernels | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels or Kernels.create("torch")
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.layers = [self._layer_weights(weights, i) for i in range(config.num_layers)]
        self.embed_tokens = self._param(weights, "model.embed_tokens.weight")
        self.final_norm = self._param(weights, "model.norm.weight")
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = self._param(weights, "lm_head.weight")
        else:
            self.lm_head = self.embed_tokens
        self.rope_cos, self.rope_sin = _rope_tables(config, self.device)
        # fp32 on CPU: a vector times the [hidden, vocab] layout streams the 49k-row head about twice as
        # fast as F.linear's [vocab, hidden] path (measured: 5.7 vs 10.9 ms per decode step on 2 threads).
        dense_head = isinstance(self.lm_head, torch.Tensor) and dtype == torch.float32 and self.device.type == "cpu"
        self.lm_head_t = self.lm_head.t().contiguous() if dense_head else None
        # int8 activations on AVX-512: the projections (read by the int8 matmul only) replaced by their packed
        # layout; the head packed beside its GGUF blocks when the embedding lookup shares them (tied).
        # The tiles' bf16 copies (CPU only; elsewhere the twin runs on the device), before the int8 packing
        if self.kernels.bf16_prefill and self.kernels.native is not None and self.device.type == "cpu":
            for layer in self.layers:
                layer.prefill_bf16 = {name: self.kernels.prepare_bf16(getattr(layer, name)) for name in PROJECTIONS}
        self.lm_head_i8 = None
        if self.kernels.packs_int8() and self.device.type == "cpu":
            for layer in self.layers:
                for name in PROJECTIONS:
                    weight = getattr(layer, name)
                    if isinstance(weight, QuantWeight):
                        setattr(layer, name, self.kernels.prepare_int8(weight))
            if isinstance(self.lm_head, QuantWeight):
                self.lm_head_i8 = self.kernels.prepare_int8(self.lm_head)
        self.layer_loop = LayerLoop.build(self)  # None: every step runs the Python loop

    def _param(self, weights: dict[str, Weight], name: str) -> Weight:
        if name not in weights:
            raise ValueError(f"model weights are missing tensor {name!r}")
        weight = weights[name]
        if isinstance(weight, QuantWeight):
            if self.device.type == "cpu":
                return weight
            weight = self.kernels.dequantize(weight)
        return weight.to(device=self.device, dtype=self.dtype).contiguous()

    def _layer_weights(self, weights: dict[str, Weight], index: int) -> LayerWeights:
        prefix = f"model.layers.{index}."

        def transposed(*names: str) -> Weight:
            parts = [self._param(weights, prefix + name) for name in names]
            if all(isinstance(part, QuantWeight) for part in parts) and (fused := concat_rows(parts)):
                return fused
            dense = [self._dense(part) for part in parts]
            return torch.cat(dense, dim=0).t().contiguous()

        return LayerWeights(
            input_norm=self._param(weights, prefix + "input_layernorm.weight"),
            qkv_proj=transposed("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            o_proj=transposed("self_attn.o_proj.weight"),
            post_attention_norm=self._param(weights, prefix + "post_attention_layernorm.weight"),
            gate_up_proj=transposed("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            down_proj=transposed("mlp.down_proj.weight"),
        )

    def _dense(self, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight
        return self.kernels.dequantize(weight).to(device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: KVPool, meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``; `lora`: the step's adapters."""
        key_blocks = kv_pool.tensor[0, 0]
        loop = self.layer_loop
        if lora is None and loop is not None and loop.applies(input_ids.shape[0], key_blocks, meta):
            return loop.forward(input_ids, positions, kv_pool, meta)
        kernels, eps = self.kernels, self.config.rms_norm_eps
        # bf16 prefill: rows from here on (the prefill chunks', after the decode rows) run bf16 x bf16 matmuls
        split = meta.num_decodes if kernels.bf16_prefill and meta.prefills else None
        # Each norm also adds the previous sub-layer's output into the residual stream (HF's order).
        residual = kernels.embedding(input_ids, self.embed_tokens).to(self.dtype)
        delta = None
        for index, layer in enumerate(self.layers):
            key_blocks, value_blocks = kv_pool.layer(index)
            layer_lora = lora.for_layer(index) if lora is not None else None  # LoRA hook
            normed, residual = kernels.rms_norm(residual, layer.input_norm, eps, delta)
            attended = self._attention(normed, layer, positions, key_blocks, value_blocks, meta, layer_lora, split)
            normed, residual = kernels.rms_norm(attended, layer.post_attention_norm, eps, residual)
            delta = self._mlp(normed, layer, layer_lora, split)
        return kernels.rms_norm(delta, self.final_norm, eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` on the CPU, where the sampler's per-request generators live."""
        if isinstance(self.lm_head, QuantWeight):  # packed beside it for the int8 path where that applies
            head = self.lm_head if self.lm_head_i8 is None else self.lm_head_i8
            return self.kernels.linear(hidden.float(), head).cpu()
        if self.lm_head_t is not None and hidden.shape[0] <= SMALL_BATCH_ROWS:
            return (hidden @ self.lm_head_t).cpu()
        return F.linear(hidden, self.lm_head).float().cpu()

    def _attention(
        self, normed: torch.Tensor, layer: LayerWeights, positions: torch.Tensor,
        key_blocks: torch.Tensor, value_blocks: torch.Tensor, meta: AttentionMetadata,
        lora: LayerLoRA | None = None, split: int | None = None,
    ) -> torch.Tensor:
        config = self.config
        qkv = self._linear(normed, layer, "qkv_proj", split)
        if lora is not None:  # LoRA hook: per-adapter low-rank update after the base matmul
            lora.add(qkv, normed, "qkv")
        queries = self.kernels.rope_kv_write(
            qkv, config.num_heads, config.num_kv_heads, positions, self.rope_cos, self.rope_sin, key_blocks,
            value_blocks, meta.slot_mapping,
        )
        attended = paged_attention(
            queries, None, None, key_blocks, value_blocks, meta, self.scale, kernels=self.kernels, kv_written=True
        )
        out = self._linear(attended, layer, "o_proj", split)
        if lora is not None:  # LoRA hook
            lora.add(out, attended, "o")
        return out

    def _mlp(
        self, normed: torch.Tensor, layer: LayerWeights, lora: LayerLoRA | None = None, split: int | None = None
    ) -> torch.Tensor:
        gate_up = self._linear(normed, layer, "gate_up_proj", split)
        if lora is not None:  # LoRA hook
            lora.add(gate_up, normed, "gate_up")
        activated = self.kernels.swiglu(gate_up)
        out = self._linear(activated, layer, "down_proj", split)
        if lora is not None:  # LoRA hook
            lora.add(out, activated, "down")
        return out

    def _linear(self, x: torch.Tensor, layer: LayerWeights, name: str, split: int | None) -> torch.Tensor:
        """Projection `name` of `x`; with a `split` (bf16 prefill), rows from it on as bf16 x bf16 products."""
        weight = getattr(layer, name)
        if split is None or split >= x.shape[0]:
            return self.kernels.linear(x, weight)
        tail = self.kernels.linear_prefill(x[split:], weight, layer.prefill_tiles(name))
        return tail if split == 0 else torch.cat([self.kernels.linear(x[:split], weight), tail])


def _rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, ``[max_positions, head_dim]`` in float32 (HF's rotate-half layout)."""
    inv_freq = rope_inv_freq(config).to(device)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()

