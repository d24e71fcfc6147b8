# SPDX-License-Identifier: MIT
"""Workloads from the PyTorch ecosystem: models nobody in this project
wrote, trained the way their users train them, at shapes that change from
step to step as a data loader's batches do.

  eco_vit         timm ViT-L/16 with dynamic_img_size, random resolution
                  and batch, bf16 autocast, AdamW;
  eco_maskrcnn    torchvision Mask R-CNN (ResNet-50 FPN), 4 random images
                  of random sizes with random boxes, labels and masks,
                  train mode, SGD;
  eco_sage        torch_geometric GraphSAGE, full batch on random graphs
                  of 100k-400k nodes, Adam;
  eco_llama_fsdp  transformers Llama (12 layers, hidden 2048) under FSDP2
                  fully_shard on one rank (NCCL), gradient checkpointing,
                  random (batch, sequence), AdamW;
  eco_compile     torch.compile (default mode, dynamic=False) of an
                  nn.TransformerEncoder training step: each new shape
                  compiles (a settling step), AdamW;

and two more (EXTRA, the bench's eco_extra group), patterns the five do
not have:

  eco_lora        transformers Llama (20 layers, hidden 2560, bf16
                  weights) with peft LoRA adapters on every projection,
                  gradient checkpointing, random (batch, sequence), AdamW
                  over the adapters only;
  eco_convnet     timm ResNet-50, channels_last, bf16 autocast, with
                  cudnn.benchmark on (each new shape times cuDNN's
                  algorithms, whose workspaces come and go), random batch
                  and resolution, SGD.

Each workload draws a small set of shapes from its ranges (SHAPES), seeded
by the workload's name and the seed, and then the shape of every step from
that set (benchlib.shape_sequence: every shape at least once), so every
allocator's child runs the same steps. A step's first meeting with a shape
is a settling step (benchlib.settle_flags).

Importing this module needs no torch and runs nothing: shape_set() and
sequence() are pure; build() imports torch and the model's library. No
pretrained weights: every model is built from its configuration, on the
GPU where the library allows it.
"""

import os
import random
import socket

import benchlib

CORE = ("eco_vit", "eco_maskrcnn", "eco_sage", "eco_llama_fsdp",
        "eco_compile")
EXTRA = ("eco_lora", "eco_convnet")
WORKLOADS = CORE + EXTRA

# Python modules each workload needs besides torch.
REQUIRES = {
    "eco_vit": ("timm",),
    "eco_maskrcnn": ("torchvision",),
    "eco_sage": ("torch_geometric",),
    "eco_llama_fsdp": ("transformers",),
    "eco_compile": (),
    "eco_lora": ("transformers", "peft"),
    "eco_convnet": ("timm",),
}

# Shape ranges; count is the size of the seeded set the steps draw from.
SHAPES = {
    "full": {
        # (batch, resolution): multiples of 16, as patch 16 needs.
        "eco_vit": dict(count=4, batch=(24, 32, 40, 48, 56, 64),
                        res=tuple(range(192, 321, 16))),
        # per image (height, width, boxes); the model's transform then
        # scales each to 800 px on its short side (1333 at most).
        "eco_maskrcnn": dict(count=4, images=4, side=(400, 1100), step=4,
                             boxes=(2, 12)),
        # (nodes, edges): nodes in thousands, degree fixed.
        "eco_sage": dict(count=4, nodes=(100000, 400000), step=1000,
                         degree=12),
        # (batch, sequence), at most `tokens` tokens a step.
        "eco_llama_fsdp": dict(count=4, batch=(1, 2, 4, 8),
                               seq=tuple(range(512, 2049, 256)),
                               tokens=16384),
        "eco_compile": dict(count=3, batch=(8, 16, 32), seq=(128, 256, 512),
                            tokens=8192),
        "eco_lora": dict(count=4, batch=(1, 2, 4, 8),
                         seq=tuple(range(512, 2049, 256)), tokens=16384),
        # (batch, resolution): multiples of 32, as ResNet's strides need.
        "eco_convnet": dict(count=4, batch=(64, 96, 128, 160),
                            res=tuple(range(160, 289, 32))),
    },
    "quick": {
        "eco_vit": dict(count=3, batch=(2, 4, 8), res=(64, 96, 128)),
        "eco_maskrcnn": dict(count=2, images=2, side=(200, 400), step=4,
                             boxes=(1, 4)),
        "eco_sage": dict(count=2, nodes=(2000, 8000), step=1000, degree=8),
        "eco_llama_fsdp": dict(count=2, batch=(1, 2), seq=(64, 128, 256),
                               tokens=512),
        "eco_compile": dict(count=2, batch=(2, 4), seq=(32, 64, 128),
                            tokens=256),
        "eco_lora": dict(count=2, batch=(1, 2), seq=(64, 128, 256),
                         tokens=512),
        "eco_convnet": dict(count=2, batch=(2, 4), res=(64, 96)),
    },
}

