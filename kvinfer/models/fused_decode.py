"""Decode steps of Llama-style GGUF models through one C call for all layers (kvinfer.kernels.decode_step).

The eager path costs about 20 small torch ops and module calls per layer per step; for a 30-layer model with
single-token steps that dispatch overhead rivals the arithmetic. FusedDecode runs the same computation
(RMSNorm, fused QKV with its biases where the model has them (Qwen2), q/k norms where the model has them,
rotate-half RoPE, K/V written to the paged pools, paged attention, SwiGLU or a mixture of SwiGLU experts with an
optional gated shared one, residuals) in C with the same quantised-matmul and attention kernels. It applies only
where every piece matches exactly; any other model, dtype, device or backend keeps the eager path.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kvinfer import kernels
from kvinfer.layers.mlp import SwiGLU
from kvinfer.layers.moe import MoE
from kvinfer.layers.norm import RMSNorm
from kvinfer.layers.quant_linear import KernelLinear, QuantEmbedding, QuantLinear, QuantParts


def _projection_reason(proj, fused: bool, biased: bool = False) -> Optional[str]:
    """None when proj is a QuantLinear of a kernel type (or, where fused, up to MAX_PARTS of them), bias-free unless
    biased: a dense layer's projections may have one (Qwen2's q/k/v), which the step passes to kvq_matmul as the
    layer's own kernel call does; an expert's may not (MoE.forward calls the matmuls itself, without one)."""
    if fused and isinstance(proj, QuantParts):  # Q4_K_M's mixed q/k/v: each part its own matmul
        if len(proj.parts) > kernels.MAX_PARTS:
            return f"a projection in {len(proj.parts)} parts (at most {kernels.MAX_PARTS})"
        lins = list(proj.parts)
    else:
        lins = [proj]
    for lin in lins:
        if not isinstance(lin, QuantLinear) or lin.qtype not in kernels.QTYPES:
            return "a projection that is not QuantLinears of kernel types"
        if not lin.raw.is_contiguous():
            return "non-contiguous quantised weights"
        b = lin.bias
        if b is not None and not biased:
            return "a biased projection where the C step takes none (an expert's)"
        if b is not None and (b.dtype != torch.float32 or not b.is_cpu or not b.is_contiguous()
                              or b.numel() != lin.out_features):
            return "a projection bias that is not a contiguous float32 CPU vector of its width"
    return None


def _moe_reason(mlp) -> Optional[str]:
    """None when the C step computes this mixture-of-experts layer as MoE.forward does (moe_ffn in decode_step.c)."""
    if not isinstance(mlp, MoE):
        return "an expert layer that is not layers/moe.py's MoE"
    if mlp.owned is not None or mlp.combine_picked is not None:
        return "experts dealt out to tensor-parallel ranks (an all-reduce inside the layer)"
    if not kernels.batch_invariant():
        return "experts with batch invariance off (the router and experts may take torch's matmuls)"
    if not _float_kernel_linear(mlp.router):
        return "a router that is not a bias-free contiguous float KernelLinear"
    inter = mlp.experts[0].inter if isinstance(mlp.experts[0], SwiGLU) else 0
    for ex in mlp.experts:
        if not isinstance(ex, SwiGLU) or ex.activation != "silu" or ex.inter != inter:
            return "experts that are not SwiGLUs of one width"
        reason = _swiglu_reason(ex)
        if reason is not None:
            return f"an expert with {reason}"
    if mlp.shared is not None:  # Qwen2-MoE's gated shared expert (shared_ffn in decode_step.c)
        if not isinstance(mlp.shared, SwiGLU) or mlp.shared.activation != "silu":
            return "a shared expert that is not a SwiGLU"
        reason = _swiglu_reason(mlp.shared)
        if reason is not None:
            return f"a shared expert with {reason}"
        if not _float_kernel_linear(mlp.shared_gate) or mlp.shared_gate.out_features != 1:
            return "a shared expert gate that is not a bias-free contiguous float KernelLinear of one output"
    return None


def _float_kernel_linear(lin) -> bool:
    """Whether lin is a bias-free KernelLinear over a contiguous CPU float weight: its forward is kvq_matmul's."""
    return (isinstance(lin, KernelLinear) and lin.bias is None and lin.weight.dtype in kernels.FLOAT_TYPES
            and lin.weight.is_cpu and lin.weight.is_contiguous())


def _swiglu_reason(ex: SwiGLU) -> Optional[str]:
    """None when a SwiGLU's gate-up (or its parts) and down are projections the C step runs."""
    for proj, fused in ((ex.gate_up, True), (ex.down, False)):
        reason = _projection_reason(proj, fused)
        if reason is not None:
            return reason
    return None


