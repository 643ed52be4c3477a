"""Pre-train a course BERT with masked-language modelling and print held-out loss and accuracy.

    .venv/bin/python scripts/pretrain_bert.py --model mini --steps 100 --threads 2
    .venv/bin/python scripts/pretrain_bert.py --model mini --steps 3000 --device cuda --json out.json

Prints the held-out MLM loss and masked-word top-1 accuracy before and after, the steps, the
tokens seen and the wall time of the training loop (on a shared machine, quote steps and
tokens; the seconds depend on the neighbours).
"""

from __future__ import annotations

import argparse
import json

import torch

from minidist.models.pretrain import PretrainConfig, pretrain_mlm


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="mini")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of the steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    cfg = PretrainConfig(
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=warmup,
        seed=args.seed,
    )
    result = pretrain_mlm(cfg, log_every=args.log_every, device=torch.device(args.device))
    numbers = {
        "model": args.model,
        "device": args.device,
        "threads": args.threads,
        "steps": result.steps,
        "batch": f"{cfg.batch_size}x{cfg.seq_len}",
        "tokens": result.tokens,
        "train_seconds": round(result.train_seconds, 1),
        "before_loss": round(result.before.loss, 3),
        "before_accuracy": round(result.before.accuracy, 4),
        "after_loss": round(result.after.loss, 3),
        "after_accuracy": round(result.after.accuracy, 4),
        "masked_eval_tokens": result.after.masked_tokens,
    }
    print(json.dumps(numbers, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)


if __name__ == "__main__":
    main()
