# SPDX-License-Identifier: MIT
"""Optimizer offload on transformers Llama configs: how large a model
trains on one GPU, and at what step time.

Full fine-tuning as its users run it: fp32 parameters, AdamW, bf16
autocast, gradient checkpointing (non-reentrant), gradient accumulation
(8 micro-batches a step), batch 1 with a sequence length drawn per
micro-batch from SEQS by a seeded generator, so every mode runs the same
shapes. Each run is a process of its own:

  torch        PyTorch's default allocator, fused AdamW on the GPU;
  expandable   the same with expandable_segments:True;
  gmlake       libgmlake as the allocator, no offload;
  offload      libgmlake + gmlake.torch.offload_optimizer(opt) (defaults:
               state parked only where memory needs it);
  offload_all  the same with keep_bytes=0: all state on the host after
               every step;
  fsdp_cpu     FSDP2 fully_shard (each layer, then the model) on one rank
               with CPUOffloadPolicy(pin_memory=True): parameters,
               gradients and optimizer state on the host, the AdamW step
               on the CPU; PyTorch's default allocator.

  python3 bench/optim_offload.py run --mode offload --layers 8 --lib L
      one run; prints RESULT {json} (fits, per-step times and losses,
      peak memory, the offloader's and libgmlake's statistics).
  python3 bench/optim_offload.py plan --lib L --out DIR RUN...
      RUN is MODE:LAYERS (torch:36); each in its own process, in the
      order given, with a time limit (--timeout); DIR gets results.json
      (every run, appended to what is there) and results.md.
  python3 bench/optim_offload.py report DIR
      results.md again from DIR/results.json.

A config is the Llama-7B layer shape (hidden 4096, intermediate 11008, 32
heads, vocabulary 32000) with LAYERS layers. Step times are wall time
from the step's first micro-batch to its loss on the host (loss.item(),
which waits for the compute stream only, as a trainer's logging does; a
spill still copying after the step overlaps the next step, as it would
in training). The mean is over the steps after the first; the first is
shown on its own (it includes the optimizer's state creation and, with
offload, the host memory's pinning).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

import benchlib  # bench/, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ("torch", "expandable", "gmlake", "offload", "offload_all",
         "fsdp_cpu")
GMLAKE_MODES = ("gmlake", "offload", "offload_all")
SEQS = (512, 768, 1024)
SHAPE = dict(hidden_size=4096, intermediate_size=11008,
             num_attention_heads=32, num_key_value_heads=32,
             vocab_size=32000)
GiB = 1 << 30


def params_of(layers, shape=SHAPE):
    """Parameters of a config, without building it (untied embeddings)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], \
        shape["vocab_size"]
    return 2 * v * h + h + layers * (4 * h * h + 3 * h * i + 2 * h)


def micro_shapes(seed, steps, accum):
    rng = random.Random("optim_offload:%d" % seed)
    return [[rng.choice(SEQS) for _ in range(accum)] for _ in range(steps)]


# ---------------------------------------------------------------------------
# One run (a child process)

def build(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=args.layers, use_cache=False,
                      max_position_embeddings=max(SEQS), **SHAPE)
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    try:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        model.gradient_checkpointing_enable()
    model.train()
    return model, cfg


def fsdp_cpu(model, torch):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    policy = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def gmlake_stats():
    from gmlake import _lib, _stats
    d = _stats.stats(0, _lib.enabled_library())
    return {k: v for k, v in d.items()
            if (k.startswith("calls.") or k.startswith("call_ns.")) and v} | {
        k: d[k] for k in ("reserved_bytes.peak", "allocated_bytes.peak",
                          "resident_bytes.peak", "host_pinned.peak",
                          "spills", "fetches", "auto_spills", "d2h_bytes",
                          "d2h_ns", "h2d_bytes", "h2d_ns") if k in d}


