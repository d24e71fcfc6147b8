# SPDX-License-Identifier: MIT
"""The optimizer-state hooks' default on real PyTorch, one process per
mode: python3 sanity.py default|off [LIB]. AdamW on plain parameters
(two Linear(4096, 4096)) and on FSDP2 fully_shard parameters (DTensors,
one rank); prints one JSON line: losses, whether _init_group was wrapped
while each optimizer's steps ran, whether the hooks are done with it,
state addresses moved after the first step, peak reserved."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "python")
import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import optimizer_state  # noqa: E402

mode = sys.argv[1]
lib = sys.argv[2] if len(sys.argv) > 2 else "build-gpu/libgmlake.so"
os.environ.pop(gmlake.torch.SETTLE_ENV, None)
if mode == "default":
    gmlake.torch.enable(lib)
else:
    gmlake.torch.enable(lib, optimizer_state=False)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 4096)).cuda()


def run(m, name):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    wrapped, ptrs, r = [], [], {"losses": [], "moved": []}

    def pre(o, a, k):          # instance hooks run after the global ones
        wrapped.append(bool(getattr(vars(o).get("_init_group"),
                                    "_gmlake_placing", False)))
    opt.register_step_pre_hook(pre)
    for step in range(4):
        torch.manual_seed(step)
        x = torch.randn(1024, 4096, device="cuda")
        loss = m(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        now = [t.data_ptr() for st in opt.state.values()
               for t in st.values() if torch.is_tensor(t) and t.is_cuda]
        r["moved"].append(sum(a != b for a, b in zip(ptrs, now)))
        ptrs = now
        r["losses"].append(loss.item())
    r["wrapped_at_step"] = wrapped
    r["param_types"] = sorted({type(p).__name__ for p in m.parameters()})
    r["hooks_done"] = opt in optimizer_state._settled
    return r


out = {"mode": mode, "plain": run(model(), "plain")}
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1)
try:
    from torch.distributed.fsdp import fully_shard
    m = model()
    fully_shard(m)
    out["fsdp2"] = run(m, "fsdp2")
finally:
    dist.destroy_process_group()
st = gmlake.stats(0, lib)
out["reserved_peak"] = st["reserved_bytes.peak"]
out["creates"] = st["calls.mem_create"]
print(json.dumps(out))