# Steps of each workload, settling steps included (benchlib.settle_flags):
# about 24 steady steps in full size.
STEPS = {
    "full": dict(eco_vit=28, eco_maskrcnn=28, eco_sage=28, eco_llama_fsdp=28,
                 eco_compile=24, eco_lora=28, eco_convnet=28),
    "quick": dict(eco_vit=8, eco_maskrcnn=6, eco_sage=6, eco_llama_fsdp=6,
                  eco_compile=6, eco_lora=6, eco_convnet=6),
}

MODELS = {
    "full": dict(
        vit=("vit_large_patch16_224", {}),
        maskrcnn=dict(num_classes=91),
        sage=dict(features=128, hidden=256, layers=3, classes=47),
        llama=dict(hidden_size=2048, intermediate_size=5504,
                   num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=16, vocab_size=32000),
        compile=dict(d=1024, heads=16, ffn=4096, layers=4, vocab=32000),
        lora_llama=dict(hidden_size=2560, intermediate_size=6912,
                        num_hidden_layers=20, num_attention_heads=20,
                        num_key_value_heads=20, vocab_size=32000),
        lora=dict(r=16, alpha=32),
        convnet=("resnet50", {})),
    "quick": dict(
        vit=("vit_tiny_patch16_224", dict(depth=2, num_classes=10)),
        maskrcnn=dict(num_classes=5, min_size=256, max_size=512),
        sage=dict(features=16, hidden=32, layers=2, classes=5),
        llama=dict(hidden_size=256, intermediate_size=688,
                   num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=1000),
        compile=dict(d=128, heads=4, ffn=512, layers=2, vocab=1000),
        lora_llama=dict(hidden_size=256, intermediate_size=688,
                        num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=1000),
        lora=dict(r=4, alpha=8),
        convnet=("resnet18", dict(num_classes=10))),
}

NOTES = {
    "eco_vit": "timm %s, dynamic_img_size=True, bf16 autocast, AdamW; "
               "(batch, resolution) per step",
    "eco_maskrcnn": "torchvision maskrcnn_resnet50_fpn (no pretrained "
                    "weights), train mode, SGD; per step each image's "
                    "(height, width, boxes)",
    "eco_sage": "torch_geometric GraphSAGE, full batch, random graphs, "
                "Adam; (nodes, edges) per step",
    "eco_llama_fsdp": "transformers LlamaForCausalLM under FSDP2 "
                      "fully_shard (one rank, NCCL, bf16 parameters, fp32 "
                      "reductions), gradient checkpointing, AdamW; (batch, "
                      "sequence) per step",
    "eco_compile": "torch.compile (default mode, dynamic=False) of an "
                   "nn.TransformerEncoder step, bf16 autocast, AdamW; "
                   "(batch, sequence) per step, each new one compiles",
    "eco_lora": "transformers LlamaForCausalLM in bf16 with peft LoRA "
                "(r %d) on every projection, gradient checkpointing, "
                "AdamW over the adapters; (batch, sequence) per step",
    "eco_convnet": "timm %s, channels_last, bf16 autocast, "
                   "cudnn.benchmark on, SGD; (batch, resolution) per step",
}


# ---------------------------------------------------------------------------
# Shapes (pure)

def _draw_bt(spec, rng):
    """(batch, sequence) with at most spec["tokens"] tokens."""
    while True:
        b, t = rng.choice(spec["batch"]), rng.choice(spec["seq"])
        if b * t <= spec["tokens"]:
            return (b, t)


def _draw(name, spec, rng):
    if name in ("eco_vit", "eco_convnet"):
        return (rng.choice(spec["batch"]), rng.choice(spec["res"]))
    if name == "eco_maskrcnn":
        lo, hi = spec["side"]
        return tuple((rng.randrange(lo, hi + 1, spec["step"]),
                      rng.randrange(lo, hi + 1, spec["step"]),
                      rng.randint(*spec["boxes"]))
                     for _ in range(spec["images"]))
    if name == "eco_sage":
        lo, hi = spec["nodes"]
        n = rng.randrange(lo, hi + 1, spec["step"])
        return (n, n * spec["degree"])
    if name in ("eco_llama_fsdp", "eco_compile", "eco_lora"):
        return _draw_bt(spec, rng)
    raise ValueError("unknown workload %r (known: %s)" %
                     (name, ", ".join(WORKLOADS)))