def run(args):
    out = dict(mode=args.mode, layers=args.layers,
               params=params_of(args.layers), steps=args.steps,
               accum=args.accum, seed=args.seed, fits=False)
    if args.mode in GMLAKE_MODES:
        import gmlake.torch
        gmlake.torch.enable(args.lib)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    out["gpu"] = torch.cuda.get_device_properties(0).name
    out["gpu_bytes"] = torch.cuda.get_device_properties(0).total_memory
    off = None
    t_build = time.perf_counter()
    try:
        model, cfg = build(args, torch)
        if args.mode == "fsdp_cpu":
            opt = fsdp_cpu(model, torch)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        if args.mode in ("offload", "offload_all"):
            import gmlake.torch
            opts = {"keep_bytes": 0} if args.mode == "offload_all" else {}
            off = gmlake.torch.offload_optimizer(opt, **opts)
        out["build_s"] = time.perf_counter() - t_build
        g = torch.Generator(device="cuda")
        g.manual_seed(args.seed)
        times, losses, before = [], [], None
        opt_s, host_ns = [], []
        probe = torch.empty((64, 64), device="cpu")  # no allocator of ours
        for k, seqs in enumerate(micro_shapes(args.seed, args.steps,
                                              args.accum)):
            t0 = time.perf_counter()
            total = torch.zeros((), device="cuda")
            for t in seqs:
                idx = torch.randint(0, cfg.vocab_size, (1, t), device="cuda",
                                    generator=g)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=idx, labels=idx).loss
                (loss / args.accum).backward()
                total += loss.detach() / args.accum
            t_opt = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt_s.append(time.perf_counter() - t_opt)
            losses.append(total.item())
            times.append(time.perf_counter() - t0)
            host_ns.append(benchlib.host_view_ns(probe))
            print("step %d: %.3f s, loss %.4f" % (k, times[-1], losses[-1]),
                  file=sys.stderr, flush=True)
            if k == 0 and args.mode in GMLAKE_MODES:
                before = gmlake_stats()
        out.update(fits=True, step_s=times, loss=losses, opt_s=opt_s,
                   host_ns=host_ns)
        if before is not None:
            after = gmlake_stats()
            out["gmlake_steady"] = {k: after[k] - before.get(k, 0)
                                    for k in after
                                    if k.startswith("call")}
            out["gmlake"] = after
        if off is not None:
            out["offloader"] = dict(off.stats)
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["error"] = "OutOfMemoryError: %s" % str(e).splitlines()[0][:300]
    except Exception as e:  # a failure of the run, reported, not raised
        out["error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
    out["peak_reserved"] = torch.cuda.max_memory_reserved()
    out["peak_allocated"] = torch.cuda.max_memory_allocated()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------
# The parent: runs, results, the table

def host_limit():
    """Host memory libgmlake may pin: 75% of the machine's."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return "%dM" % (int(line.split()[1]) * 3 // 4 // 1024)
    return "16G"


def child_env(mode, lib):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode in GMLAKE_MODES:
        env["GMLAKE_BACKEND"] = "cuda"
        env.setdefault("GMLAKE_HOST_LIMIT", host_limit())
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(REPO, "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def plan(args):
    runs = []
    for item in args.runs:
        mode, _, layers = item.partition(":")
        if mode not in MODES or not layers.isdigit():
            sys.exit("bad run %r: MODE:LAYERS, MODE one of %s" %
                     (item, ", ".join(MODES)))
        runs.append((mode, layers))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results = load(path)
    for mode, layers in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode",
               mode, "--layers", layers, "--steps", str(args.steps),
               "--accum", str(args.accum), "--seed", str(args.seed)]
        if args.lib:
            cmd += ["--lib", args.lib]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=child_env(mode, args.lib),
                               capture_output=True, text=True,
                               timeout=args.timeout)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout = "timeout", e.stdout or ""
            stderr = e.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        got = [json.loads(line[7:]) for line in stdout.splitlines()
               if line.startswith("RESULT ")]
        r = got[-1] if got else dict(mode=mode, layers=int(layers),
                                     params=params_of(int(layers)),
                                     fits=False)
        if not got:
            last = stderr.strip().splitlines()[-1:] if stderr else []
            r["error"] = "no result (exit %s%s): %s" % (
                rc, ", killed: host memory?" if rc == -9 else "",
                last[0] if last else "")
        r["wall_s"] = time.time() - t0
        r["exit"] = rc
        if not r.get("fits"):
            r["stderr_tail"] = stderr[-3000:]
        results.append(r)
        print(summary_line(r), flush=True)
        save(path, results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table(results))
    return 0


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return []


def save(path, results):
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def steady(r):
    """Mean and median of the steps after the first, seconds."""
    s = sorted(r.get("step_s", [])[1:])
    if not s:
        return None, None
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return sum(s) / n, med


def summary_line(r):
    mean, med = steady(r)
    if not r.get("fits"):
        return "%s:%d (%.2fB) %s: %s" % (
            r["mode"], r["layers"], r["params"] / 1e9,
            "does not fit" if r.get("oom") else "failed", r.get("error", ""))
    return "%s:%d (%.2fB) mean %.3f s, median %.3f s, first %.3f s, " \
        "peak reserved %.1f GiB, losses %s" % (
            r["mode"], r["layers"], r["params"] / 1e9, mean, med,
            r["step_s"][0], r["peak_reserved"] / GiB,
            " ".join("%.4f" % x for x in r["loss"]))


def host_figures(r):
    """The steps after the first: the mean host time of opt.step() and
    zero_grad() in ms (the optimizer's launches and, with offload, the
    offloader's Python), and the median ns per view of a CPU tensor after
    each step (the process's host speed, benchlib.host_view_ns); "n/a"
    where the run did not keep them."""
    o, h = r.get("opt_s", [])[1:], sorted(r.get("host_ns", [])[1:])
    return ("%.1f" % (sum(o) / len(o) * 1000) if o else "n/a",
            "%.0f" % h[len(h) // 2] if h else "n/a")


def table(results):
    rows = ["| mode | layers | params | fits | first step s | mean s "
            "(steps 2+) | median s | spread s | opt.step host ms | host ns "
            "per view | peak reserved GiB | loss first / last |",
            "|" + "---|" * 12]
    for r in results:
        mean, med = steady(r)
        s = r.get("step_s", [])[1:]
        if r.get("fits"):
            cells = ["yes", "%.3f" % r["step_s"][0], "%.3f" % mean,
                     "%.3f" % med, "%.3f-%.3f" % (min(s), max(s)),
                     *host_figures(r),
                     "%.1f" % (r["peak_reserved"] / GiB),
                     "%.4f / %.4f" % (r["loss"][0], r["loss"][-1])]
        else:
            why = "no (out of memory)" if r.get("oom") else \
                "failed: " + r.get("error", "")[:80].replace("|", "/")
            cells = [why] + [""] * 8
        rows.append("| %s | %d | %.2fB | %s |" % (
            r["mode"], r["layers"], r["params"] / 1e9, " | ".join(cells)))
    return "\n".join(rows) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "plan"):
        s = sub.add_parser(name)
        s.add_argument("--lib", default=os.environ.get("GMLAKE_LIBRARY"))
        s.add_argument("--steps", type=int, default=10)
        s.add_argument("--accum", type=int, default=8)
        s.add_argument("--seed", type=int, default=0)
    r = sub.choices["run"]
    r.add_argument("--mode", choices=MODES, required=True)
    r.add_argument("--layers", type=int, required=True)
    pl = sub.choices["plan"]
    pl.add_argument("--out", required=True)
    pl.add_argument("--timeout", type=float, default=300)
    pl.add_argument("runs", nargs="+", metavar="MODE:LAYERS")
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "plan":
        return plan(args)
    results = load(os.path.join(args.dir, "results.json"))
    sys.stdout.write(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
