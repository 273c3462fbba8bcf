"""
Trains the Transformer. One process:
$ python train.py config/multi30k.py
Data-parallel on one node (8 GPUs), or on CPU with gloo:
$ torchrun --nproc_per_node=8 train.py config/wmt_base.py
Settings below are defaults; a config file overrides them, then --key=value overrides both:
$ python train.py config/multi30k.py --max_steps=2000 --dtype=float32
"""
import ast
import contextlib
import glob
import json
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data_prep
import model as M
import translate

# -----------------------------------------------------------------------------------------------
# I/O
data_dir = 'data/multi30k_en_de'
out_dir = 'out/multi30k_en_de'
init_from = 'scratch'        # 'scratch' or 'resume' (newest checkpoint in out_dir)
log_interval = 100           # steps
eval_interval = 1000         # validation loss every N steps (0 = only at the end)
bleu_interval = 0            # validation BLEU every N steps (0: only at the end, -1: never); best kept as ckpt_best.pt
bleu_beam = 4
save_interval = 1000         # full-state checkpoint every N steps ...
save_minutes = 0.0           # ... and/or every N minutes (the paper: every 10 minutes)
keep_last = 5                # newest checkpoints kept on disk
average_last = 5             # ckpt.pt = average of the newest N (section 6.1: 5 for base, 20 for big)
# model (Table 3, base)
n_enc_layers = 6
n_dec_layers = 6
d_model = 512
d_ff = 2048
n_heads = 8
dropout = 0.1
attn_dropout = 0.0
pre_norm = False
max_len = 1024
# optimisation (section 5.3, 5.4)
max_tokens = 4096            # padded source or target tokens per GPU per micro-step
update_freq = 1              # micro-steps accumulated per update: N GPUs ~ 1 GPU with update_freq N
max_steps = 100000
max_minutes = 0.0            # also stop after this much wall time (0 = no limit)
schedule = 'noam'            # 'noam': the paper's formula; 'inverse_sqrt': fairseq's linear warmup to lr
lr = 5e-4                    # peak learning rate of 'inverse_sqrt'
lr_scale = 1.0               # multiplier on the 'noam' formula
warmup = 4000
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-9
weight_decay = 0.0
label_smoothing = 0.1
clip_grad = 0.0              # max gradient norm (0 = off; the paper does not clip)
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto' (bfloat16 where native, see model.fast_dtype), 'bfloat16', 'float16' (GPU,
                             # with a gradient scaler) or 'float32'
compile = False
seed = 1337
max_bad_steps = 20           # consecutive non-finite updates before giving up
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]


def override(config, args):
    """nanoGPT's configurator, strict: a config file is executed over the defaults, then each
    --key=value is parsed as a Python literal; unknown keys and wrong types name the key."""
    def check(key, value, where):
        if key not in config:
            sys.exit(f"{where}: unknown setting {key!r}")
        old = config[key]
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(old, float):
            value = float(value)
        if type(value) is not type(old):
            sys.exit(f"{where}: {key} must be {type(old).__name__}, got {value!r}")
        config[key] = value
    for arg in args:
        if not arg.startswith('--'):
            if not os.path.exists(arg):
                sys.exit(f"config file {arg} not found")
            scope = {}
            exec(open(arg).read(), {}, scope)
            for key, value in scope.items():
                if not key.startswith('_'):
                    check(key, value, arg)
        else:
            key, eq, value = arg[2:].partition('=')
            if not eq:
                sys.exit(f"{arg}: expected --key=value")
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass  # a bare word is a string
            check(key, value, arg)
    return config


config = override({k: globals()[k] for k in config_keys}, sys.argv[1:])
globals().update(config)

# -----------------------------------------------------------------------------------------------
# processes, device and precision
ddp = 'RANK' in os.environ
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
if ddp:
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
else:
    rank, world = 0, 1
master = rank == 0
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
if dtype == 'float16' and device_type == 'cpu':
    sys.exit("dtype='float16' needs a GPU; use 'bfloat16' or 'float32' on CPU")
if dtype == 'auto':
    dtype = M.fast_dtype(device_type)
elif dtype == 'bfloat16' and M.fast_dtype(device_type) != 'bfloat16' and master:
    print(f"WARNING: this {device_type} has no native bfloat16 matrix multiply; dtype='bfloat16' will be far "
          "slower than 'float32' (dtype='auto' picks the faster one)", file=sys.stderr)
