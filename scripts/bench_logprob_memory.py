#!/usr/bin/env python
"""Peak memory of the log-probs (forward + backward): ``token_log_probs`` before and after
issue 7, and with ``--head`` the LM head itself, verl's stock path against the sharing head.

Counts the bytes of every tensor storage created while the computation runs and still alive
(a ``TorchDispatchMode`` that weakly references each new storage), at every aten op boundary,
and reports the peak in units of one ``(T_flat, vocab)`` fp32 buffer. The logits themselves are
not counted; their gradient is (one buffer for fp32 logits, half for bf16).

"before" is the autograd-traced implementation as it was at commit ``BEFORE`` (read from git
into memory, so the package keeps one implementation); "after" is the installed one. The
micro-batch is GRPO-shaped: one prompt (a quarter of the flat rows) shared by 4 responses.

    python scripts/bench_logprob_memory.py [--tokens 4096] [--vocab 32768] [--after-only]

``--head`` (needs verl: run it with a verl environment's python) starts from hidden states
``(T, hidden)`` and the head's ``(vocab, hidden)`` weight instead of logits, on the same GRPO
micro-batch read from the prompt's last position on (verl's read window), and prints, runs
interleaved: verl's stock FSDP-engine path on the plain packed batch (``lm_head`` ->
``(T_total, vocab)`` logits -> ``logprobs_from_logits`` + ``entropy_from_logits``; on CPU
verl's log_softmax fallback, flash-attn's in-place cross-entropy is CUDA-only), verl's fused
kernel (``use_fused_kernels``, torch backend) on the plain batch, and the sharing head
(:func:`prefix_sharing.head_logprobs.hidden_token_stats`) on the flat layout. In GiB of live
tensor bytes (inputs and their weight gradient not counted; the hidden states' gradient is):

    python scripts/bench_logprob_memory.py --head --tokens 2048 8192 --vocab 152064
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.head_logprobs import read_positions
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.plan import SharingPlan

BEFORE = "da0cd17807d31288a0d9c44179bc282735623cd8"  # last commit of the traced implementation
ROOT = Path(__file__).resolve().parents[1]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive; the peak of that.

    Storages of ``existing`` tensors (the inputs) are never counted, nor are views and in-place
    results, which reuse a storage already known. Frees are noticed at the next op, so the peak
    is exact at op boundaries (a kernel's internal scratch space is not seen).
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self._known = {t.untyped_storage()._cdata for t in existing}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.now -= nbytes
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self._known and storage._cdata not in self._live:
                    self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def grpo_plan(tokens: int, vocab: int, responses: int = 4) -> SharingPlan:
    """One prompt of ``tokens // 4`` rows read by ``responses`` sequences that own the rest."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (tokens // 4,), generator=g)
    tail = (tokens - prompt.numel()) // responses
    seqs = [torch.cat([prompt, torch.randint(0, vocab, (tail,), generator=g)])
            for _ in range(responses)]
    return build_plan(seqs, PrefixSharingConfig(min_prefix_len=1))


