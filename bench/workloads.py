# SPDX-License-Identifier: MIT
"""The benchmark's models and training/inference steps (needs torch).

Every workload is built by build(name, size, seed) and returns a dict with
"step" (one training or generation step, returning the shape it ran at;
shapes drawn from a seeded random.Random, so every allocator sees the same
sequence), "warmup" (steps in its first round: one per distinct shape) and
"note".
Sizes: "full" fits an H200 with room to spare; "quick" is tiny, for smoke
tests.
"""

import json
import math
import os
import random

import torch
import torch.nn as nn

import benchlib
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MODEL = {
    "full": dict(d=2048, layers=16, heads=16, vocab=32000, ffn=5504),
    "quick": dict(d=256, layers=2, heads=4, vocab=1000, ffn=688),
}
SHAPES = {
    "full": dict(ckpt_b=(4, 16), ckpt_t=(256, 2048), plain_b=8,
                 plain_t=1024,
                 lora_b=(2, 8), lora_t=(256, 2048), gen_b=(1, 16),
                 gen_t=(64, 1024), gen_new=(16, 64),
                 sweep_t=dict(gpt_ckpt=(64, 256), lora=(64, 256))),
    "quick": dict(ckpt_b=(2, 4), ckpt_t=(32, 128), plain_b=4, plain_t=64,
                  lora_b=(1, 4),
                  lora_t=(32, 128), gen_b=(1, 4), gen_t=(16, 64),
                  gen_new=(4, 8),
                  sweep_t=dict(gpt_ckpt=(32, 128), lora=(32, 128))),
}
# Distinct shapes of a variable-shape workload (its warm-up round).
SHAPE_COUNT = 4
WORKLOADS = ("gpt_ckpt", "gpt_plain", "lora", "gpt_keep",
             "gpt_save_on_cpu",
             "gpt_offload", "generate", "llama_save_on_cpu",
             "llama_offload")
DTYPE = torch.bfloat16
# BENCH_OFFLOAD='{"max_inflight": 268435456}': offload_activations()
# options for gpt_offload (trying settings; the results name them).
OFFLOAD_OPTS = json.loads(os.environ.get("BENCH_OFFLOAD") or "{}")


