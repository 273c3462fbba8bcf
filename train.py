"""
Trains the Transformer. One process:
$ python train.py config/multi30k.py
Data-parallel on one node (8 GPUs), or on CPU with gloo:
$ torchrun --nproc_per_node=8 train.py config/wmt_base.py
Settings below are defaults; a config file overrides them, then --key=value overrides both:
$ python train.py config/multi30k.py --max_steps=2000 --dtype=float32
"""
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import checkpoint
import cluster
import configurator
import dataset
import decode
import model as M
import progress
import speed

_t_process = time.time()  # a leading '_': not a setting

# -----------------------------------------------------------------------------
# I/O
data_dir = 'data/multi30k_en_de'
out_dir = 'out/multi30k_en_de'
init_from = 'auto'     # 'auto' (out_dir's run), 'scratch', 'resume', or a checkpoint to fine-tune
overwrite = False      # True: a new run deletes out_dir's old run
log_interval = 100     # steps
eval_interval = 1000   # validation loss every N steps (0 = only at the end)
bleu_interval = 0      # validation BLEU and ckpt_best.pt every N steps (0: at the end, -1: never)
bleu_beam = 4          # section 6.1
bleu_lenpen = 0.6
save_interval = 1000   # checkpoint every N steps ...
save_minutes = 0.0     # ... and/or every N minutes (the paper: every 10 minutes)
keep_last = 5          # ckpt_STEP.pt weight snapshots kept, for averaging
keep_state = 1         # state_STEP.pt training states kept, for resuming
average_last = 5       # ckpt.pt: their average (section 6.1: 5 for base, 20 for big), <= keep_last
# model (Table 3, base)
n_enc_layers = 6       # N
n_dec_layers = 6
d_model = 512
d_ff = 2048
n_heads = 8            # h
d_head = 0             # d_k = d_v (0: d_model / h)
dropout = 0.1
attn_dropout = 0.0
pre_norm = False
max_len = 1024         # the positional table's length
positions = 'sinusoidal'  # or 'learned': Table 3 row (E)
# optimisation (sections 5.3, 5.4)
max_tokens = 4096      # padded source or target tokens per GPU per micro-step
update_freq = 1        # micro-steps per update: N GPUs ~ 1 GPU with update_freq N
max_steps = 100000
max_minutes = 0.0      # stop after this much time in the loop, resumes included (0: no limit)
schedule = 'noam'      # the paper's; or 'inverse_sqrt' (fairseq's), 'constant'
lr = 5e-4              # the peak of 'inverse_sqrt' and 'constant'
lr_scale = 1.0         # on 'noam'
warmup = 4000
cooldown = 0.0         # LR falls linearly to 0 over this last share of the run
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-9
weight_decay = 0.0     # AdamW's, on matrices
label_smoothing = 0.1
clip_grad = 0.0        # max gradient norm (0: off, as the paper)
# system
device = 'auto'        # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'         # bf16 where native; or 'bfloat16', 'float32', 'float16' (GPU)
compile = False
cuda_graphs = False    # GPU: packed rows of a fixed size, steps replayed as CUDA graphs
master_weights = False  # steps on a copy in dtype, Adam on float32 (fairseq's --bf16)
checkpoint_activations = False  # backward recomputes each layer: less memory
seed = 1337
max_bad_steps = 20     # non-finite updates in a row before giving up (seen at log steps)
ddp_timeout_minutes = 60.0  # a rank's wait in a collective (NCCL's default, 10, is short)
# -----------------------------------------------------------------------------
# the configurator: config files, then --key=value, override the settings above
defaults, config = configurator.configure(globals(), sys.argv[1:])
globals().update(config)
# The settings as given and the code as read: the same command goes on with a run only if both
# match the run's (a fine-tune's architecture replaces the settings' in config later on).
given_config = dict(config)
code = checkpoint.code_digests()

# -----------------------------------------------------------------------------
# processes, device and precision
master = int(os.environ.get('RANK', 0)) == 0  # rank 0 speaks and writes for all


def log(*args, **kwargs):
    if master:
        print(*args, **kwargs)


for warning in configurator.unread_settings(config, defaults):
    log(f"warning: {warning}")

device, dtype = speed.resolve_device(device, dtype, log)
device_type = device.split(':')[0]
speed.check_settings(device_type, dtype, cuda_graphs, master_weights, update_freq,
                     checkpoint_activations)