def unsupported_reason(model, backend) -> Optional[str]:
    """None when FusedDecode can run this model's decode steps on this backend, else why not."""
    cfg = model.cfg
    if not backend.block_pools:
        return f"the {backend.name} backend (paged only)"
    if backend.device.type != "cpu" or (backend.k[0].dtype != torch.float32 and not backend.quantized):
        return "KV cache neither float32 nor 8-bit on CPU"
    if not kernels.available():
        return kernels.unavailable_reason()
    if cfg.position != "rope" or cfg.norm != "rms" or cfg.mlp != "swiglu":
        return f"position {cfg.position}, norm {cfg.norm}, mlp {cfg.mlp} (needs rope, rms, swiglu)"
    if model.pos_embed is not None or model.embed_norm is not None:
        return "an extra embedding or embedding norm"
    if cfg.rotary_dim is not None or cfg.layer_windows or cfg.sandwich_norm:
        return "partial rotary, per-layer windows or sandwich norms"
    if cfg.embed_scale is not None or cfg.attn_scale is not None:
        return "a scaled embedding or softmax"
    if cfg.head_dim % 2:
        return "odd head_dim"
    rot = model.rotary
    if rot.cos.dtype != torch.float32 or not (rot.cos.is_contiguous() and rot.sin.is_contiguous()):
        return "RoPE tables that are not contiguous float32"
    for layer in model.layers:
        moe = isinstance(layer.mlp, MoE) or bool(cfg.num_experts)
        mlp = () if moe else ((layer.mlp.gate_up, True), (layer.mlp.down, False))
        for proj, fused in ((layer.attn.qkv, True), (layer.attn.o, False), *mlp):
            reason = _projection_reason(proj, fused, biased=True)
            if reason is not None:
                return reason
        if moe:
            reason = _moe_reason(layer.mlp)
            if reason is not None:
                return reason
        qk = (layer.attn.q_norm, layer.attn.k_norm) if cfg.qk_norm else ()
        if cfg.qk_norm and (qk[0] is None or qk[1] is None):
            return "q/k norms the config names but the layers lack"
        for norm in (layer.input_norm, layer.post_attn_norm, *qk):
            if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32 or norm.eps != cfg.norm_eps:
                return "norms that are not float32 RMSNorm with the model's eps"
            if not norm.weight.is_contiguous():
                return "non-contiguous norm weights"
    return None