class Attention(nn.Module):
    """Causal self-attention with Llama's projection names, optional
    KV cache for generation."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cache=None):
        b, t, d = x.shape
        h = self.heads

        def split(y):
            return y.view(b, t, h, d // h).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), \
            split(self.v_proj(x))
        if cache is not None:
            if "k" in cache:    # a growing cache: a new tensor every token
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        causal = cache is None or t > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                 nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, vocab, **_):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, how="plain"):
        x = self.emb(idx)
        for blk in self.blocks:
            if how == "ckpt":
                x = checkpoint(blk, x, use_reentrant=False)
            elif how == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    x = blk(x)
            elif how == "offload":
                # The same scope as save_on_cpu: each block's saved
                # tensors; libgmlake only (benchlib.ONLY).
                import gmlake.torch
                with gmlake.torch.offload_activations(**OFFLOAD_OPTS):
                    x = blk(x)
            else:
                x = blk(x)
        return self.head(self.ln(x))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        n = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * n).to(x.dtype) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = Attention(d, heads)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cache)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """A Llama-style decoder (RMSNorm, SwiGLU, no rotary embedding: the
    memory behaviour is what matters here)."""

    def __init__(self, d, layers, heads, vocab, ffn):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, ffn)
                                    for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.ckpt = False

    def forward(self, idx, caches=None):
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            if caches is not None:
                x = layer(x, caches[i])
            elif self.ckpt and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.lm_head(self.norm(x))


class LoRALinear(nn.Module):
    """Minimal LoRA: frozen base plus B @ A, B starting at zero."""

    def __init__(self, base, r=16, alpha=32, dropout=0.05):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features,
                                               device=base.weight.device,
                                               dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r,
                                               device=base.weight.device,
                                               dtype=base.weight.dtype))
        self.scale = alpha / r
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + (self.drop(x) @ self.lora_A.t() @
                               self.lora_B.t()) * self.scale


def _rng_int(rng, lo_hi):
    return rng.randint(lo_hi[0], lo_hi[1])


def _train_step(model, opt, vocab, b, t, how=None):
    idx = torch.randint(0, vocab, (b, t), device="cuda")
    logits = model(idx, how) if how else model(idx)
    loss = F.cross_entropy(logits.float().view(-1, vocab), idx.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _gpt(size):
    m = MODEL[size]
    return GPT(**m).cuda().to(DTYPE), m["vocab"]


def _cycling_step(shapes, train):
    """A step that trains at the next shape of the cycle and returns it."""
    def step():
        shape = shapes.next()
        train(*shape)
        return shape
    return step


def _cycle(rng, *ranges):
    """SHAPE_COUNT shapes drawn from ranges, visited round after round."""
    return benchlib.ShapeCycle(
        rng, lambda: tuple(_rng_int(rng, r) for r in ranges), SHAPE_COUNT)


def gpt_workload(size, how, rng):
    model, vocab = _gpt(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    s = SHAPES[size]
    if how != "plain":
        # The offload workloads run at the checkpointed GPT's shapes.
        shapes = _cycle(rng, s["ckpt_b"], s["ckpt_t"])
    else:
        shapes = None

    def train(b, t):
        _train_step(model, opt, vocab, b, t,
                    "plain" if how == "keep" else how)

    def step():
        shape = shapes.next() if shapes else (s["plain_b"], s["plain_t"])
        train(*shape)
        return shape
    notes = {"ckpt": "GPT, activation checkpointing, variable batch and "
                     "sequence length",
             "plain": "GPT, no checkpointing, fixed shapes",
             "save_on_cpu": "GPT, activations saved on the host "
                            "(torch.autograd.graph.save_on_cpu, "
                            "pin_memory=True)",
             "keep": "GPT at the offload workloads' shapes, activations "
                     "kept on the device (what offloading is measured "
                     "against)",
             "offload": "GPT, activations offloaded by "
                        "gmlake.torch.offload_activations(%s)" %
                        (", ".join("%s=%s" % kv for kv in OFFLOAD_OPTS.items())
                         or "defaults: copies into new tensors")}
    stats = _offload_stats() if how == "offload" else None
    return dict(step=step, train=train, note=notes[how], keep=(model, opt),
                warmup=len(shapes) if shapes else 1, stats=stats)


def _offload_stats():
    """The offloader's statistics since now, as a function (the copying
    offloader's with BENCH_OFFLOAD's same_address false)."""
    import gmlake.activations
    if OFFLOAD_OPTS.get("same_address", False):
        off = gmlake.activations.default_offloader()
    else:
        import gmlake.copy_offload
        off = gmlake.copy_offload.default_copy_offloader()
    before = dict(off.stats)
    probe = _probe_backward(off) if os.environ.get("BENCH_PROBE") and \
        OFFLOAD_OPTS.get("same_address", False) else None

    def stats():
        off.synchronize()
        d = {k: v - before.get(k, 0) for k, v in off.stats.items()}
        if probe:
            d["probe"] = probe
        return d
    return stats


def llama_workload(size, how, rng):
    """transformers' Llama, full fine-tuning without checkpointing, its
    whole forward's saved tensors saved on the host by save_on_cpu or
    offloaded by libgmlake (the same scope), at the LoRA workload's
    shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    m = MODEL[size]
    cfg = LlamaConfig(hidden_size=m["d"], intermediate_size=m["ffn"],
                      num_hidden_layers=m["layers"],
                      num_attention_heads=m["heads"],
                      num_key_value_heads=m["heads"],
                      vocab_size=m["vocab"], max_position_embeddings=4096,
                      use_cache=False)
    model = LlamaForCausalLM(cfg).cuda().to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    s = SHAPES[size]
    shapes = _cycle(rng, s["lora_b"], s["lora_t"])

    def scope():
        if how == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        import gmlake.torch
        return gmlake.torch.offload_activations(**OFFLOAD_OPTS)

    def train(b, t):
        idx = torch.randint(0, m["vocab"], (b, t), device="cuda")
        with scope():
            loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = _cycling_step(shapes, train)
    note = ("transformers Llama, no checkpointing, variable batch and "
            "sequence length, activations %s" %
            ("saved on the host (save_on_cpu, pin_memory=True)"
             if how == "save_on_cpu" else
             "offloaded by gmlake.torch.offload_activations(%s)" %
             ", ".join("%s=%s" % kv for kv in OFFLOAD_OPTS.items())))
    return dict(step=step, train=train, note=note, keep=(model, opt),
                warmup=len(shapes),
                stats=_offload_stats() if how == "offload" else None)


def _probe_backward(off):
    """BENCH_PROBE=1 (diagnostic: a stats call per unpack): where the
    blocks on the device peak in backward. Returns a dict filled as it
    runs: the largest resident_bytes seen at an unpack, with the
    offloader's records by state (count, GiB) at that moment."""
    import gmlake
    seen = {"resident_gib": 0.0}
    unpack = off.unpack

    def probed(h):
        t = unpack(h)
        st = gmlake.stats(0)
        r = st["resident_bytes.current"] / benchlib.GiB
        if r > seen["resident_gib"]:
            states = {}
            for rec in list(off._storages.values()):
                n, b = states.get(rec.state, (0, 0.0))
                states[rec.state] = (n + 1, b + rec.nbytes / benchlib.GiB)
            seen.update(resident_gib=r, states=states,
                        ahead=len(off._ahead),
                        ahead_gib=off._ahead_bytes / benchlib.GiB,
                        stack=len(off._stack),
                        reserved_gib=st["reserved_bytes.current"] /
                        benchlib.GiB)
        return t
    off.unpack = probed
    return seen