checkpoint.make_writable(out_dir, 'out_dir')
# host_group: gloo, for stop signals, which must not wait for a GPU
ddp, rank, world, device, host_group = cluster.start(device, ddp_timeout_minutes, out_dir)
torch.manual_seed(seed + rank)
speed.configure_backends(device_type, dtype, checkpoint_activations)
# A CUDA graph casts the weights in its replays: autocast must not cache the casts.
autocast = torch.autocast(device_type, getattr(torch, dtype), enabled=dtype != 'float32',
                          cache_enabled=not cuda_graphs)
# init_from 'auto' becomes 'scratch', 'resume' or a checkpoint to fine-tune, by what out_dir holds
init_from, run_files = checkpoint.open_run(out_dir, init_from, overwrite, master, config, defaults)

# -----------------------------------------------------------------------------
# data: the token files data_prep.py writes; tokenizer: its description, kept in each checkpoint;
# enc: its tiktoken encoding; valid_ref: the validation references for BLEU
meta, tokenizer, enc, valid_ref = dataset.open_prepared(data_dir)
PAD, BOS, EOS = meta['pad_id'], meta['bos_id'], meta['eos_id']
train_data = dataset.load_split(data_dir, 'train')
valid_data = dataset.load_split(data_dir, 'valid')

# -----------------------------------------------------------------------------
# model and optimizer: new, or from the state to resume or the checkpoint to fine-tune
state, init_path, fine_tuned_from = checkpoint.initial_state(init_from, out_dir, config, meta,
                                                              tokenizer, log)
# A fine-tune keeps its checkpoint's architecture: read model_cfg, not the settings.
model_cfg = checkpoint.model_config(state, fine_tuned_from, config, meta, enc.n_vocab, log)
speed.check_heads(model_cfg, cuda_graphs)
dataset.check_sizes(train_data, valid_data, max_tokens, model_cfg.max_len, data_dir, log)
raw_model = M.Transformer(model_cfg).to(device)
if state is not None:
    checkpoint.load_weights(raw_model, state['model'], init_path)
optimizer = M.configure_optimizer(raw_model, lr=0.0, betas=(beta1, beta2), eps=adam_eps,
                                  weight_decay=weight_decay)  # lr: set at each step
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
step = 0
epoch = 0
batch_idx = 0  # the next batch of the epoch's plan
elapsed = 0.0  # training seconds so far, a resumed run's included
best_bleu = -1.0
if init_from == 'resume':
    step, epoch, batch_idx, elapsed, best_bleu = checkpoint.resume(
        state, init_path, optimizer, scaler, out_dir, seed, rank, world, device_type, log)
    code = state.get('code', code)  # the code the run began with, even after an edit
del state  # its tensors are in the model and optimizer now


graph_len = None  # cuda_graphs: the longest sentence a packed row must hold, a power of 2
if cuda_graphs:
    graph_len = speed.graph_length(dataset.pair_sizes(train_data).max(), model_cfg.max_len)


def get_batch(data, ids, packed=False):
    """-> src, tgt_in, rows (the real target tokens' rows of the B * T positions), their targets;
    packed: then also each side's Packed, where its sentences lie in its row."""
    batch = [torch.from_numpy(x) for x in dataset.collate(data, ids, PAD, BOS, EOS)]
    if packed:  # cuda_graphs: each side one row of a fixed size, left on the host
        return speed.pack_batch(batch, PAD, max_tokens + graph_len, graph_len)
    if device_type == 'cuda':  # pinned: the copy does not wait
        batch = [x.pin_memory() for x in batch]
    return [x.to(device, non_blocking=True) for x in batch]


# each update's batches for this rank, made by a thread while the step before runs
batches = dataset.updates(train_data, max_tokens, seed, rank, world, update_freq, epoch, batch_idx,
                          make_batch=lambda ids: get_batch(train_data, ids, cuda_graphs))
# An old run's files go only once every input loaded.
if init_from != 'resume' and run_files:
    checkpoint.remove_run(out_dir, run_files, ddp, master)

# -----------------------------------------------------------------------------
# the speed paths (docs/performance.md). raw_model: the float32 weights Adam steps; train_model:
# what steps run (with master_weights, a copy in dtype); model: how they call it
train_model, chunk_fn = speed.training_model(raw_model, ddp, device_type, dtype, master_weights,
                                              checkpoint_activations, compile)
