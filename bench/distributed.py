# SPDX-License-Identifier: MIT
"""Distributed workloads: one process per GPU, as torchrun starts them,
over NCCL (bench.py --nproc N runs each allocator's child under
torch.distributed.run; with --nproc 1 they run on one rank).

  dist_gpt_ddp      the bench's GPT (workloads.GPT, bf16) under
                    DistributedDataParallel, AdamW; (batch, sequence) per
                    step;
  dist_llama_fsdp   transformers Llama under FSDP2 fully_shard (bf16
                    parameters, fp32 reductions), gradient checkpointing,
                    AdamW; (batch, sequence) per step;
  dist_lora_fsdp    the same Llama with peft LoRA (q_proj, v_proj) under
                    FSDP2: only the adapters train;
  dist_collectives  all_reduce and all_gather_into_tensor over a tensor of
                    64 MiB, 256 MiB or 1 GiB per step: ITERS collectives a
                    step, on a tensor made where two freed blocks of half
                    its size were; under libgmlake with a memory cap
                    (PyTorch's memory fraction) that leaves it no room
                    to grow, so it stitches them; PyTorch's allocators
                    without the cap (their bandwidth on plain tensors is
                    the reference); figures() gives each (op, size)'s bus
                    bandwidth as nccl-tests counts it, and whether
                    libgmlake stitched the tensor.

Every rank draws the same shapes (seeded by the workload's name and the
seed) and data of its own (the seed and its rank). The process group is
the child's: made on first use from torchrun's environment (or as one
rank without it), kept for all its workloads, as a trainer keeps its
communicator. figures() gives rank 0's loss per step (step_loss), for
comparing the allocators' loss curves.

Importing this module needs no torch: shape_set() and sequence() are
pure; build() imports torch and the model's library.
"""

import os
import random

import benchlib
import ecosystem

WORKLOADS = ("dist_gpt_ddp", "dist_llama_fsdp", "dist_lora_fsdp",
             "dist_collectives")

REQUIRES = {
    "dist_gpt_ddp": (),
    "dist_llama_fsdp": ("transformers",),
    "dist_lora_fsdp": ("transformers", "peft"),
    "dist_collectives": (),
}

MiB = 1 << 20
# Collectives a dist_collectives step runs, after one untimed.
ITERS = {"full": 10, "quick": 3}
OPS = ("all_reduce", "all_gather")

SHAPES = {
    "full": {
        "dist_gpt_ddp": dict(count=4, batch=(2, 4, 8),
                             seq=tuple(range(256, 2049, 256)),
                             tokens=16384),
        "dist_llama_fsdp": dict(count=4, batch=(1, 2, 4, 8),
                                seq=tuple(range(512, 2049, 256)),
                                tokens=16384),
        "dist_lora_fsdp": dict(count=4, batch=(1, 2, 4, 8),
                               seq=tuple(range(512, 2049, 256)),
                               tokens=16384),
        "dist_collectives": dict(mib=(64, 256, 1024)),
    },
    "quick": {
        "dist_gpt_ddp": dict(count=2, batch=(1, 2), seq=(32, 64, 128),
                             tokens=256),
        "dist_llama_fsdp": dict(count=2, batch=(1, 2), seq=(64, 128, 256),
                                tokens=512),
        "dist_lora_fsdp": dict(count=2, batch=(1, 2), seq=(64, 128, 256),
                               tokens=512),
        # Halves of 12 MiB and more: PyTorch's default allocator packs
        # blocks of 1-10 MiB into shared 20 MiB segments, whose halves
        # freed would give it no room under the cap.
        "dist_collectives": dict(mib=(24, 48)),
    },
}

# Steps, settling steps (each shape's first) included.
STEPS = {
    "full": dict(dist_gpt_ddp=24, dist_llama_fsdp=24, dist_lora_fsdp=24,
                 dist_collectives=18),
    "quick": dict(dist_gpt_ddp=4, dist_llama_fsdp=4, dist_lora_fsdp=4,
                  dist_collectives=6),
}