def measure(log_probs_fn: Callable, plan: SharingPlan, vocab: int, dtype: torch.dtype) -> dict:
    """Peak extra bytes of forward, held for backward, and forward+backward, of the loss
    ``sum(w * log_probs) + sum(entropy)`` (both outputs get a gradient)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(plan.num_tokens_flat, vocab, generator=g).to(dtype).requires_grad_()
    weights = torch.rand(plan.num_tokens_total, generator=g)
    plan_tensors = [plan.kv_index, plan.next_token_ids, plan.is_last_token]
    with LiveBytes([logits, weights, *plan_tensors]) as mode:
        stats = log_probs_fn(logits, plan)
        loss = (weights * stats.log_probs).sum() + stats.entropy.sum()
        forward_peak, held = mode.peak, mode.now
        loss.backward()
    return {"forward": forward_peak, "held": held, "total": mode.peak}


def measure_head(path: str, plan: SharingPlan, vocab: int, hidden_size: int,
                 read_from: list[int]) -> int:
    """Peak live bytes of one ``path`` (``stock``, ``fused`` or ``shared``) from hidden states
    to ``sum(w * log_probs) + sum(entropy)`` and its backward (hidden states and weight)."""
    import torch.nn.functional as F

    from prefix_sharing.head_logprobs import hidden_token_stats

    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).requires_grad_()
    flat = torch.randn(plan.num_tokens_flat, hidden_size, generator=g)
    plain = plan.restore(flat).requires_grad_()  # [T_total, hidden]: the plain batch's rows
    flat.requires_grad_()
    labels = torch.roll(plan.token_ids, -1)  # verl's rolled labels on the packed batch
    with LiveBytes([weight, flat, plain, labels, plan.kv_index, plan.next_token_ids,
                    plan.is_last_token]) as mode:
        if path == "shared":
            log_probs, entropy = hidden_token_stats(flat, weight, plan, read_from=read_from)
        elif path == "fused":
            from verl.utils.experimental.torch_functional import FusedLinearForPPO

            log_probs, entropy = FusedLinearForPPO().forward(plain, weight, labels)
        else:
            from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

            logits = F.linear(plain, weight)  # [T_total, vocab]: the HF model's output
            entropy = entropy_from_logits(logits)
            log_probs = logprobs_from_logits(logits, labels, inplace_backward=False)
            del logits
        (log_probs.sum() + entropy.sum()).backward()
    return mode.peak


def head_main(tokens: list[int], vocab: int, hidden_size: int, stock_limit: float) -> None:
    """``--head``: the three paths per token count, interleaved; the stock path skipped where
    its measured bytes per logit predict more than ``stock_limit`` GiB (the fused kernel and
    the sharing head are bounded by their chunks: they always run)."""
    gib = 2**30
    per_logit = {}  # path -> peak bytes / (T_total * vocab), from the smallest run
    print(f"V={vocab} hidden={hidden_size}; peak live GiB (forward + backward)")
    print(f"{'T_total':>8} {'T_flat':>7} {'read rows':>9} {'stock':>8} {'fused':>8} {'shared':>8}")
    for total in sorted(tokens):
        plan = grpo_plan(total, vocab)
        read_from = [total // 4 - 1] * plan.num_sequences  # each prompt's last position on
        rows = plan.kv_index[read_positions(plan, read_from)].unique().numel()
        cells = {}
        for path in ("stock", "fused", "shared"):
            predicted = per_logit.get(path, 0) * plan.num_tokens_total * vocab / gib
            if path == "stock" and predicted > stock_limit:  # the others are bounded
                cells[path] = f"~{predicted:.1f}*"
                continue
            peak = measure_head(path, plan, vocab, hidden_size, read_from)
            per_logit.setdefault(path, peak / (plan.num_tokens_total * vocab))
            cells[path] = f"{peak / gib:.3f}"
        print(f"{plan.num_tokens_total:>8} {plan.num_tokens_flat:>7} {rows:>9} "
              f"{cells['stock']:>8} {cells['fused']:>8} {cells['shared']:>8}")
    print("* not run: predicted from the stock path's bytes per (token x vocab) logit, over "
          f"--stock-limit {stock_limit} GiB")
    for path, value in per_logit.items():
        print(f"{path}: {value:.2f} bytes per (T_total x vocab) logit at the smallest size")


def before_implementation() -> Callable:
    """``token_log_probs`` as of :data:`BEFORE`, loaded from git into a throwaway module."""
    shown = subprocess.run(["git", "show", f"{BEFORE}:prefix_sharing/logprobs.py"], cwd=ROOT,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"cannot read the 'before' implementation from git "
                         f"({shown.stderr.strip()}); run with --after-only, or in a full clone")
    source = shown.stdout
    module = ModuleType("prefix_sharing._logprobs_before")
    module.__package__ = "prefix_sharing"
    exec(compile(source, f"{BEFORE[:8]}:prefix_sharing/logprobs.py", "exec"), module.__dict__)
    return module.token_log_probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096],
                        help="flat rows T_flat (--head: one run per value)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--after-only", action="store_true",
                        help="skip the 'before' rows (no git history needed)")
    parser.add_argument("--head", action="store_true",
                        help="from hidden states: verl's stock path vs the sharing head")
    parser.add_argument("--hidden", type=int, default=64, help="--head: hidden size")
    parser.add_argument("--stock-limit", type=float, default=5.0,
                        help="--head: GiB above which the stock paths are predicted, not run")
    args = parser.parse_args()
    if args.head:
        head_main(args.tokens, args.vocab, args.hidden, args.stock_limit)
        return
    plan = grpo_plan(args.tokens[0], args.vocab)
    buffer = plan.num_tokens_flat * args.vocab * 4
    impls = {"after": token_log_probs}
    if not args.after_only:
        impls = {"before": before_implementation(), **impls}
    print(f"T_flat={plan.num_tokens_flat} T_total={plan.num_tokens_total} V={args.vocab}: "
          f"one (T_flat, V) fp32 buffer = {buffer / 2**20:.1f} MiB; peaks in buffers")
    print(f"{'impl':<7} {'logits':<9} {'forward':>8} {'held':>8} {'fwd+bwd':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in impls.items():
            m = measure(fn, plan, args.vocab, dtype)
            print(f"{name:<7} {str(dtype).removeprefix('torch.'):<9} {m['forward'] / buffer:>8.2f} "
                  f"{m['held'] / buffer:>8.2f} {m['total'] / buffer:>8.2f}")


if __name__ == "__main__":
    main()