class FusedDecode:
    """Holds the layer table (pointers into the model's weights and the cache's pools) for kernels.decode_step."""

    def __init__(self, model, backend):
        reason = unsupported_reason(model, backend)
        if reason is not None:
            raise ValueError(f"fused decode unsupported: {reason}")
        cfg = model.cfg
        self.model, self.backend, self.cfg = model, backend, cfg
        self._kept: list[torch.Tensor] = []  # the kept copies the table points to, alive while it does
        layers = (kernels.DecodeLayer * cfg.num_layers)()
        self._experts = []  # each MoE layer's table of experts, which the layer table points into
        for i, layer in enumerate(model.layers):
            e = layers[i]
            e.attn_norm, e.ffn_norm = layer.input_norm.weight.data_ptr(), layer.post_attn_norm.weight.data_ptr()
            moe = layer.mlp if isinstance(layer.mlp, MoE) else None
            mlp = () if moe else (("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down))
            for name, lin in (("qkv", layer.attn.qkv), ("o", layer.attn.o), *mlp):
                self._set_projection(e, name, lin)
            if moe is not None:
                self._set_moe(e, moe)
            if layer.attn.q_norm is not None:  # per head, before RoPE, with the model's eps (as Attention.forward)
                e.q_norm, e.k_norm = layer.attn.q_norm.weight.data_ptr(), layer.attn.k_norm.weight.data_ptr()
            e.kpool, e.vpool = backend.k[i].data_ptr(), backend.v[i].data_ptr()
            if backend.scaled:
                e.kscale, e.vscale = backend.k_scale[i].data_ptr(), backend.v_scale[i].data_ptr()
        self.layers = layers
        # the dense layers' FFN width (with experts in every layer, only the step's check of it reads it)
        dense = any(not isinstance(layer.mlp, MoE) for layer in model.layers)
        self.inter = cfg.intermediate_size if dense else model.layers[0].mlp.experts[0].inter
        self.scale = cfg.head_dim ** -0.5
        # Beyond the layers, what the C step can also do: the embedding lookup, the final norm and the LM head
        # (with the kernels the eager path calls for them), sparing the per-op cost of each in Python.
        emb, norm, head = model.embed, model.norm, model.lm_head
        self.embed = emb if (isinstance(emb, QuantEmbedding) and emb.qtype in kernels.QTYPES
                             and isinstance(emb.raw, torch.Tensor) and emb.raw.is_cpu
                             and emb.raw.stride(1) == 1) else None
        self.final_norm = norm if (isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32
                                   and norm.weight.is_contiguous()) else None
        self.head = head if (self.final_norm is not None and isinstance(head, QuantLinear) and head.bias is None
                             and head.qtype in kernels.QTYPES and head.raw.is_contiguous()) else None
        self._head_kept = self._kept_ptr(self.head) if self.head is not None else None
        self._embed_kept = self._kept_ptr(self.embed) if self.embed is not None else None  # (a tied head's copy)
        self._ptrs = self._current_ptrs()

    def _set_moe(self, e, moe: MoE) -> None:
        experts = (kernels.DecodeExpert * moe.num_experts)()
        for x, ex in zip(experts, moe.experts):
            self._set_projection(x, "gate_up", ex.gate_up)
            self._set_projection(x, "down", ex.down)
        self._experts.append(experts)
        w = moe.router.weight
        e.experts, e.router = ctypes.addressof(experts), w.data_ptr()
        e.router_ldw, e.router_qt = w.stride(0) * w.element_size(), kernels.FLOAT_TYPES[w.dtype]
        e.n_experts, e.top_k, e.expert_inter = moe.num_experts, moe.top_k, moe.experts[0].inter
        e.renorm = int(moe.renormalise)
        if moe.shared is not None:
            self._set_projection(e.shared, "gate_up", moe.shared.gate_up)
            self._set_projection(e.shared, "down", moe.shared.down)
            g = moe.shared_gate.weight
            e.shared_gate, e.shared_gate_qt = g.data_ptr(), kernels.FLOAT_TYPES[g.dtype]
            e.shared_gate_ldw, e.shared_inter = g.stride(0) * g.element_size(), moe.shared.inter

    def _set_projection(self, e, name: str, lin) -> None:
        """The fields name, name_ldw, name_qt, name_kept, name_bias (or name_parts, name_nparts) of a layer or expert
        entry (an expert entry has no bias field: unsupported_reason refuses biased experts)."""
        if isinstance(lin, QuantParts):
            parts = getattr(e, f"{name}_parts")
            for j, part in enumerate(lin.parts):
                parts[j].w, parts[j].rows = part.raw.data_ptr(), part.out_features
                parts[j].ldw, parts[j].qt = part.raw.stride(0), kernels.QTYPES[part.qtype]
                parts[j].kept = self._kept_ptr(part)
                parts[j].bias = part.bias.data_ptr() if part.bias is not None else None  # the part's own slice
            setattr(e, f"{name}_nparts", len(lin.parts))
            return
        setattr(e, name, lin.raw.data_ptr())
        setattr(e, f"{name}_ldw", lin.raw.stride(0))
        setattr(e, f"{name}_qt", kernels.QTYPES[lin.qtype])
        setattr(e, f"{name}_kept", self._kept_ptr(lin))
        if lin.bias is not None:
            setattr(e, f"{name}_bias", lin.bias.data_ptr())

    def _kept_ptr(self, m) -> Optional[int]:
        """The kept copy of a QuantLinear's (or a tied QuantEmbedding's) weight for the table, made first where the
        layer makes one (as its first forward would): each call passes it beside the weight, as the eager path
        does, so the step reads what the layer reads."""
        if isinstance(m, QuantLinear):
            m.prepare_kernel()
            kept = m._tiles
        else:
            kept = m.kept()
        if kept is None or kept.tiles is None:
            return None
        self._kept.append(kept.tiles)
        return kept.ptr

    @property
    def fuses_head(self) -> bool:
        """Whether a call with with_logits=True returns logits (the final norm and the head done in C)."""
        return self.head is not None

    def _current_ptrs(self) -> tuple:
        m = self.model
        first = m.layers[0]
        qkv = first.attn.qkv.parts[0] if isinstance(first.attn.qkv, QuantParts) else first.attn.qkv
        return (self.backend.k[0].data_ptr(), qkv.raw.data_ptr(), first.input_norm.weight.data_ptr(),
                id(m.embed), id(m.norm), id(m.lm_head))

    def _check_ptrs(self) -> None:
        # The table holds raw addresses: if weights or pools were replaced since, rebuild rather than read freed
        # memory.
        if self._current_ptrs() != self._ptrs:
            self.__init__(self.model, self.backend)

    def __call__(self, input_ids: torch.Tensor, md, with_logits: bool = False) -> torch.Tensor:
        """For a step of B single-token decodes (md.kernel set, decode_only): hidden states [B, hidden] after the
        final norm, or with with_logits and fuses_head, the logits [B, vocab] float32. Each sequence's position
        is read from md.kernel.tok_pos."""
        self._check_ptrs()
        cfg, model, kv, km = self.cfg, self.model, self.backend, md.kernel
        B, hid = input_ids.shape[0], cfg.hidden_size
        ids = input_ids.to(torch.int64).contiguous()
        if self.embed is not None:
            x = torch.empty((B, hid), dtype=torch.float32)  # filled by the step
        else:
            x = model.embed(ids).to(torch.float32).contiguous()  # [B, hidden], updated in place
        norm = self.final_norm
        out = torch.empty((B, hid), dtype=torch.float32) if norm is not None else None
        head = self.head if with_logits else None
        logits = torch.empty((B, head.out_features), dtype=torch.float32) if head is not None else None
        slots, tables, lens = md.slot_mapping.contiguous(), km.tables.contiguous(), (km.tok_pos + 1).contiguous()
        job = self._job(B, x, ids, slots, tables, lens, out, head, logits)  # (the tensors stay alive until the call)
        kernels.decode_step(job)
        kv.kv_computed += B * cfg.num_layers
        if logits is not None:
            return logits
        return out if out is not None else model.norm(x)

    def _job(self, B, x, ids, slots, tables, lens, out, head, logits):
        cfg, kv, rot, norm, emb = self.cfg, self.backend, self.model.rotary, self.final_norm, self.embed
        return kernels.DecodeJob(x.data_ptr(), ctypes.addressof(self.layers), rot.cos.data_ptr(), rot.sin.data_ptr(),
                                 slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), B, cfg.hidden_size,
                                 cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.inter,
                                 cfg.num_layers, tables.shape[1], kv.block_size, kv.num_blocks,
                                 kv.sliding_window or 0, rot.cos.shape[0], cfg.norm_eps, self.scale,
                                 torch.get_num_threads(), kernels.KV_DTYPES.get(kv.kv_dtype, 0),
                                 ids.data_ptr(), emb.raw.data_ptr() if emb is not None else None,
                                 emb.raw.stride(0) if emb is not None else 0,
                                 emb.num_embeddings if emb is not None else 0,
                                 kernels.QTYPES[emb.qtype] if emb is not None else 0,
                                 norm.eps if norm is not None else 0.0,
                                 norm.weight.data_ptr() if norm is not None else None,
                                 out.data_ptr() if out is not None else None,
                                 head.raw.data_ptr() if head is not None else None,
                                 head.raw.stride(0) if head is not None else 0,
                                 head.out_features if head is not None else 0,
                                 kernels.QTYPES[head.qtype] if head is not None else 0,
                                 logits.data_ptr() if logits is not None else None,
                                 self._embed_kept if emb is not None else None,
                                 self._head_kept if head is not None else None)

    @property
    def steps_ok(self) -> bool:
        """Whether decode_steps can run (the embedding lookup, final norm and head all in the C step)."""
        return self.embed is not None and self.head is not None

    def decode_steps(self, ids: list[int], tables: list[list[int]], lens: list[int], nsteps: int,
                     stop_ids: list[int], sampling: Optional[tuple[torch.Tensor, ...]] = None,
                     uniforms: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to nsteps decode steps of B sequences in one C call (kernels.decode_steps): ids[b] is each
        sequence's last token, lens[b] its length with it, tables[b] its block table, already holding positions
        up to lens[b] - 2 + nsteps. Each step's token is the row's argmax, or with `sampling` (sampler.row_params:
        temperature, top_k, top_p, min_p per sequence, temperature 0 for the argmax) drawn by kernels.sample_row with
        uniforms[s, b] (float64 [nsteps, B]). Stops early after a step that produced one of stop_ids. Returns
        (tokens [steps, B], logits [steps, B, vocab]) of the steps done: the very logits a step at a time would
        give."""
        self._check_ptrs()
        cfg, B = self.cfg, len(ids)
        width = max(len(t) for t in tables)
        t = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.int64)
        idt, lent = torch.tensor(ids, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)
        x = torch.empty((B, cfg.hidden_size), dtype=torch.float32)
        out = torch.empty((B, cfg.hidden_size), dtype=torch.float32)
        logits = torch.empty((nsteps, B, self.head.out_features), dtype=torch.float32)
        tokens = torch.empty((nsteps, B), dtype=torch.int64)
        job = self._job(B, x, idt, lent, t, lent, out, self.head, logits)  # (slots: not read, the C loop derives them)
        sp = keep = None
        if sampling is not None:
            keep = (*sampling, uniforms.to(torch.float64).contiguous())
            if keep[4].shape != (nsteps, B):
                raise ValueError(f"uniforms must be [{nsteps}, {B}], got {list(keep[4].shape)}")
            sp = kernels.Sampling(*(a.data_ptr() for a in keep))
        n = kernels.decode_steps(job, nsteps, torch.tensor(stop_ids, dtype=torch.int64), logits, tokens, sp)
        self.backend.kv_computed += n * B * cfg.num_layers
        return tokens[:n], logits[:n]