model = train_model
if ddp and not cuda_graphs:  # CUDA graphs all-reduce on their own
    model = cluster.wrap_ddp(train_model, device_type)
if cuda_graphs:
    model = speed.Graphed(train_model)
step_context = autocast
if master_weights:  # the copy is in dtype already
    step_context = contextlib.nullcontext()


def every(interval):
    return interval > 0 and step % interval == 0


def get_lr(step, elapsed=0.0):
    if schedule == 'noam':  # section 5.3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        rate = lr_scale * model_cfg.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    elif schedule == 'inverse_sqrt':  # fairseq's: warmup to lr, then lr * sqrt(warmup / step)
        rate = lr * min(step / warmup, (warmup / step) ** 0.5)
    else:  # constant: linear warmup to lr, then flat
        rate = lr * min(step / warmup, 1.0)
    if cooldown == 0:
        return rate
    # the cooldown: to 0 over the run's last share, by steps or time, whichever ends it first
    done = step / max_steps
    if max_minutes > 0:
        done = max(done, elapsed / (max_minutes * 60))
    return rate * min(1.0, max(0.0, (1.0 - done) / cooldown))


@torch.no_grad()
@torch.compiler.set_stance('force_eager')  # no recompiles for evaluation
def evaluate(final=False):
    """Validation loss, and BLEU when due, over every rank's share of the batches."""
    global best_bleu
    raw_model.eval()
    totals = torch.zeros(3, device=device)  # smoothed loss, NLL, tokens
    plan = dataset.batch_plan(valid_data, max_tokens, seed, epoch=0, shuffle=False,
                              max_len=model_cfg.max_len)
    for ids in plan[rank::world]:
        src, tgt_in, rows, targets = get_batch(valid_data, ids)
        with autocast:
            x = raw_model(src, tgt_in, rows)
            loss, nll = M.label_smoothed_loss(x, raw_model.embed.weight, targets, label_smoothing)
        totals += torch.stack([loss, nll, torch.tensor(len(rows), device=device)])
    if ddp:
        dist.all_reduce(totals)
    total, nll, ntok = totals.tolist()
    record = {'step': step, 'valid_loss': total / ntok, 'valid_ppl': math.exp(nll / ntok)}
    if bleu_interval >= 0 and (final or every(bleu_interval)):
        with autocast:
            record['valid_bleu'] = decode.corpus_bleu(raw_model, valid_data, valid_ref, enc,
                                                      bleu_beam, bleu_lenpen, rank, world, ddp)
        if record['valid_bleu'] > best_bleu:
            best_bleu = record['valid_bleu']
            save(os.path.join(out_dir, 'ckpt_best.pt'), valid_bleu=best_bleu)
    raw_model.train()
    progress.validation_line(record, out_dir, master)


def save(path, full=False, **extra):
    """Weights, or with full a training state with every rank's random generators."""
    ckpt = {'model': raw_model.state_dict(), 'model_cfg': asdict(model_cfg),
            'tokenizer': tokenizer, 'step': step, 'config': config, 'data_dir': data_dir,
            'fine_tuned_from': fine_tuned_from, 'given_config': given_config, 'code': code,
            **extra}
    if full:
        rng = cluster.gather(checkpoint.rng_state(device_type), ddp, world)
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), epoch=epoch,
                    rng=rng, next_batch=batch_idx, best_bleu=best_bleu, elapsed=clock,
                    train_split=meta['splits']['train'])
    if master:
        checkpoint.save_atomic(ckpt, path)


def save_snapshots():
    """A training state and a weights snapshot; the oldest go."""
    save(os.path.join(out_dir, f'state_{step:07d}.pt'), full=True)
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))
    if master:
        checkpoint.rotate(out_dir, keep_state, keep_last)
    if ddp:
        dist.barrier()  # every rank reads them at the end


# -----------------------------------------------------------------------------
# training loop
log(json.dumps(config, indent=1))
log(f"model: {raw_model.num_params() / 1e6:.2f}M parameters; {world} process(es) x update_freq "
    f"{update_freq} x max_tokens {max_tokens}; device {device}, {dtype}; "
    f"ready {time.time() - _t_process:.1f}s after start")
t_start = time.time() - elapsed
t_last = time.time()
clock = elapsed  # under DDP the ranks agree on it at log steps, where the host waits anyway
last_save = elapsed
sums = progress.new_sums(device)
if max_minutes > 0 and elapsed > max_minutes * 60:  # resumed with the time used up
    max_steps = step