torch.manual_seed(seed + rank)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
if device_type == 'cpu' and dtype == 'bfloat16':
    # At sentence lengths the CPU flash-attention kernel is slower than the plain one in bf16: a step
    # of the Multi30k model (4096 tokens, 2 cores) took 1.01 s with it and 0.80 s without. In float32
    # they are within 5% (1.03 vs 1.08 s at 2048 tokens). The switch is named 'cuda' but governs the CPU too.
    torch.backends.cuda.enable_flash_sdp(False)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = (contextlib.nullcontext() if dtype == 'float32'
            else torch.autocast(device_type=device_type, dtype=ptdtype))
log = print if master else (lambda *a, **k: None)

# -----------------------------------------------------------------------------------------------
# data: the token files data_prep.py writes
if not os.path.exists(os.path.join(data_dir, 'meta.json')):
    sys.exit(f"no prepared data in {data_dir} (meta.json missing): run e.g. "
             f"`python data_prep.py multi30k --src en --tgt de --out {data_dir}`")
meta = json.load(open(os.path.join(data_dir, 'meta.json')))
src_lang, tgt_lang, PAD, BOS, EOS = meta['src'], meta['tgt'], meta['pad_id'], meta['bos_id'], meta['eos_id']


def load_split(split):
    def read(lang):
        tokens = np.memmap(os.path.join(data_dir, f'{split}.{lang}.bin'), dtype=meta['dtype'], mode='r')
        return tokens, np.fromfile(os.path.join(data_dir, f'{split}.{lang}.idx'), dtype=np.int64)
    return read(src_lang) + read(tgt_lang)


def batch_plan(data, epoch, shuffle=True):
    """Token-based batches as fairseq builds them: sentences shuffled, then stably sorted by length
    (so batches hold similar lengths and little padding), filled up to max_tokens padded tokens,
    and the batches shuffled. The same seed and epoch give the same plan on every rank."""
    _, src_idx, _, tgt_idx = data
    size = np.maximum(np.diff(src_idx), np.diff(tgt_idx)) + 1  # + EOS (or BOS)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(size)) if shuffle else np.arange(len(size))
    order = order[np.argsort(size[order], kind='stable')]
    batches, start, sizes = [], 0, size[order].tolist()
    for end in range(1, len(order) + 1):
        if end == len(order) or (end + 1 - start) * sizes[end] > max_tokens:
            batches.append(order[start:end])
            start = end
    too_long = [b for b in batches if len(b) == 1 and size[b[0]] > max_tokens]
    if too_long:
        log(f"warning: {len(too_long)} sentence pairs longer than max_tokens={max_tokens} are skipped")
        batches = [b for b in batches if not (len(b) == 1 and size[b[0]] > max_tokens)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def get_batch(data, ids):
    src_tok, src_idx, tgt_tok, tgt_idx = data
    srcs = [src_tok[src_idx[i]:src_idx[i + 1]] for i in ids]
    tgts = [tgt_tok[tgt_idx[i]:tgt_idx[i + 1]] for i in ids]
    src = np.full((len(ids), max(map(len, srcs)) + 1), PAD, dtype=np.int64)
    tgt_in = np.full((len(ids), max(map(len, tgts)) + 1), PAD, dtype=np.int64)
    tgt_out = tgt_in.copy()
    for row, (s, t) in enumerate(zip(srcs, tgts)):
        src[row, :len(s)], src[row, len(s)] = s, EOS
        tgt_in[row, 0], tgt_in[row, 1:len(t) + 1] = BOS, t
        tgt_out[row, :len(t)], tgt_out[row, len(t)] = t, EOS
    return [torch.from_numpy(x).to(device, non_blocking=True) for x in (src, tgt_in, tgt_out)]


train_data, valid_data = load_split('train'), load_split('valid')
train_tgt_len = np.diff(train_data[3]) + 1  # + EOS: the target tokens the loss counts
tokenizer = data_prep.tokenizer_dict(data_dir)
enc = data_prep.load_tokenizer(tokenizer)
valid_src = open(os.path.join(data_dir, f'valid.{src_lang}.txt'), encoding='utf-8').read().splitlines()
valid_ref = open(os.path.join(data_dir, f'valid.{tgt_lang}.txt'), encoding='utf-8').read().splitlines()

# -----------------------------------------------------------------------------------------------
# model, optimiser, and the state to resume from
ckpts = sorted(glob.glob(os.path.join(out_dir, 'ckpt_[0-9]*.pt')))
if init_from == 'resume' and not ckpts:
    sys.exit(f"init_from='resume' but {out_dir} has no ckpt_*.pt")
state = torch.load(ckpts[-1], map_location='cpu', weights_only=False) if init_from == 'resume' else None
if state is not None:
    log(f"resuming from {ckpts[-1]} (step {state['step']})")
    model_cfg = M.Config(**state['model_cfg'])
else:
    # Round the vocabulary up to a multiple of 8 so the output matmul maps onto tensor cores.
    model_cfg = M.Config(vocab_size=(meta['vocab_size'] + 7) // 8 * 8, n_enc_layers=n_enc_layers,
                         n_dec_layers=n_dec_layers, d_model=d_model, d_ff=d_ff, n_heads=n_heads, dropout=dropout,
                         attn_dropout=attn_dropout, pre_norm=pre_norm, max_len=max_len,
                         pad_id=PAD, bos_id=BOS, eos_id=EOS)
raw_model = M.Transformer(model_cfg).to(device)
optimizer = torch.optim.Adam(raw_model.parameters(), lr=0.0, betas=(beta1, beta2), eps=adam_eps,
                             weight_decay=weight_decay, fused=device_type == 'cuda')
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
step, epoch, batch_idx, best_bleu = 0, 0, 0, -1.0
if state is not None:
    raw_model.load_state_dict(state['model'])
    optimizer.load_state_dict(state['optimizer'])
    scaler.load_state_dict(state['scaler'])
    step, epoch, batch_idx, best_bleu = state['step'], state['epoch'], state['batch_idx'], state['best_bleu']
    if master:  # other ranks only draw dropout masks, which need not match an earlier run
        torch.set_rng_state(state['rng']['cpu'])
        if device_type == 'cuda' and state['rng']['cuda'] is not None:
            torch.cuda.set_rng_state(state['rng']['cuda'])
    else:
        torch.manual_seed(seed + rank + 1000003 * step)
    del state
model = torch.compile(raw_model) if compile else raw_model
if ddp:
    model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == 'cuda' else None)


