import json, sys
import torch
sys.path.insert(0, "python")
import gmlake, gmlake.torch
mode = sys.argv[1]
gmlake.torch.enable("build-gpu/libgmlake.so", optimizer_state=(mode == "on"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 4096)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
before = {}
wrapped = []
def rec(o, a, k):
    before.clear()
    for p, st in o.state.items():
        for key, t in st.items():
            if torch.is_tensor(t) and t.is_cuda:
                before[(id(p), key)] = (t.data_ptr(), t)
opt.register_step_post_hook(rec)
out = {"mode": mode, "losses": [], "moved": []}
for step in range(5):
    x = torch.randn(1024, 4096, device="cuda")
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    moved = sum(1 for (pid, key), (ptr, t) in before.items()
                if t.data_ptr() != ptr)
    out["losses"].append(loss.item())
    out["moved"].append(moved)
    wrapped.append("_init_group" in vars(opt))
out["init_group_wrapped_after_step"] = wrapped
st = gmlake.stats(0, "build-gpu/libgmlake.so")
out["creates"] = st["calls.mem_create"]
out["reserved_peak"] = st["reserved_bytes.peak"]
# manual settle moves again (the hook only once): the real torch path
t0 = next(iter(opt.state.values()))["exp_avg"]
ref = t0.clone()
p0 = t0.data_ptr()
out["manual"] = gmlake.torch.settle_optimizer_state(opt)
out["manual_moved_same_values"] = bool(t0.data_ptr() != p0 and torch.equal(t0, ref))
print(json.dumps(out))
