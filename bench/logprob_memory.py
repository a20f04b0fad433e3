"""Peak memory of the token log-prob path (forward + backward) on a 151,936-token vocabulary.

Compares `asyncrl.algo.loss.token_logprobs` (chunked, fused: no float32 copy of the whole
`[B, T, V]` logits) with the unchunked path it replaced (float32 copy, one log-softmax through
`cross_entropy`, its gradient), each in a fresh process, logits in float32 and bfloat16.
Memory is the process's peak RSS above its level once the logits exist (CPU), or
`torch.cuda.max_memory_allocated` above the same point (`--device cuda`). Prints a table and
writes `bench/results/logprob_memory.json`.

    python bench/logprob_memory.py [--tokens 2048] [--vocab 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

CHILD = r"""
import json, resource, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
from asyncrl.algo.loss import token_logprobs
path, dtype, tokens, vocab, dev = {path!r}, {dtype!r}, {tokens}, {vocab}, {device!r}
def old(logits, ids):
    b, t, v = logits.shape
    lg = logits[:, :-1].float()
    nll = F.cross_entropy(lg.reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
    return F.pad(-nll.view(b, t - 1), (1, 0))
fn = old if path == "unchunked" else token_logprobs
x = torch.randn(1, tokens, vocab, dtype=getattr(torch, dtype), device=dev).requires_grad_()
ids = torch.randint(0, vocab, (1, tokens), device=dev)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if dev == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    base = rss()
t0 = time.perf_counter()
fn(x, ids).sum().backward()
if dev == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    peak = rss() - base
print(json.dumps(dict(extra_bytes=peak, seconds=time.perf_counter() - t0,
                      logits_bytes=x.numel() * x.element_size())))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(RESULTS / "logprob_memory.json"))
    a = p.parse_args()
    rows = []
    print(f"{'dtype':<9} {'path':<10} {'logits GiB':>10} {'extra GiB':>10} {'x logits':>9} {'s':>6}")
    for dtype in ("float32", "bfloat16"):
        for path in ("unchunked", "chunked"):
            code = CHILD.format(root=str(ROOT), path=path, dtype=dtype, tokens=a.tokens,
                                vocab=a.vocab, device=a.device)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout
            r = json.loads(out.strip().splitlines()[-1]) | dict(dtype=dtype, path=path)
            rows.append(r)
            print(f"{dtype:<9} {path:<10} {r['logits_bytes'] / 2**30:>10.2f} "
                  f"{r['extra_bytes'] / 2**30:>10.2f} {r['extra_bytes'] / r['logits_bytes']:>9.2f}"
                  f" {r['seconds']:>6.2f}", flush=True)
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(dict(tokens=a.tokens, vocab=a.vocab, device=a.device,
                                        time=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows),
                                   indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
