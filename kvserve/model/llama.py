"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral) over a paged KV cache.

Module and parameter names mirror HF Transformers (``model.layers.N.self_attn...``) except for the fused
projections: ``qkv_proj`` holds q_proj/k_proj/v_proj and ``mlp.gate_up_proj`` holds gate_proj/up_proj.
Differences between the families are flags of `ArchConfig` (qkv bias, q/k norm, tied embeddings, RoPE
scaling, which layers' MLP is a mixture of experts: `layers.moe`), so the registered classes share this one
implementation. A mixture-of-experts layer's MLP is ``mlp`` for both MoE families (Mixtral's checkpoints name it
``block_sparse_moe``), holding ``gate`` (the router) and ``experts.w13`` / ``experts.w2`` (every expert's
weights stacked); Qwen2-MoE's also ``shared_expert`` (a dense MLP, ``gate_up_proj`` / ``down_proj`` as above) and
``shared_expert_gate``.

Numerics follow HF's op order so float32 outputs match HF's: RMSNorm in float32 then cast, residual adds
in the model dtype, RoPE from an HF-identical float32 table, attention scaled by head_dim ** -0.5.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Hashable, Iterable

import torch
from torch import nn

from kvserve import distributed
from kvserve.kernels import ops
from kvserve.layers.activation import SiluAndMul, get_act_and_mul
from kvserve.layers.attention import Attention
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.layers.embedding import LMHead, VocabEmbedding
from kvserve.layers.linear import Linear, MergedLinear, QKVLinear
from kvserve.layers.moe import FUSED, FUSED_GATE, FUSED_UP, SparseMoeBlock, covered_shards
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.model.arch import ArchConfig
from kvserve.model.paths import ModelLoadError
from kvserve.model.registry import CausalLM

logger = logging.getLogger(__name__)

# (fused parameter, checkpoint name part, shard id): checkpoint `...self_attn.q_proj.weight` is shard "q"
# of `...self_attn.qkv_proj.weight`.
_STACKED_PARAMS: tuple[tuple[str, str, Hashable], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# Checkpoint entries that are not parameters (old HF checkpoints saved the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# fp8 checkpoints' static activation scales (FBGEMM's upper bound on them): not read, since activations are
# quantized per token at run time (`layers.quantization`).
_FP8_ACTIVATION_SUFFIXES = (".input_scale", ".input_scale_ub")
# Per-layer KV-cache scales, as checkpoints exported for vLLM's fp8 KV cache carry them, under the names vLLM
# reads: `self_attn.k_scale` / `v_scale` (llm-compressor, AutoFP8), one `kv_scale` for both (older exports),
# ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`, `qkv_proj.k_scale` / `v_scale`, and compressed-tensors' (and
# Quark's) `k_proj.output_scale` / `v_proj.output_scale`. Suffix of `model.layers.N.` -> what it scales: "k",
# "v" or "kv" (both). They go to the layer's `Attention.checkpoint_kv_scales`.
_KV_SCALE_NAMES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.kv_scale": "kv",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.qkv_proj.k_scale": "k",
    "self_attn.qkv_proj.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
}
# The tensors of an AWQ / GPTQ layer (`layers.quantization`), none of which a dense model has.
_PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
# Rows of a tied checkpoint's lm_head.weight compared with the embedding's (`load_weights`).
_TIED_ROWS_COMPARED = 8
_LAYER_PREFIX = re.compile(r"model\.layers\.(\d+)\.(.+)")
# A mixture-of-experts layer's checkpoint tensors: one expert's projection (Qwen3-MoE's gate_proj / up_proj /
# down_proj, Mixtral's w1 / w3 / w2, under `mlp` or Mixtral's `block_sparse_moe`), every expert's fused (as HF
# Transformers 5 holds them) or stacked per projection (a GGUF file's, `experts.gate_proj` / `up_proj` /
# `down_proj` as `gguf.gguf_to_hf_name` names them), or the router.
_EXPERT_TENSOR = re.compile(
    r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_FUSED_EXPERTS_TENSOR = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)")