cluster.catch_stop_signals()
while step < max_steps:
    epoch, batch_idx, ntok_update, micro_batches = next(batches)
    step += 1
    lr_now = get_lr(step, clock)
    for group in optimizer.param_groups:
        group['lr'] = lr_now
    for micro, (src, tgt_in, rows, targets, *sides) in enumerate(micro_batches):
        if ddp and not cuda_graphs:  # as nanoGPT: all-reduce on the last micro-step only
            model.require_backward_grad_sync = micro == update_freq - 1
        targets = targets.to(device)  # a packed batch's are on the host
        with step_context:
            # x: the decoder's states at the real targets, projected by the shared embedding (3.4)
            x = model(src, tgt_in, rows, *sides)
            loss, nll = M.label_smoothed_loss(x, train_model.embed.weight, targets,
                                              label_smoothing, chunk_fn)
        # loss: this micro-batch's sum; / the update's tokens (all ranks) is the mean; x world
        # undoes DDP's average over the ranks
        scaler.scale(loss * world / ntok_update).backward()
        sums['loss'] += loss.detach()
        sums['nll'] += nll
    if ddp and cuda_graphs:  # DDP's hooks see no graph replay
        speed.all_reduce_grads(train_model)
    if master_weights:  # the float32 model takes the copy's gradients
        speed.gradients_to_master(raw_model, train_model)
    scaler.unscale_(optimizer)
    # the norm is taken anyway: the log shows it, and it finds non-finite updates
    max_norm = clip_grad if clip_grad > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), max_norm)
    bad = M.skip_if_non_finite(optimizer, grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if master_weights:  # and the copy its new weights
        speed.weights_to_copy(raw_model, train_model)
    progress.count_update(sums, ntok_update, bad)

    # the time budget, by the clock every rank goes by (under DDP, agreed at log steps)
    elapsed = time.time() - t_start
    log_step = step % log_interval == 0 or step == max_steps
    if not ddp:
        clock = elapsed
    elif log_step:
        clock = progress.agree(sums, elapsed)
    if max_minutes > 0 and clock > max_minutes * 60:
        log(f"max_minutes={max_minutes} reached at step {step}")
        max_steps = step  # this step is the last
        log_step = True

    # log, evaluate, save
    if log_step:
        eta = progress.time_left(step, max_steps, elapsed, max_minutes)
        progress.report(sums, out_dir, master, max_bad_steps, step=step, epoch=epoch, lr=lr_now,
                        grad_norm=grad_norm, elapsed=elapsed, eta=eta,
                        interval=time.time() - t_last)
    # the last step is evaluated after the averaging below
    if (every(eval_interval) or every(bleu_interval)) and step != max_steps:
        evaluate()
    # save: every save_interval steps or save_minutes, at the last step, and on a stop signal
    save_due = every(save_interval)
    if save_minutes > 0 and clock - last_save > save_minutes * 60:
        save_due = True
    stop_asked = cluster.stop_asked(ddp, host_group)  # SIGTERM or SIGINT
    if save_due or step == max_steps or stop_asked:
        save_snapshots()
        last_save = clock
    if stop_asked:
        cluster.exit_stopped(step, out_dir, master)
    if step % log_interval == 0:  # tokens/s leaves out a log step's evaluation and saving
        t_last = time.time()

# -----------------------------------------------------------------------------
# Section 6.1: the reported models average the last checkpoints
# From here a stop signal ends the run at once: the same command averages and evaluates again.
cluster.signals_stop_at_once(f"after the last step ({step}), averaging or evaluating", master)
newest = checkpoint.checkpoints(out_dir)[-average_last:]
raw_model.load_state_dict(checkpoint.average_checkpoints(newest))
save(os.path.join(out_dir, 'ckpt.pt'))
log(f"averaged {len(newest)} checkpoint(s) into {os.path.join(out_dir, 'ckpt.pt')}")
if master:  # the same command rerun after the end evaluates again: one record stays
    checkpoint.trim_log(out_dir, step, final=True)
evaluate(final=True)
done = f"done: step {step}, {(time.time() - t_start) / 60:.1f} min"
if best_bleu >= 0:
    done += f', best valid BLEU {best_bleu:.2f}'
log(done)
if ddp:
    dist.barrier()  # no rank leaves while another still uses the process group
cluster.exit_now(0)