NOTES = {
    "dist_gpt_ddp": "the bench's GPT under DistributedDataParallel (NCCL, "
                    "one process per GPU), bf16, AdamW; (batch, sequence) "
                    "per step",
    "dist_llama_fsdp": "transformers LlamaForCausalLM under FSDP2 "
                       "fully_shard (NCCL, one process per GPU, bf16 "
                       "parameters, fp32 reductions), gradient "
                       "checkpointing, AdamW; (batch, sequence) per step",
    "dist_lora_fsdp": "transformers Llama + peft LoRA (q_proj, v_proj) "
                      "under FSDP2 fully_shard, gradient checkpointing, "
                      "AdamW on the adapters; (batch, sequence) per step",
    "dist_collectives": "all_reduce and all_gather_into_tensor (NCCL) over "
                        "a tensor made from two freed blocks' room (under "
                        "libgmlake, with a memory cap); (collective, MiB) "
                        "per step, %d collectives each",
}


# ---------------------------------------------------------------------------
# Shapes (pure)

def shape_set(name, size, seed):
    """The shapes workload `name` draws its steps from, in a seeded
    order: the same on every rank and for every allocator."""
    if name not in WORKLOADS:
        raise ValueError("unknown workload %r (known: %s)" %
                         (name, ", ".join(WORKLOADS)))
    spec = SHAPES[size][name]
    if name == "dist_collectives":
        return [(op, mib) for mib in spec["mib"] for op in OPS]
    rng = random.Random("%s:%d:set" % (name, seed))
    return benchlib.distinct_shapes(lambda: ecosystem._draw_bt(spec, rng),
                                    spec["count"])


def sequence(name, size, seed, steps):
    """The shape of each of `steps` steps of workload `name`."""
    rng = random.Random("%s:%d:steps" % (name, seed))
    return benchlib.shape_sequence(shape_set(name, size, seed), steps, rng)


def bus_factor(op, world):
    """nccl-tests' bus bandwidth over algorithm bandwidth: what each link
    carries for one byte of the tensor."""
    if op == "all_reduce":
        return 2.0 * (world - 1) / world
    if op == "all_gather":
        return float(world - 1) / world
    raise ValueError("unknown collective %r" % op)


# ---------------------------------------------------------------------------
# Process group, models and steps (torch)