def _hf_lora(m):
    """LoRA on transformers' Llama with peft; raises ImportError when
    either is missing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model
    cfg = LlamaConfig(hidden_size=m["d"], intermediate_size=m["ffn"],
                      num_hidden_layers=m["layers"],
                      num_attention_heads=m["heads"],
                      num_key_value_heads=m["heads"],
                      vocab_size=m["vocab"], max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).cuda().to(DTYPE)
    try:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05,
        target_modules=["q_proj", "v_proj"]))

    def loss_of(idx):
        return model(input_ids=idx, labels=idx).loss
    return model, loss_of, "transformers Llama + peft LoRA"


def _own_lora(m):
    model = Llama(**m).cuda().to(DTYPE)
    model.ckpt = True
    for p in model.parameters():
        p.requires_grad_(False)
    how = "own Llama-style model + "
    try:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.05,
            target_modules=["q_proj", "v_proj"]))
        how += "peft LoRA"
    except Exception:  # peft missing, or refusing a model of ours
        for layer in model.layers:
            a = layer.self_attn
            a.q_proj = LoRALinear(a.q_proj)
            a.v_proj = LoRALinear(a.v_proj)
        how += "minimal LoRA (peft not importable)"
    vocab = m["vocab"]

    def loss_of(idx):
        logits = model(idx)
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab),
                               idx[:, 1:].reshape(-1))
    return model, loss_of, how


def lora_workload(size, rng):
    m = MODEL[size]
    try:
        model, loss_of, how = _hf_lora(m)
    except ImportError:
        model, loss_of, how = _own_lora(m)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters()
                             if p.requires_grad], lr=1e-4)
    s = SHAPES[size]
    shapes = _cycle(rng, s["lora_b"], s["lora_t"])

    def train(b, t):
        idx = torch.randint(0, m["vocab"], (b, t), device="cuda")
        loss_of(idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = _cycling_step(shapes, train)
    return dict(step=step, train=train, note="LoRA fine-tuning, gradient "
                "checkpointing, variable shapes: " + how, keep=(model, opt),
                warmup=len(shapes))


def generate_workload(size, rng):
    m = MODEL[size]
    model = Llama(**m).cuda().to(DTYPE).eval()
    s = SHAPES[size]
    shapes = _cycle(rng, s["gen_b"], s["gen_t"], s["gen_new"])

    @torch.no_grad()
    def step():
        shape = shapes.next()
        b, t, new = shape
        idx = torch.randint(0, m["vocab"], (b, t), device="cuda")
        caches = [dict() for _ in model.layers]
        logits = model(idx, caches)
        for _ in range(new):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(nxt, caches)
        del caches, logits
        return shape
    return dict(step=step, note="greedy generation, KV cache grown by "
                "concatenation every token, variable batch and prompt",
                keep=(model,), warmup=len(shapes))


def build(name, size, seed):
    """The workload `name` at `size`, seeded."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if name == "gpt_ckpt":
        return gpt_workload(size, "ckpt", rng)
    if name == "gpt_plain":
        return gpt_workload(size, "plain", rng)
    if name == "gpt_save_on_cpu":
        return gpt_workload(size, "save_on_cpu", rng)
    if name == "gpt_offload":
        return gpt_workload(size, "offload", rng)
    if name == "gpt_keep":
        return gpt_workload(size, "keep", rng)
    if name == "lora":
        return lora_workload(size, rng)
    if name == "generate":
        return generate_workload(size, rng)
    if name == "llama_save_on_cpu":
        return llama_workload(size, "save_on_cpu", rng)
    if name == "llama_offload":
        return llama_workload(size, "offload", rng)
    raise ValueError("unknown workload %r (known: %s)" %
                     (name, ", ".join(WORKLOADS)))


def build_sweep(name, size, seed):
    """The workload `name` for the capacity sweep: step(b) trains one step
    at batch b for each of SHAPE_COUNT sequence lengths drawn once from
    SHAPES[size]["sweep_t"][name] (shorter than the workload's own, so
    that one more batch is a small step in memory), in one seeded order,
    the same for every batch and allocator; reset() drops what a failed
    step left behind."""
    ranges = SHAPES[size]["sweep_t"]
    if name not in ranges:
        raise ValueError("no capacity sweep for %s (only %s)" %
                         (name, ", ".join(sorted(ranges))))
    state = build(name, size, seed)
    rng = random.Random(seed + 1)
    lengths = []
    while len(lengths) < SHAPE_COUNT:
        t = _rng_int(rng, ranges[name])
        if t not in lengths:
            lengths.append(t)
    train, opt = state["train"], state["keep"][1]

    def step(b):
        for t in lengths:
            train(b, t)

    def reset():
        opt.zero_grad(set_to_none=True)
    return dict(step=step, reset=reset, seq=lengths, keep=state["keep"],
                note=state["note"])
