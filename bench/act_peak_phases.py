# SPDX-License-Identifier: MIT
"""Where the bench's GPT reaches its peak under activation offload: the
peak allocated and reserved memory of each phase of a step (forward,
loss, backward, optimizer), each phase synchronized and measured apart,
on libgmlake (GMLAKE_LIBRARY), shapes (16, 2048) and (8, 1024) in turn.

  python3 bench/act_peak_phases.py save_on_cpu|offload|nodrain

offload: gmlake.torch.offload_activations() with its defaults; nodrain:
the same with drain=False. One line per step (GiB; "at_loss" is what is
allocated when the loss starts), then the offloader's stats. The phase
synchronizations change the step times: they are not a speed measure.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
sys.path.insert(0, HERE)

MODES = ("save_on_cpu", "offload", "nodrain")
GiB = float(1 << 30)


def phase(torch, ph, name):
    """Close a phase: its peaks into ph, the peaks reset for the next."""
    torch.cuda.synchronize()
    ph[name] = torch.cuda.max_memory_allocated() / GiB
    ph[name + "_r"] = torch.cuda.max_memory_reserved() / GiB
    torch.cuda.reset_peak_memory_stats()


def main(mode):
    import gmlake.torch
    gmlake.torch.enable()       # before the first CUDA tensor
    import torch
    import torch.nn.functional as F
    import workloads
    from gmlake import copy_offload

    if mode == "nodrain":
        workloads.OFFLOAD_OPTS["drain"] = False
    how = "save_on_cpu" if mode == "save_on_cpu" else "offload"
    torch.manual_seed(0)
    model, vocab = workloads._gpt("full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(6):
        b, t = (16, 2048) if step % 2 == 0 else (8, 1024)
        idx = torch.randint(0, vocab, (b, t), device="cuda")
        ph = {}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        logits = model(idx, how)
        phase(torch, ph, "fwd")
        ph["at_loss"] = torch.cuda.memory_allocated() / GiB
        loss = F.cross_entropy(logits.float().view(-1, vocab), idx.view(-1))
        phase(torch, ph, "loss")
        loss.backward()
        phase(torch, ph, "bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase(torch, ph, "opt")
        ph["s"] = time.perf_counter() - t0
        print(mode, step, (b, t), " ".join(
            "%s %.3f" % kv for kv in ph.items()), flush=True)
    print(mode, "stats", dict(copy_offload.default_copy_offloader().stats))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        sys.exit("usage: act_peak_phases.py %s" % "|".join(MODES))
    main(sys.argv[1])