_ROUTER_TENSOR = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight")
# Our name of a mixture-of-experts layer's router or experts (under `mlp`), for naming Mixtral's checkpoint tensor
# (under `block_sparse_moe`) in messages.
_MOE_PARAM = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.)")
_EXPERT_PARTS = {"gate_proj": ("w13", "gate"), "w1": ("w13", "gate"), "up_proj": ("w13", "up"), "w3": ("w13", "up"),
                 "down_proj": ("w2", "down"), "w2": ("w2", "down")}

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# A step that needs the final states of some rows only (the tokens that sample: a prefill's last token)
# runs the last layer past its cache write on those rows alone (docs/perf_notes.md entry 37), and, where the
# step's metadata describes those rows (`AttentionMetadata.sampled`), its attention too (entry 42).
_prune_last_layer = True
_sampled_row_attention = True


def set_last_layer_pruning(enabled: bool) -> None:
    """Compute only the asked rows past the last layer's cache write (default), or every row and then
    select them (for measuring what the pruning gains; the same contract either way)."""
    global _prune_last_layer
    _prune_last_layer = enabled


def set_sampled_row_attention(enabled: bool) -> None:
    """Where the last layer runs on output rows (pruning on, and always in the piecewise graphs' last step):
    its attention for the sampled rows alone, as decode queries over the cache (default, where the metadata
    has `sampled`), or for every row and then select (for measuring)."""
    global _sampled_row_attention
    _sampled_row_attention = enabled