def shape_set(name, size, seed):
    """The shapes workload `name` draws its steps from, in a seeded
    order: the same for every allocator."""
    spec = SHAPES[size][name]
    rng = random.Random("%s:%d:set" % (name, seed))
    return benchlib.distinct_shapes(lambda: _draw(name, spec, rng),
                                    spec["count"])


def sequence(name, size, seed, steps):
    """The shape of each of `steps` steps of workload `name`."""
    rng = random.Random("%s:%d:steps" % (name, seed))
    return benchlib.shape_sequence(shape_set(name, size, seed), steps, rng)


# ---------------------------------------------------------------------------
# Models and steps (torch)

def _generator(seed):
    """A seeded CUDA generator for the step's random data: the same data
    under every allocator (Mask R-CNN's work depends on it)."""
    import torch
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def _train(loss, opt):
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _vit(size, seed):
    import timm
    import torch
    import torch.nn.functional as F
    name, extra = MODELS[size]["vit"]
    with torch.device("cuda"):
        model = timm.create_model(name, pretrained=False,
                                  dynamic_img_size=True, **extra)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    g = _generator(seed)
    classes = model.num_classes

    def step_at(shape):
        b, res = shape
        x = torch.randn(b, 3, res, res, device="cuda", generator=g)
        y = torch.randint(0, classes, (b,), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        _train(loss, opt)
    return dict(step_at=step_at, keep=(model, opt), note=NOTES["eco_vit"] %
                name)


def _maskrcnn(size, seed):
    import torch
    from torchvision.models.detection import maskrcnn_resnet50_fpn
    kw = dict(MODELS[size]["maskrcnn"])
    classes = kw["num_classes"]
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None,
                                  **kw).cuda()
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                          lr=0.002, momentum=0.9, weight_decay=1e-4)
    g = _generator(seed)

    def target(h, w, n):
        # Boxes of at least 16 px inside the image; each mask fills its box.
        lo = torch.rand(n, 2, device="cuda", generator=g) * \
            torch.tensor([0.7 * w, 0.7 * h], device="cuda")
        room = torch.tensor([w, h], device="cuda") - lo - 16
        hi = lo + 16 + torch.rand(n, 2, device="cuda", generator=g) * room
        boxes = torch.cat([lo, hi], dim=1)
        b = boxes.view(n, 4, 1, 1)
        ys = torch.arange(h, device="cuda").view(1, h, 1)
        xs = torch.arange(w, device="cuda").view(1, 1, w)
        masks = ((xs >= b[:, 0]) & (xs < b[:, 2]) &
                 (ys >= b[:, 1]) & (ys < b[:, 3])).to(torch.uint8)
        labels = torch.randint(1, classes, (n,), device="cuda", generator=g)
        return dict(boxes=boxes, labels=labels, masks=masks)

    def step_at(shape):
        images, targets = [], []
        for h, w, n in shape:
            images.append(torch.rand(3, h, w, device="cuda", generator=g))
            targets.append(target(h, w, n))
        losses = model(images, targets)
        _train(sum(losses.values()), opt)
    return dict(step_at=step_at, keep=(model, opt))


def _sage(size, seed):
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GraphSAGE
    m = MODELS[size]["sage"]
    model = GraphSAGE(m["features"], m["hidden"], m["layers"],
                      out_channels=m["classes"]).cuda()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = _generator(seed)

    def step_at(shape):
        n, e = shape
        x = torch.randn(n, m["features"], device="cuda", generator=g)
        edge_index = torch.randint(0, n, (2, e), device="cuda", generator=g)
        y = torch.randint(0, m["classes"], (n,), device="cuda", generator=g)
        _train(F.cross_entropy(model(x, edge_index), y), opt)
    return dict(step_at=step_at, keep=(model, opt))


def free_port():
    """A TCP port on 127.0.0.1 free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_rank():
    """An NCCL process group of one rank on this process's GPU; False
    when one was already there (then it is not ours to destroy)."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(
        "nccl", rank=0, world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()))
    return True


def _checkpointing(model):
    """transformers' gradient checkpointing, non-reentrant where the
    version has the option."""
    try:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        model.gradient_checkpointing_enable()