def get_lr(step):
    if schedule == 'noam':  # section 5.3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        return lr_scale * model_cfg.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    if schedule == 'inverse_sqrt':  # fairseq: linear warmup to lr, then lr * sqrt(warmup / step)
        return lr * min(step / warmup, (warmup / step) ** 0.5)
    sys.exit(f"schedule must be 'noam' or 'inverse_sqrt', got {schedule!r}")


@torch.no_grad()
def validation_loss():
    raw_model.eval()
    total = nll = ntok = 0.0
    for ids in batch_plan(valid_data, 0, shuffle=False):
        src, tgt_in, tgt_out = get_batch(valid_data, ids)
        with autocast:
            loss, n_ll, n = M.label_smoothed_loss(raw_model(src, tgt_in), tgt_out, label_smoothing, PAD)
        total, nll, ntok = total + loss.item(), nll + n_ll.item(), ntok + n.item()
    raw_model.train()
    return total / ntok, math.exp(nll / ntok)


def validation_bleu():
    raw_model.eval()
    with autocast:
        hyps = list(translate.translate_lines(raw_model, enc, valid_src, beam=bleu_beam))
    raw_model.train()
    return translate.bleu(hyps, valid_ref).score


def save(path, full=True):
    ckpt = {'model': raw_model.state_dict(), 'model_cfg': asdict(model_cfg), 'tokenizer': tokenizer,
            'step': step, 'config': config, 'data_dir': data_dir}
    if full:
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), epoch=epoch,
                    batch_idx=batch_idx, best_bleu=best_bleu,
                    rng={'cpu': torch.get_rng_state(),
                         'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})
    translate.save_atomic(ckpt, path)


def evaluate(final=False):
    global best_bleu
    record = {'step': step}
    record['valid_loss'], record['valid_ppl'] = validation_loss()
    if bleu_interval >= 0 and (final or (bleu_interval and step % bleu_interval == 0)):
        record['valid_bleu'] = validation_bleu()
        if record['valid_bleu'] > best_bleu:
            best_bleu = record['valid_bleu']
            save(os.path.join(out_dir, 'ckpt_best.pt'), full=False)
    log(' | '.join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    logfile.write(json.dumps(record) + '\n')
    logfile.flush()


# -----------------------------------------------------------------------------------------------
# training loop
if master:
    os.makedirs(out_dir, exist_ok=True)
    logfile = open(os.path.join(out_dir, 'log.jsonl'), 'a')
    print(json.dumps(config, indent=1))
    print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters; {world} process(es) x update_freq "
          f"{update_freq} x max_tokens {max_tokens}; device {device}, {dtype}")
plan = batch_plan(train_data, epoch)
per_update = world * update_freq
t_start = t_last = last_save = time.time()
tokens_since, bad_steps = 0, 0
raw_model.train()
while step < max_steps:
    if (batch_idx + 1) * per_update > len(plan):  # the epoch's last few batches do not fill an update
        epoch, batch_idx = epoch + 1, 0
        plan = batch_plan(train_data, epoch)
        if per_update > len(plan):
            sys.exit(f"the training set has fewer than {per_update} batches: lower max_tokens")
    update = plan[batch_idx * per_update:(batch_idx + 1) * per_update]
    # Every rank holds the same plan, so each knows the update's global target-token count without a
    # collective; normalising by it makes N ranks and update_freq N give the same update.
    ntok_update = sum(int(train_tgt_len[ids].sum()) for ids in update)
    step, batch_idx = step + 1, batch_idx + 1
    lr_now = get_lr(step)
    for group in optimizer.param_groups:
        group['lr'] = lr_now
    loss_sum = nll_sum = 0.0
    try:
        for micro in range(update_freq):
            src, tgt_in, tgt_out = get_batch(train_data, update[micro * world + rank])
            if ddp:  # all-reduce gradients only on the last micro-step
                model.require_backward_grad_sync = micro == update_freq - 1
            with autocast:
                loss, nll, _ = M.label_smoothed_loss(model(src, tgt_in), tgt_out, label_smoothing, PAD)
            # DDP averages gradients over ranks; scaling by world turns that average into the sum.
            scaler.scale(loss * world / ntok_update).backward()
            loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
    except torch.cuda.OutOfMemoryError:
        sys.exit(f"CUDA out of memory at max_tokens={max_tokens}: lower max_tokens and raise update_freq "
                 f"to keep the same tokens per update")
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip_grad if clip_grad > 0 else float('inf'))
    if torch.isfinite(grad_norm):  # the gradients are all-reduced, so every rank agrees
        scaler.step(optimizer)
        bad_steps = 0
    else:  # skipped; with float16 the scaler also lowers its scale, which is how fp16 recovers
        bad_steps += 1
        log(f"warning: step {step}: non-finite gradient norm, update skipped ({bad_steps} in a row)")
        if bad_steps >= max_bad_steps:
            sys.exit(f"{bad_steps} non-finite updates in a row: lower the learning rate, use dtype='bfloat16' "
                     f"or 'float32', or set clip_grad")
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    tokens_since += ntok_update
    elapsed = time.time() - t_start
    if max_minutes > 0:  # every rank must stop at the same step
        stop = torch.tensor(float(elapsed > max_minutes * 60))
        if ddp:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            log(f"max_minutes={max_minutes} reached at step {step}")
            max_steps = step
    if master and (step % log_interval == 0 or step == max_steps):
        dt, t_last = time.time() - t_last, time.time()
        loss_tok, ppl = loss_sum * world / ntok_update, math.exp(min(nll_sum * world / ntok_update, 50))
        eta = (max_steps - step) * elapsed / step
        if max_minutes > 0:
            eta = min(eta, max_minutes * 60 - elapsed)
        record = dict(step=step, epoch=epoch, loss=loss_tok, ppl=ppl, lr=lr_now, grad_norm=grad_norm.item(),
                      tok_per_s=tokens_since / dt, elapsed_min=elapsed / 60, eta_min=max(eta, 0) / 60)
        print(f"step {step} | epoch {epoch} | loss {loss_tok:.3f} | ppl {ppl:.2f} | lr {lr_now:.2e} | "
              f"gnorm {grad_norm.item():.2f} | {tokens_since / dt:,.0f} tgt tok/s | "
              f"{elapsed / 60:.1f} min | ETA {max(eta, 0) / 60:.1f} min", flush=True)
        logfile.write(json.dumps(record) + '\n')
        logfile.flush()
        tokens_since = 0
    if master and eval_interval and step % eval_interval == 0 and step != max_steps:
        evaluate()
    if master and ((save_interval and step % save_interval == 0) or
                   (save_minutes and time.time() - last_save > save_minutes * 60) or step == max_steps):
        save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))
        last_save = time.time()
        for old in sorted(glob.glob(os.path.join(out_dir, 'ckpt_[0-9]*.pt')))[:-keep_last]:
            os.remove(old)
    if master and step % log_interval == 0:
        t_last = time.time()  # evaluation and saving do not count against tokens/s

if master:
    # Section 6.1: the reported models average the last checkpoints, written at regular intervals.
    newest = sorted(glob.glob(os.path.join(out_dir, 'ckpt_[0-9]*.pt')))[-average_last:]
    raw_model.load_state_dict(translate.average_checkpoints(newest))
    save(os.path.join(out_dir, 'ckpt.pt'), full=False)
    log(f"averaged {len(newest)} checkpoint(s) into {os.path.join(out_dir, 'ckpt.pt')}")
    evaluate(final=True)
    bleu_note = f', best valid BLEU {best_bleu:.2f}' if best_bleu >= 0 else ''  # -1: BLEU never computed
    log(f"done: step {step}, {(time.time() - t_start) / 60:.1f} min{bleu_note}")
if ddp:
    dist.destroy_process_group()