def _quant_for(arch: ArchConfig, prefix: str, parts: tuple[str, ...]) -> QuantConfig | None:
    """The quantization of the fused layer that holds checkpoint layers `prefix`.<part> (None: dense);
    ModelLoadError when the checkpoint quantizes some of them and not the others."""
    quant = arch.quantization
    if quant is None:
        return None
    applies = {quant.applies_to(f"{prefix}.{part}") for part in parts}
    if len(applies) > 1:
        raise ModelLoadError(f"{prefix}: {', '.join(parts)} are fused, but the checkpoint quantizes only some")
    return quant if applies.pop() else None


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, rotary_emb: RotaryEmbedding, dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVLinear(
            arch.hidden_size, arch.head_dim, self.num_heads, self.num_kv_heads, arch.attention_bias, dtype,
            quant=_quant_for(arch, prefix, ("q_proj", "k_proj", "v_proj")),
        )
        self.o_proj = Linear(arch.q_size, arch.hidden_size, arch.o_proj_bias, dtype, row_parallel=True,
                             quant=_quant_for(arch, prefix, ("o_proj",)))
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        # Shared by every layer (one table per model); nn.Module registers it under each layer harmlessly.
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q/k/v projection, q/k norms, rotary embedding and the cache write of k/v at
        `attn_metadata.slot_mapping` (the only part of the metadata read here, besides the one-prompt
        padding choice): (q [T, heads, head_dim], k, v [T, kv_heads, head_dim]), T = hidden's rows (or the
        padded layout `ops.prefill_attention_padding` asks for)."""
        num_tokens = hidden.shape[0]
        qkv_proj = self.qkv_proj
        rotated = None
        fusable = qkv_proj.fusable_weight()
        if self.q_norm is None and fusable is not None:
            # small GPU batches: rotary and cache write in the projection's epilogue
            rotated = ops.linear_rope_cache(
                hidden, fusable[0], qkv_proj.bias, positions, self.rotary_emb.cos_sin_cache, kv_cache,
                attn_metadata.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                k_scale=self.attn.k_scale, v_scale=self.attn.v_scale, w_scale=fusable[1],
            )
        q, k, v = qkv_proj.split(qkv_proj(hidden) if rotated is None else rotated)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rotated is None:
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)[0]
                k = self.k_norm(k)[0]
            # A one-prompt prefill on cuDNN: q/k/v come out of the rotary launch in the padded layout it reads.
            pad_to = ops.prefill_attention_padding(attn_metadata, q, k)
            if pad_to:
                q, k, v = self.rotary_emb.forward_and_cache_padded(
                    positions, q, k, v, kv_cache, attn_metadata.slot_mapping, pad_to, k_scale=self.attn.k_scale,
                    v_scale=self.attn.v_scale,
                )
            else:
                q, k = self.rotary_emb.forward_and_cache(positions, q, k, v, kv_cache, attn_metadata.slot_mapping,
                                                         k_scale=self.attn.k_scale, v_scale=self.attn.v_scale)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the metadata's num_tokens tokens (q/k/v may hold more rows: padding past them):
        [num_tokens, heads * head_dim], written into `out` ([num_tokens, heads * head_dim]) when given."""
        num_tokens = attn_metadata.num_tokens
        if q.shape[0] != num_tokens and not ops.prefill_attention_padding(attn_metadata, q, k):
            q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        attn_out = None if out is None else out.view(num_tokens, self.num_heads, self.head_dim)
        result = self.attn(q, k, v, kv_cache, attn_metadata, attn_out)
        return result.reshape(num_tokens, self.num_heads * self.head_dim)

    def attend_last_tokens(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of q [n, heads, head_dim], one query per request of a decode-style `metadata` (each its
        request's last token, whose K/V and its context's are in the cache): [n, heads * head_dim]."""
        result = self.attn.forward_cached(q, kv_cache, metadata)
        return result.reshape(q.shape[0], self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    """The dense MLP, this rank's share of `intermediate_size` (arch's unless given: Qwen2-MoE's shared expert's
    width); its output is summed over the ranks unless `reduce_output` is False (the caller sums it, once)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, prefix: str = "", intermediate_size: int | None = None,
                 reduce_output: bool = True) -> None:
        super().__init__()
        size = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, [size, size], arch.mlp_bias, dtype,
                                         quant=_quant_for(arch, prefix, ("gate_proj", "up_proj")))
        self.act_fn = get_act_and_mul(arch.hidden_act)
        self.down_proj = Linear(size, arch.hidden_size, arch.mlp_bias, dtype, row_parallel=True,
                                quant=_quant_for(arch, prefix, ("down_proj",)), reduce_output=reduce_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        fusable = gate_up.fusable_weight()
        if isinstance(self.act_fn, SiluAndMul) and fusable is not None:
            # one op, so small batches can fuse the two on the GPU
            return self.down_proj(ops.linear_silu_mul(x, fusable[0], gate_up.bias, w_scale=fusable[1]))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def _moe_block(arch: ArchConfig, dtype: torch.dtype, prefix: str = "") -> SparseMoeBlock:
    """A mixture-of-experts layer's MLP (this rank's share of each expert, `arch` being `layer_arch`), with
    Qwen2-MoE's shared expert where `arch` has one (its output summed over the ranks with the experts', once)."""
    mixtral = arch.architecture == "MixtralForCausalLM"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shared = None
    if arch.shared_expert_intermediate_size:
        shared = LlamaMLP(arch, dtype, f"{prefix}.shared_expert", arch.shared_expert_intermediate_size,
                          reduce_output=False)
    return SparseMoeBlock(arch.hidden_size, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
                          arch.norm_topk_prob, dtype, names, round_weights=not mixtral, shared_expert=shared)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, rotary_emb: RotaryEmbedding, dtype: torch.dtype, prefix: str = "",
                 moe: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(arch, rotary_emb, dtype, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp: nn.Module = _moe_block(arch, dtype, f"{prefix}.mlp") if moe else LlamaMLP(arch, dtype,
                                                                                          f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Returns (this layer's MLP output, residual stream before it); their sum is the layer output.

        Deferring the residual add into the next norm is exact: HF adds `residual + hidden` in the model
        dtype too, and the fused norm does the same add before normalising.
        output_rows (int64 indices; the last layer of a step that needs only some rows' final states):
        every row's K/V still go into the cache, but everything past attention runs on those rows alone,
        and both results hold only them; None for no rows.
        """
        q, k, v, residual = self.pre_attention(positions, hidden, residual, kv_cache, attn_metadata)
        if output_rows is None:
            return self.post_attention(self.self_attn.attend(q, k, v, kv_cache, attn_metadata), residual)
        if output_rows.shape[0] == 0:
            return None
        attn_out = self.attend_output_rows(q, k, v, kv_cache, attn_metadata, output_rows)
        return self.post_attention(attn_out, residual.index_select(0, output_rows))

    def attend_output_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention's output [len(output_rows), heads * head_dim] for output_rows alone, after the step's
        cache write. Where `attn_metadata.sampled` describes them (output_rows must then be the step's
        sampling rows, in its order), as decode queries over the cache: a prompt's last token reads its keys
        once instead of the whole prompt attending. Otherwise every token attends (into `out`, [num_tokens,
        heads * head_dim], when given) and the rows are selected."""
        sampled = attn_metadata.sampled
        if sampled is not None and _sampled_row_attention:
            if sampled.num_reqs != output_rows.shape[0]:
                raise ValueError(
                    f"{output_rows.shape[0]} output rows, but the metadata describes {sampled.num_reqs} sampled rows"
                )
            return self.self_attn.attend_last_tokens(q.index_select(0, output_rows), kv_cache, sampled)
        return self.self_attn.attend(q, k, v, kv_cache, attn_metadata, out).index_select(0, output_rows)

    # The parts of `forward` around attention, which piecewise CUDA graphs (`worker.piecewise`) also run
    # apart: pre_attention, self_attn.attend, post_attention.

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (with the deferred residual add), q/k/v, rotary and cache write: (q, k, v, residual)."""
        normed, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.project(positions, normed, kv_cache, attn_metadata)
        return q, k, v, residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, post-attention norm and MLP of attention's output [n, heads * head_dim] and the residual
        stream's matching rows: (MLP output, residual), as `forward` returns them."""
        normed, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        rotary_emb = RotaryEmbedding(
            arch.head_dim,
            max(arch.max_positions, arch.long_max_model_len or 0),
            arch.rope_theta,
            arch.rope_scaling,
            arch.rope_freq_factors,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, rotary_emb, dtype, f"model.layers.{i}", moe=i in arch.moe_layers)
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_rows is not None and not _prune_last_layer:
            return self.forward(input_ids, positions, kv_caches, attn_metadata).index_select(0, output_rows)
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            out = layer(positions, hidden, residual, kv_cache, attn_metadata, output_rows if i == last else None)
            if out is None:  # no rows asked for: the last layer's cache write was the rest of the step
                return hidden.new_empty((0, hidden.shape[1]))
            hidden, residual = out
        return self.norm(hidden, residual)[0]

    # Piecewise forward (`worker.piecewise`): piece(0), attend(0), piece(1), ..., attend(L - 1), finish.

    def piece(
        self,
        index: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        attn_out: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything between two layers' attention: piece 0 is the embedding and layer 0 up to its
        attention; piece i > 0 is layer i - 1 past its attention (attn_out [T, heads * head_dim], the residual
        stream piece i - 1 returned) and layer i up to its attention. Returns layer i's (q, k, v, residual)."""
        if index == 0:
            hidden = self.embed_tokens(input_ids)
        else:
            assert residual is not None
            hidden, residual = self.layers[index - 1].post_attention(attn_out, residual)
        return self.layers[index].pre_attention(positions, hidden, residual, kv_caches[index], attn_metadata)

    def finish(self, attn_rows: torch.Tensor, residual: torch.Tensor, output_rows: torch.Tensor) -> torch.Tensor:
        """The last layer past its attention and the final norm, on output_rows only (as `forward` with
        output_rows): attn_rows is the last layer's attention output of those rows alone
        (`LlamaDecoderLayer.attend_output_rows`), residual the whole step's stream. [len(output_rows), hidden]."""
        hidden, residual = self.layers[-1].post_attention(attn_rows, residual.index_select(0, output_rows))
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """Llama-family causal LM; see the module docstring. Construct as ``cls(arch, dtype)``; with tensor
    parallelism, in a process that has joined its group (`kvserve.distributed`): the decoder's layers then
    have this rank's shapes (`layer_arch`), `arch` stays the checkpoint's."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.layer_arch = distributed.local_arch(arch)
        self.dtype = dtype
        self.model = LlamaModel(self.layer_arch, dtype)
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, dtype)
        if arch.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def piecewise_model(self) -> LlamaModel:
        """The decoder, whose `piece` / `finish` and layers' `self_attn.attend` make up a piecewise forward."""
        return self.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # named_parameters() lists a tied lm_head once, under model.embed_tokens.
        params = dict(self.named_parameters())
        loaded: dict[str, set[Hashable]] = {name: set() for name in params}
        quant = self.arch.quantization
        fp8_checkpoint = quant is not None and quant.method == "fp8"
        block_fp8 = quant is not None and quant.method == "fp8" and quant.weight_block is not None
        # layer -> {"k" / "v" / "kv": (value, checkpoint name)}
        kv_scales: dict[int, dict[str, tuple[float, str]]] = {}
        tied_rows: dict[str, torch.Tensor] = {}
        # (router or experts' parameter, shard) -> the checkpoint tensor that filled it (`_check_moe_source`)
        moe_sources: dict[tuple[str, Hashable], str] = {}
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(_IGNORED_SUFFIXES):
                continue
            scale_of = self._kv_scale_target(ckpt_name)
            if scale_of is not None:
                layer, what = scale_of
                seen = kv_scales.setdefault(layer, {}).get(what)
                if seen is not None:
                    raise ModelLoadError(f"checkpoint tensors {seen[1]!r} and {ckpt_name!r} are both layer {layer}'s "
                                         f"{what}_scale")
                kv_scales[layer][what] = (_kv_scale_value(ckpt_name, tensor), ckpt_name)
                continue
            if self.arch.tie_word_embeddings and ckpt_name in ("lm_head.weight", "model.embed_tokens.weight"):
                # (a few rows of each, to tell whether a saved lm_head is the tied copy)
                tied_rows[ckpt_name] = tensor[:_TIED_ROWS_COMPARED].float().clone()
            if self.arch.tie_word_embeddings and ckpt_name == "lm_head.weight":
                # Some exporters save the tied copy anyway; the embedding is the one we keep.
                continue
            param_name, shard_id = _expert_param_name(ckpt_name) if self.arch.is_moe else (None, None)
            if param_name is None:
                param_name, shard_id = _param_name(ckpt_name)
            param = params.get(param_name)
            if param is None and param_name.endswith(".weight") and f"{param_name}_fp8" in params:
                param_name = f"{param_name}_fp8"  # an fp8 checkpoint's layer (`Linear.weight_fp8`)
                param = params[param_name]
            if param is None and param_name.endswith(".weight_scale_inv") and param_name[: -len("_inv")] in params:
                # a block-wise fp8 checkpoint's scales go to the layer's weight_scale (`Linear.fp8_blocks`)
                if not block_fp8:
                    raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} holds block-wise fp8 scales, but the "
                                         "quantization_config gives no weight_block_size")
                param_name = param_name[: -len("_inv")]
                param = params[param_name]
            if fp8_checkpoint and param is None and ckpt_name.endswith((".weight_scale", ".weight_scale_inv")):
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} is an fp8 weight scale, but its layer is not an "
                                     "fp8 layer of this model (an fp8 LM head or embedding is not supported)")
            if fp8_checkpoint and param is None and ckpt_name.endswith(_FP8_ACTIVATION_SUFFIXES):
                continue
            if param is not None and tensor.dtype in _FP8_DTYPES and param.dtype != torch.float8_e4m3fn:
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} is {tensor.dtype}, but its layer is not an fp8 "
                                     "layer of this model (an fp8 LM head or embedding is not supported)")
            if param is None and self.arch.quantization is not None and ckpt_name.endswith(".bias"):
                # Older GPTQ exporters save a (zero) bias for every projection, also where the model has none.
                continue
            if param is None and self.arch.quantization is None and ckpt_name.endswith(_PACKED_SUFFIXES):
                raise ModelLoadError(
                    f"checkpoint tensor {ckpt_name!r} is a packed quantized (AWQ / GPTQ) weight, but the checkpoint "
                    "says nothing of its quantization: its config.json has no quantization_config, and there is no "
                    "quantize_config.json (GPTQ) or quant_config.json (AWQ) beside it"
                )
            if param is None and quant is not None and quant.method in ("awq", "gptq") \
                    and ckpt_name.endswith(_PACKED_SUFFIXES):
                raise ModelLoadError(
                    f"checkpoint tensor {ckpt_name!r} is a packed quantized weight, but the checkpoint's "
                    f"quantization_config leaves its layer dense (modules_to_not_convert, modules_in_block_to_quantize)"
                )
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {ckpt_name!r} matches no parameter of {type(self).__name__}"
                )
            if self.arch.is_moe and _MOE_PARAM.match(param_name):
                _check_moe_source(moe_sources, ckpt_name, param_name, param, shard_id,
                                  _checkpoint_moe_block(self.arch))
            try:
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            except ValueError as exc:
                raise ModelLoadError(f"checkpoint tensor {ckpt_name!r}: {exc}") from None
            loaded[param_name].update(covered_shards(param, shard_id))  # (every expert's for a fused tensor)
        # A GPTQ checkpoint not in activation order may leave g_idx out (its rows are in group order, k //
        # group_size: what the load assumes without one, as vLLM does); an act-order one needs its order.
        optional = (".g_idx",) if quant is not None and quant.method == "gptq" and not quant.act_order else ()
        missing = [
            _describe_missing(name, param, shard, _checkpoint_moe_block(self.arch))
            for name, param in params.items()
            for shard in param.shard_ids  # type: ignore[attr-defined]
            if shard not in loaded[name] and not name.endswith(optional)
        ]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks weights for {shown}")
        if (len(tied_rows) == 2 and distributed.tp_group().rank == 0  # (once, not once per rank)
                and not torch.equal(tied_rows["lm_head.weight"], tied_rows["model.embed_tokens.weight"])):
            logger.warning("config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's "
                           "lm_head.weight holds other values: the embedding serves as the LM head, as vLLM loads it "
                           "(HF Transformers 5 unties them and uses lm_head.weight); if the model was trained untied, "
                           "set tie_word_embeddings to false in config.json")
        for layer, found in kv_scales.items():
            self.model.layers[layer].self_attn.attn.checkpoint_kv_scales = _layer_kv_scales(layer, found)
        self.finish_loading()

    def _kv_scale_target(self, ckpt_name: str) -> tuple[int, str] | None:
        """(layer, "k" / "v" / "kv") for a checkpoint KV-cache scale of one of this model's layers (`_KV_SCALE_NAMES`),
        None for any other name."""
        match = _LAYER_PREFIX.fullmatch(ckpt_name)
        if match is None or match.group(2) not in _KV_SCALE_NAMES:
            return None
        layer = int(match.group(1))
        return (layer, _KV_SCALE_NAMES[match.group(2)]) if layer < len(self.model.layers) else None

    def finish_loading(self) -> None:
        """Quantized layers pack (GPU) or dequantize (other devices) what they loaded (`Linear.finish_loading`)."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                try:
                    module.finish_loading()
                except ModelLoadError as exc:
                    raise ModelLoadError(f"{name}: {exc}") from None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with bias on q/k/v (ArchConfig.attention_bias)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (ArchConfig.qk_norm) and an independent head_dim."""


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention, and a mixture of experts as the MLP of the layers ArchConfig.moe_layers names
    (the others keep the dense MLP)."""


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2's attention, and in the layers ArchConfig.moe_layers names a mixture of experts plus a
    shared expert (`mlp.shared_expert`, gated by sigmoid(`mlp.shared_expert_gate`)) as the MLP."""


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama's attention, and a mixture of experts as every layer's MLP (`block_sparse_moe`)."""


def _expert_param_name(ckpt_name: str) -> tuple[str | None, Hashable]:
    """A mixture-of-experts checkpoint tensor -> (our parameter, shard id: (expert, part), `FUSED`, or for a
    stacked gate-only / up-only tensor `FUSED_GATE` / `FUSED_UP`); (None, None) for any other name."""
    match = _EXPERT_TENSOR.fullmatch(ckpt_name)
    if match is not None:
        which, part = _EXPERT_PARTS[match.group(3)]
        return f"{match.group(1)}.mlp.experts.{which}", (int(match.group(2)), part)
    match = _FUSED_EXPERTS_TENSOR.fullmatch(ckpt_name)
    if match is not None:
        which = match.group(2)
        if which == "down_proj":
            return f"{match.group(1)}.mlp.experts.w2", FUSED
        return f"{match.group(1)}.mlp.experts.w13", {"gate_up_proj": FUSED, "gate_proj": FUSED_GATE}.get(which, FUSED_UP)
    match = _ROUTER_TENSOR.fullmatch(ckpt_name)
    if match is not None:
        return f"{match.group(1)}.mlp.gate.weight", None
    return None, None


def _checkpoint_moe_block(arch: ArchConfig) -> str:
    """What the model's checkpoints call a mixture-of-experts layer's MLP: Mixtral's `block_sparse_moe`, else
    `mlp` (ours for both)."""
    return "block_sparse_moe" if arch.architecture == "MixtralForCausalLM" else "mlp"


def _check_moe_source(sources: dict[tuple[str, Hashable], str], ckpt_name: str, param_name: str,
                      param: torch.nn.Parameter, shard_id: Hashable, moe_block: str) -> None:
    """ModelLoadError if another checkpoint tensor already filled what `ckpt_name` fills of a router or the
    experts (`sources`: (parameter, shard) -> the tensor that filled it): a layer's experts held both apart and
    fused, or a Mixtral router under both mlp and block_sparse_moe (the later one silently replaced the earlier).
    `moe_block`: `_checkpoint_moe_block`."""
    for shard in covered_shards(param, shard_id):
        earlier = sources.setdefault((param_name, shard), ckpt_name)
        if earlier != ckpt_name:
            what = _describe_missing(param_name, param, shard, moe_block)
            raise ModelLoadError(f"checkpoint tensors {earlier!r} and {ckpt_name!r} both hold {what}: a checkpoint "
                                 "holds each expert once, apart or fused")


def _describe_missing(name: str, param: torch.nn.Parameter, shard: Hashable, moe_block: str = "mlp") -> str:
    """What a checkpoint lacks for shard `shard` of parameter `name`: the parameter's own description (an
    expert's: the checkpoint tensor's name), a fused projection's weight or bias shard as the checkpoint names it
    (`mlp.gate_up_proj.weight` shard 1: `mlp.up_proj.weight`), else the name and shard; a router's or expert's
    under `moe_block`, the checkpoint's name of the layer's MLP (`_checkpoint_moe_block`)."""
    describe = getattr(param, "describe_shard", None)
    stacked = next(((fused, part) for fused, part, sid in _STACKED_PARAMS if f".{fused}." in name and sid == shard),
                   None)
    if describe is not None:
        text = describe(name.rsplit(".", 1)[0], shard)
    elif stacked is not None and name.endswith((".weight", ".bias")):
        text = name.replace(f".{stacked[0]}.", f".{stacked[1]}.")
    else:
        text = f"{name} (shard {shard!r})" if shard is not None else name
    return text if moe_block == "mlp" else _MOE_PARAM.sub(rf"\1.{moe_block}.\2", text)


def _kv_scale_value(ckpt_name: str, tensor: torch.Tensor) -> float:
    """A checkpoint KV-cache scale as a float; ModelLoadError (a ValueError) naming the tensor unless it is one
    positive finite value (a per-tensor scale: vLLM reads no other for its fp8 cache either)."""
    if tensor.numel() != 1:
        raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} is a KV-cache scale of shape {tuple(tensor.shape)}: "
                             "only per-tensor scales (one value per layer) are supported")
    value = float(tensor.reshape(()).float().item())
    if not (math.isfinite(value) and value > 0.0):
        raise ModelLoadError(f"checkpoint tensor {ckpt_name!r} is a KV-cache scale of {value}: a scale must be a "
                             "positive finite number")
    return value


def _layer_kv_scales(layer: int, found: dict[str, tuple[float, str]]) -> tuple[float, float]:
    """One layer's (k_scale, v_scale) from its checkpoint scales, as vLLM resolves them: k and v as given; one
    `kv_scale` (or a k_scale alone) for both; a v_scale without a k_scale is refused."""
    if "kv" in found and ("k" in found or "v" in found):
        names = ", ".join(repr(name) for _, name in found.values())
        raise ModelLoadError(f"layer {layer} has both a kv_scale and a k_scale / v_scale in the checkpoint: {names}")
    k = found.get("k", found.get("kv"))
    if k is None:
        raise ModelLoadError(f"checkpoint tensor {found['v'][1]!r} is layer {layer}'s v_scale, but the checkpoint "
                             "has no k_scale for the layer")
    return k[0], found.get("v", k)[0]


def _param_name(ckpt_name: str) -> tuple[str, Hashable]:
    """Checkpoint name -> (our parameter name, shard id or None)."""
    for fused, part, shard_id in _STACKED_PARAMS:
        marker = f".{part}."
        if marker in ckpt_name:
            return ckpt_name.replace(marker, f".{fused}."), shard_id
    return ckpt_name, None
