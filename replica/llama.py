"""Our Llama-family forward pass (Llama 2/3, Mistral, Qwen2/3, SmolLM) over a flattened varlen batch.

Inputs are the concatenated new tokens of every scheduled sequence and their positions; attention reads
and writes the paged KV cache through ``kernels`` using the step's ``ForwardContext``. Sliding-window
layers (Mistral, and hybrid configs whose ``layer_types`` mix local and global layers) pass their window
to the kernels. Numerics follow
Hugging Face's implementation (fp32 RMSNorm, rotate-half RoPE from transformers' own RoPE initialisers,
so Llama-3 / linear / YaRN scaling come for free) so greedy output matches it token for token.

Q/K/V and gate/up projections are fused into one matmul each at load time: one GEMM instead of three
(two) per layer is the largest single saving of a step on CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvmesh.replica.context import get_context
from kvmesh.replica.lora_weights import ProjectionShapes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), read as transformers reads the config.

    Configs with ``layer_types`` (Qwen2/3, and hybrids that alternate local and global layers, Gemma-2
    style) name each layer; Mistral applies ``sliding_window`` to every layer.
    """
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window if config.model_type == "mistral" else None] * config.num_hidden_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_context().kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may overwrite both inputs (``kernels/layers.py``)."""
        return get_context().kernels.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, indexed per token."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # Built on the CPU explicitly: the model skeleton is created on the meta device (no random init).
        cpu = torch.device("cpu")
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=cpu) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE changes with sequence length and is not supported")
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu)
        freqs = torch.arange(max_positions, dtype=torch.float, device=cpu)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``/``k`` rotated; may rotate them in place (``kernels/layers.py``)."""
        return get_context().kernels.rotary(q, k, self.cos, self.sin, positions)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = self.k_norm = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.window = layer_windows(config)[layer_idx]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, ctx = x.shape[0], get_context()
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer_idx, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        kv = ctx.kv_caches[self.layer_idx]
        if kv.rotation is not None:  # an int4 cache holds V rotated: the output is rotated back
            v = v @ kv.rotation
        tails = {} if kv.k_tail is None else {"plan": ctx.tails, "tail": kv.k_tail}
        ctx.kernels.store_kv(k, v, kv.k, kv.v, ctx.attn.slot_mapping, kv.k_scale, kv.v_scale, **tails)
        o = ctx.kernels.paged_attention(
            q, kv.k, kv.v, ctx.attn, self.scale, k_scale=kv.k_scale, v_scale=kv.v_scale, window=self.window
        )
        if kv.rotation is not None:
            o = o @ kv.rotation.T
        o = o.reshape(n, self.q_size)
        out = self.o_proj(o)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer_idx, "o", o, out)
        return out


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.lora is None:
            return self.down_proj(ctx.kernels.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        ctx.lora.apply(self.layer_idx, "gate_up", x, gate_up)
        h = ctx.kernels.silu_and_mul(gate_up)
        out = self.down_proj(h)
        ctx.lora.apply(self.layer_idx, "down", h, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = MLP(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream, kept apart so each residual add is fused into the
        next norm: ``x + residual`` is the stream after this layer (``residual`` None: ``x`` is the
        embedding)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add(x, residual)
        x, residual = self.post_attention_layernorm.add(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        self.config = config
        attn_head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, attn_head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) at ``logits_indices`` only: the other positions are never sampled."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm.add(x[logits_indices], residual[logits_indices])
        return self.lm_head(x).float()

    def lora_shapes(self) -> ProjectionShapes:
        """Each LoRA-targetable module's (in, out) widths, as PEFT names them: what an adapter must match."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        hidden, inter = self.config.hidden_size, mlp.down_proj.in_features
        shapes = {"q_proj": (hidden, attn.q_size), "k_proj": (hidden, attn.kv_size), "v_proj": (hidden, attn.kv_size)}
        shapes |= {"o_proj": (attn.q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
        shapes["down_proj"] = (inter, hidden)
        return ProjectionShapes(shapes, len(self.layers))

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict, fusing q/k/v and gate/up into our combined projections."""
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                parts = [weights.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
                if parts[0] is not None:
                    fused[f"layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat(parts)
                parts = [weights.pop(f"{p}mlp.{n}_proj.{kind}", None) for n in ("gate", "up")]
                if parts[0] is not None:
                    fused[f"layers.{i}.mlp.gate_up_proj.{kind}"] = torch.cat(parts)
        for name, tensor in weights.items():
            fused[name.removeprefix("model.")] = tensor
        if getattr(self.config, "tie_word_embeddings", False):
            fused.pop("lm_head.weight", None)
            fused["lm_head.weight"] = fused["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(fused, strict=False, assign=True)
        missing = [m for m in missing if not m.endswith(("rotary.cos", "rotary.sin"))]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