def group():
    """(rank, world size) of the child's NCCL process group, made now from
    torchrun's environment if there is none (one rank without it)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(ecosystem.free_port())
        dist.init_process_group(
            "nccl", rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.get_rank(), dist.get_world_size()


def _llama(size):
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    cfg = LlamaConfig(max_position_embeddings=4096, use_cache=False,
                      **ecosystem.MODELS[size]["llama"])
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    ecosystem._checkpointing(model)
    return model, cfg.vocab_size


def _fsdp(model, layers):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _trainer(model, params, vocab, seed, rank, loss_of):
    """step_at for a causal LM: random tokens of this rank, AdamW."""
    import torch
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 1000 + rank)
    losses = []

    def step_at(shape):
        b, t = shape
        idx = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
        loss = loss_of(idx)
        ecosystem._train(loss, opt)
        losses.append(float(loss.detach()))

    return dict(step_at=step_at, keep=(model, opt),
                figures=lambda: dict(step_loss=list(losses)))


def _gpt_ddp(size, seed):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import workloads
    rank, _ = group()
    m = workloads.MODEL[size]
    model = workloads.GPT(**m).cuda().to(workloads.DTYPE)
    ddp = DDP(model, device_ids=[torch.cuda.current_device()])
    vocab = m["vocab"]

    def loss_of(idx):
        logits = ddp(idx)
        return F.cross_entropy(logits.float().view(-1, vocab), idx.view(-1))
    return _trainer(ddp, ddp.parameters(), vocab, seed, rank, loss_of)


def _llama_fsdp(size, seed):
    rank, _ = group()
    model, vocab = _llama(size)
    _fsdp(model, model.model.layers)
    model.train()
    return _trainer(model, model.parameters(), vocab, seed, rank,
                    lambda idx: model(input_ids=idx, labels=idx).loss)


def _lora_fsdp(size, seed):
    from peft import LoraConfig, get_peft_model
    rank, _ = group()
    base, vocab = _llama(size)
    model = get_peft_model(base, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"]))
    _fsdp(model, base.model.layers)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return _trainer(model, params, vocab, seed, rank,
                    lambda idx: model(input_ids=idx, labels=idx).loss)


def _stitched_room(nbytes, cap):
    """A float32 tensor of nbytes where two freed blocks of half its size
    were; the two blocks between stay (returned). With cap, the memory is
    capped at what is reserved plus a little (PyTorch's memory fraction),
    so that libgmlake cannot grow for the tensor and stitches the two
    freed blocks' chunks. The slack is for the freed blocks' ends: a
    growth handle (20 MiB) that a kept block shares can be neither
    stitched nor given back, so the shortfall grows.
    PyTorch's allocators run without the cap: the bandwidth they reach
    on plain tensors is the reference."""
    import torch
    dev = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    half = nbytes // 2
    a, b, c, d = (torch.empty(half, dtype=torch.uint8, device="cuda")
                  for _ in range(4))
    del a, c
    if not cap:
        return torch.empty(nbytes // 4, dtype=torch.float32,
                           device="cuda"), (b, d)
    total = torch.cuda.get_device_properties(dev).total_memory
    limit = torch.cuda.memory_reserved(dev) + max(128 * MiB, nbytes // 8)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), dev)
    try:
        x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return x, (b, d)


def _stitches():
    """libgmlake's stitch count on this device, or None under PyTorch's
    allocators."""
    import sys
    import torch
    gm = sys.modules.get("gmlake")
    if gm is None:
        return None
    try:
        return gm.stats(torch.cuda.current_device())["stitches"]
    except (RuntimeError, KeyError):
        return None


def _collectives(size, seed):
    import torch
    import torch.distributed as dist
    rank, world = group()
    iters = ITERS[size]
    bufs = {}
    bw = {}
    stitched = {}

    def buffers(mib):
        if mib not in bufs:
            before = _stitches()
            x, keep = _stitched_room(mib * MiB, before is not None)
            after = _stitches()
            if before is not None:
                stitched[str(mib)] = after > before
            x.fill_(rank + 1)
            part = torch.empty(x.numel() // world, dtype=x.dtype,
                               device="cuda")
            bufs[mib] = (x, part, keep)
        return bufs[mib]

    def run(op, x, part):
        if op == "all_reduce":
            dist.all_reduce(x)
        else:
            dist.all_gather_into_tensor(x, part)

    def step_at(shape):
        op, mib = shape
        x, part, _ = buffers(mib)
        run(op, x, part)                # untimed: the first may set up
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run(op, x, part)
        end.record()
        end.synchronize()
        s = start.elapsed_time(end) / 1000.0 / iters
        algbw = mib * MiB / s / 1e9
        e = bw.setdefault("%s:%d" % (op, mib), dict(algbw=[], busbw=[]))
        e["algbw"].append(round(algbw, 2))
        e["busbw"].append(round(algbw * bus_factor(op, world), 2))

    def figures():
        return dict(collectives=dict(world=world, iters=iters, gbps=bw,
                                     stitched=stitched))
    return dict(step_at=step_at, keep=bufs, figures=figures,
                note=NOTES["dist_collectives"] % iters)


BUILDERS = {"dist_gpt_ddp": _gpt_ddp, "dist_llama_fsdp": _llama_fsdp,
            "dist_lora_fsdp": _lora_fsdp, "dist_collectives": _collectives}


def build(name, size, seed, steps):
    """Workload `name` at `size`: as ecosystem.build(), with figures()
    (rank 0's loss per step, or the collectives' bandwidth)."""
    if name not in BUILDERS:
        raise ValueError("unknown workload %r (known: %s)" %
                         (name, ", ".join(WORKLOADS)))
    return ecosystem.assemble(BUILDERS[name], NOTES[name],
                              shape_set(name, size, seed),
                              sequence(name, size, seed, steps), size, seed)