def _llama_fsdp(size, seed):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    ours = _single_rank()
    try:
        cfg = LlamaConfig(max_position_embeddings=4096, use_cache=False,
                          **MODELS[size]["llama"])
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        _checkpointing(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    except BaseException:
        if ours:
            dist.destroy_process_group()
        raise
    g = _generator(seed)
    vocab = cfg.vocab_size

    def step_at(shape):
        b, t = shape
        idx = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
        _train(model(input_ids=idx, labels=idx).loss, opt)

    def close():
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    return dict(step_at=step_at, keep=(model, opt), close=close)


def _compile(size, seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    m = MODELS[size]["compile"]
    layer = nn.TransformerEncoderLayer(m["d"], m["heads"], m["ffn"],
                                       dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    model = nn.Sequential(
        nn.Embedding(m["vocab"], m["d"]),
        nn.TransformerEncoder(layer, m["layers"], enable_nested_tensor=False),
        nn.LayerNorm(m["d"]),
        nn.Linear(m["d"], m["vocab"])).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = m["vocab"]

    def loss_of(idx, target):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx)
        return F.cross_entropy(logits.float().view(-1, vocab),
                               target.view(-1))
    compiled = torch.compile(loss_of, dynamic=False)
    g = _generator(seed)

    def step_at(shape):
        b, t = shape
        idx = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
        target = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
        _train(compiled(idx, target), opt)

    def close():
        torch._dynamo.reset()   # drop the compiled graphs and their pools
    return dict(step_at=step_at, keep=(model, opt), close=close)


def _lora(size, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=4096, use_cache=False,
                      **MODELS[size]["lora_llama"])
    with torch.device("cuda"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    _checkpointing(base)
    lc = MODELS[size]["lora"]
    model = get_peft_model(base, LoraConfig(
        r=lc["r"], lora_alpha=lc["alpha"], lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                        "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters()
                             if p.requires_grad], lr=1e-4)
    g = _generator(seed)
    vocab = cfg.vocab_size

    def step_at(shape):
        b, t = shape
        idx = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=idx, labels=idx).loss
        _train(loss, opt)
    return dict(step_at=step_at, keep=(model, opt),
                note=NOTES["eco_lora"] % lc["r"])


def _convnet(size, seed):
    import timm
    import torch
    import torch.nn.functional as F
    name, extra = MODELS[size]["convnet"]
    model = timm.create_model(name, pretrained=False, **extra).cuda()
    model = model.to(memory_format=torch.channels_last)
    # BENCH_CUDNN_EMPTY_CACHE=0: no empty_cache after each search (a
    # private switch of PyTorch's; a build without it says so).
    get = getattr(torch._C, "_cuda_get_conv_benchmark_empty_cache", None)
    put = getattr(torch._C, "_cudnn_set_conv_benchmark_empty_cache", None)
    emptied = get() if get else True
    keep = os.environ.get("BENCH_CUDNN_EMPTY_CACHE") == "0"
    if keep and not put:
        raise RuntimeError("BENCH_CUDNN_EMPTY_CACHE=0: this PyTorch has "
                           "no _cudnn_set_conv_benchmark_empty_cache")
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    if keep:
        put(False)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                          weight_decay=1e-4)
    g = _generator(seed)
    classes = model.num_classes

    def step_at(shape):
        b, res = shape
        x = torch.randn(b, 3, res, res, device="cuda", generator=g)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, classes, (b,), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        _train(loss, opt)

    def close():
        torch.backends.cudnn.benchmark = was    # later workloads: as found
        if put:
            put(emptied)
    return dict(step_at=step_at, keep=(model, opt), close=close,
                note=NOTES["eco_convnet"] % name)


BUILDERS = {"eco_vit": _vit, "eco_maskrcnn": _maskrcnn, "eco_sage": _sage,
            "eco_llama_fsdp": _llama_fsdp, "eco_compile": _compile,
            "eco_lora": _lora, "eco_convnet": _convnet}


def build(name, size, seed, steps):
    """Workload `name` at `size`: a dict with step() (the next step of the
    seeded sequence; returns its shape), step_at(shape), shapes (the set),
    steps, note, keep (what must live as long as the workload) and close
    (None or what to call when done)."""
    if name not in BUILDERS:
        raise ValueError("unknown workload %r (known: %s)" %
                         (name, ", ".join(WORKLOADS)))
    return assemble(BUILDERS[name], NOTES[name], shape_set(name, size, seed),
                    sequence(name, size, seed, steps), size, seed)


def assemble(make, note, shapes, seq, size, seed):
    """The state of a workload made by make(size, seed) (a dict with
    step_at and keep, perhaps note, close, figures) under torch's seed, as
    build() describes it, stepping through the shapes of seq."""
    import torch
    torch.manual_seed(seed)
    state = dict(make(size, seed))
    state.setdefault("note", note)
    state.setdefault("close", None)
    state.update(shapes=shapes, steps=len(seq))
    todo = iter(seq)
    step_at = state["step_at"]

    def step():
        shape = next(todo)
        step_at(shape)
        return shape
    state["step"] = step
    return state
