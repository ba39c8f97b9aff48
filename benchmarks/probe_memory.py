"""Where linear_cross_entropy's peak memory goes (llama3.1-8b shape, bf16, one GPU).

For the default and a logits-sized budget: memory after the forward, the peaks of the
forward and of the backward, the peak beyond the two gradients, and every allocation
above 100 MiB of one forward+backward with its Python frames (torch.cuda.memory
history). Found that autograd handed the backward a zero-filled gradient for the kept
columns (PERFORMANCE.md section 16).

    python benchmarks/probe_memory.py
"""

import torch

import logitless

M = 2**20


def main():
    n, h, v = 4096, 4096, 128256
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    for label, budget in [("default", None), ("logits", n * v * 2)]:
        for _ in range(2):
            x.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = logitless.linear_cross_entropy(x, w, t, memory_budget=budget)
            torch.cuda.synchronize()
            after_f = torch.cuda.memory_allocated() - base
            peak_f = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            peak_b = torch.cuda.max_memory_allocated() - base
            grads = x.grad.nbytes + w.grad.nbytes
        print(f"{label}: after fwd {after_f / M:.0f} MiB, peak fwd {peak_f / M:.0f}, peak bwd {peak_b / M:.0f} "
              f"(incl. grads {grads / M:.0f}) -> extra {(max(peak_f, peak_b) - grads) / M:.0f} MiB")
        x.grad = w.grad = None
        torch.cuda.memory._record_memory_history(max_entries=100000, context="all", stacks="python")
        logitless.linear_cross_entropy(x, w, t, memory_budget=budget).backward()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        for trace in snap["device_traces"]:
            for b in trace:
                if b["action"] == "alloc" and b["size"] > 100 * M:
                    frames = [f"{f['filename'].split('site-packages/')[-1].split('src/')[-1]}:{f['line']}:{f['name']}"
                              for f in b["frames"]]
                    frames = [f for f in frames if "??" not in f][:4]
                    print(f"   alloc {b['size'] / M:.0f} MiB at {' <- '.join(frames) or '(no Python frame: C++)'}")


if __name__ == "__main__":
    main()
