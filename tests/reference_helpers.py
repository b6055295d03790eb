"""Tiny random transformers checkpoints and step-by-step logits through our decoder, for reference tests."""
from __future__ import annotations

import random
from typing import Callable, Optional

import torch

from kvinfer import LLM, SamplingParams
from kvinfer.config import EngineConfig
from kvinfer.kv.cache import ContiguousCache, NoCache, PagedCache, SeqSlice
from kvinfer.loaders.model_loader import LoadedModel, load_model

# Shapes small enough that a whole family's checks take a few seconds on two cores.
TINY_LLAMA_LIKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2)


def _randomise(model: torch.nn.Module, seed: int, gain: float, embed_std: float) -> None:
    """HF's init leaves biases at zero and norms at one; random values make every weight path count."""
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(seed)
    # Which dimension of each matrix is its input: Conv1D (GPT-2) stores [in, out], Linear [out, in].
    in_dim = {id(m.weight): 0 if isinstance(m, Conv1D) else 1
              for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "embeddings_layernorm" in name:
                # BLOOM normalises embeddings at once; a small gain keeps the current token from dominating.
                p.copy_(embed_std * (1.0 + 0.2 * noise) if name.endswith("weight") else torch.zeros_like(p))
            elif p.ndim == 1 and ("norm" in name or "ln" in name):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif id(p) in in_dim and p is not model.get_output_embeddings().weight:
                d = in_dim[id(p)]
                # Zero-mean over the inputs: GELU outputs are mostly positive, and without this every position
                # gets the same large offset, the tied head then picks one token forever.
                noise = noise - noise.mean(dim=d, keepdim=True)
                p.copy_(noise * (gain / p.shape[d] ** 0.5))
            else:
                p.copy_(embed_std * noise)  # embeddings and the output head


def save_tiny(config_cls_name: str, model_cls_name: str, path, seed: int = 0, max_shard_size=None,
              gain: float = 0.5, embed_std: float = 0.2, **config_kw) -> torch.nn.Module:
    """Write a random-weight transformers model with save_pretrained; returns it in eval mode (float32)."""
    import transformers

    cfg = getattr(transformers, config_cls_name)(**config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(cfg).eval()
    _randomise(model, seed, gain, embed_std)
    kw = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(path, **kw)
    return model


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recompute: the plainest use of transformers, no cache involved."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def load_decoder(model_dir: str) -> LoadedModel:
    return load_model(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))


def make_backend(loaded: LoadedModel, kind: str, max_len: int = 128, block_size: int = 4):
    """A backend for one sequence; paged blocks are handed out in reverse so the table is not the identity."""
    cfg = loaded.config
    if kind == "none":
        kv, table = NoCache(cfg.num_layers, "cpu"), None
    elif kind == "contiguous":
        kv, table = ContiguousCache(cfg.num_layers, 1, cfg.num_kv_heads, max_len, cfg.head_dim, torch.float32,
                                    "cpu"), None
    elif kind == "paged":
        nblk = -(-max_len // block_size)
        kv = PagedCache(cfg.num_layers, nblk, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        table = list(reversed(range(nblk)))
    else:
        raise ValueError(kind)
    # The engine wires these from the model config; a bare backend needs them too.
    kv.sliding_window = cfg.sliding_window
    if cfg.position == "alibi":
        kv.alibi = loaded.model.alibi
    return kv, table


@torch.inference_mode()
def step_logits(loaded: LoadedModel, prompt: list[int], feed: list[int], kind: str, block_size: int = 4,
                on_step: Optional[Callable[[object, int], None]] = None) -> torch.Tensor:
    """Prefill `prompt`, then decode one token of `feed` per step through backend `kind`.

    Returns [len(prompt) + len(feed), vocab]: the prefill's logits at every prompt position, then each step's.
    `on_step(backend, num_tokens_cached)` is called after the prefill and after every decode step.
    """
    model = loaded.model
    kv, table = make_backend(loaded, kind, max_len=len(prompt) + len(feed) + 1, block_size=block_size)
    ids = list(prompt)

    def run(start: int, new: list[int]) -> torch.Tensor:
        if kind == "none":
            # Recompute: the whole sequence every step, keep the last rows.
            toks, start_ = ids, 0
        else:
            toks, start_ = new, start
        s = SeqSlice(start_, len(toks), block_table=table, slot=0 if kind == "contiguous" else None)
        md = kv.prepare([s])
        pos = torch.arange(start_, start_ + len(toks))
        hidden = model(torch.tensor(toks), pos, md, kv)  # [tokens, hidden]
        return model.compute_logits(hidden[-len(new):])  # [len(new), vocab]

    out = [run(0, list(prompt))]
    if on_step:
        on_step(kv, len(ids))
    for t in feed:
        ids.append(t)
        out.append(run(len(ids) - 1, [t]))
        if on_step:
            on_step(kv, len(ids))
    return torch.cat(out)


def engine_greedy(model_dir: str, ps: list[list[int]], n: int, kind: str = "paged", block_size: int = 4,
                  max_model_len: int = 128) -> list[list[int]]:
    """Greedy tokens for all prompts submitted together to one engine."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache=kind, kv_cache_memory=4 << 20,
              block_size=block_size, max_model_len=max_model_len)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
