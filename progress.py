"""
What train.py reports as it trains: every log_interval steps a line (loss, perplexity, learning
rate, gradient norm, target tokens/s, time, ETA), the same as a record in out_dir's log.jsonl, and
the stop after too many non-finite updates in a row. The sums behind the line stay on the device
between log steps: reading them at each step would make the host wait for a GPU. Validation
records are printed and kept the same way.
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist


def new_sums(device):
    """The counts since the last log line; bad_run: the non-finite updates in a row just now."""
    sums = {'tokens': 0}
    for key in ('loss', 'nll', 'bad_run', 'worst_run', 'skipped'):
        sums[key] = torch.zeros((), device=device)
    return sums


def count_update(sums, ntok, bad):
    """An update's target tokens, and whether its gradients were non-finite (a 0-d bool tensor)."""
    sums['tokens'] += ntok
    # on the device, no wait for the host: the run grows by one, or restarts at 0 if bad is False
    sums['bad_run'] = (sums['bad_run'] + 1) * bad
    sums['worst_run'] = torch.maximum(sums['worst_run'], sums['bad_run'])
    sums['skipped'] = sums['skipped'] + bad


def agree(sums, elapsed):
    """Under DDP, at a log step: the loss sums over every rank's tokens, and the clock of the
    slowest rank, which every rank then goes by."""
    both = torch.stack([sums['loss'], sums['nll']])
    slowest = torch.tensor(elapsed, device=both.device)
    dist.all_reduce(both)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    sums['loss'], sums['nll'] = both
    return slowest.item()


def report(sums, out_dir, master, max_bad_steps, **values):
    """At a log step, on every rank: the stop after too many non-finite updates in a row, rank 0's
    line and record (log_line's values), and new sums."""
    stop_if_diverged(sums, max_bad_steps)
    if master:
        log_line(sums, out_dir, **values)
    reset(sums)


def stop_if_diverged(sums, max_bad_steps):
    """Every rank reads the same count (each takes the norm of the same all-reduced gradients):
    all stop together."""
    worst_run = int(sums['worst_run'].item())
    if worst_run >= max_bad_steps:
        sys.exit(f"{worst_run} non-finite updates in a row: lower the learning rate, "
                 f"use dtype='bfloat16' or 'float32', or set clip_grad")


def time_left(step, max_steps, elapsed, max_minutes):
    """Seconds left, by the steps or the time budget that ends the run first."""
    left = (max_steps - step) * elapsed / step
    if max_minutes > 0:
        left = min(left, max_minutes * 60 - elapsed)
    return max(left, 0)


def log_line(sums, out_dir, step, epoch, lr, grad_norm, elapsed, eta, interval):
    """The line and its record, of the updates since the last one; they took interval seconds."""
    tokens = sums['tokens']
    loss = sums['loss'].item() / tokens
    ppl = math.exp(min(sums['nll'].item() / tokens, 50))  # a diverged run's exp would overflow
    grad_norm = grad_norm.item()
    print(f"step {step} | epoch {epoch} | loss {loss:.3f} | ppl {ppl:.2f} | lr {lr:.2e} | "
          f"gnorm {grad_norm:.2f} | {tokens / interval:,.0f} tgt tok/s | "
          f"{elapsed / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
    append(out_dir, dict(step=step, epoch=epoch, loss=loss, ppl=ppl, lr=lr, grad_norm=grad_norm,
                         tok_per_s=tokens / interval, elapsed_min=elapsed / 60, eta_min=eta / 60,
                         skipped=int(sums['skipped'].item())))  # skipped: non-finite updates


def reset(sums):
    sums['tokens'] = 0
    for key in ('loss', 'nll', 'worst_run', 'skipped'):  # bad_run: a run spans log steps
        sums[key].zero_()


def validation_line(record, out_dir, master):
    """Rank 0 prints a validation record and appends it to log.jsonl."""
    if not master:
        return
    scores = [f"{key} {value:.4g}" for key, value in record.items() if key != 'step']
    print(f"step {record['step']} | " + ' | '.join(scores))
    append(out_dir, record)


def append(out_dir, record):
    """log.jsonl opens with the first record: a run stopped before it leaves none behind."""
    with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
        f.write(json.dumps(record) + '\n')
