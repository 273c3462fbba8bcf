"""
Trains the Transformer. One process:
$ python train.py config/multi30k.py
Data-parallel on one node (8 GPUs), or on CPU with gloo:
$ torchrun --nproc_per_node=8 train.py config/wmt_base.py
Settings below are defaults; a config file overrides them, then --key=value overrides both:
$ python train.py config/multi30k.py --max_steps=2000 --dtype=float32
"""
import ast
import builtins
import contextlib
import datetime
import json
import math
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sacrebleu.metrics import BLEU

import data_prep
import model as M

_t_process = time.time()  # '_': not a setting

# -----------------------------------------------------------------------------------------------
# I/O
data_dir = 'data/multi30k_en_de'
out_dir = 'out/multi30k_en_de'
init_from = 'scratch'        # 'scratch', 'resume' (newest state_*.pt in out_dir), or a checkpoint's path to
                             # fine-tune: its weights and architecture, a fresh optimizer and schedule, step 0
overwrite = False            # a new run into an out_dir that holds one: True deletes its checkpoints and log
log_interval = 100           # steps
eval_interval = 1000         # validation loss every N steps (0 = only at the end)
bleu_interval = 0            # validation BLEU every N steps (0: at the end, -1: never); best in ckpt_best.pt
bleu_beam = 4
bleu_lenpen = 0.6            # length penalty alpha of validation BLEU, and translate.py's default for the
                             # model (section 6.1: 0.6, chosen on the development set)
save_interval = 1000         # checkpoint every N steps ...
save_minutes = 0.0           # ... and/or every N minutes (the paper: every 10 minutes)
keep_last = 5                # weights-only ckpt_STEP.pt snapshots kept, for averaging
keep_state = 1               # full training states state_STEP.pt kept (weights + Adam moments), for resuming
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
max_minutes = 0.0            # also stop after this much training time, resumed runs' included (0 = no limit)
schedule = 'noam'            # 'noam': the paper's formula; 'inverse_sqrt': fairseq's linear warmup to lr
lr = 5e-4                    # peak learning rate of 'inverse_sqrt'
lr_scale = 1.0               # multiplier on the 'noam' formula
warmup = 4000
cooldown = 0.0               # LR falls linearly to 0 over this last share of the run (steps or minutes)
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-9
weight_decay = 0.0
label_smoothing = 0.1
clip_grad = 0.0              # max gradient norm (0 = off; the paper does not clip)
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto' (bfloat16 where native: data_prep.fast_dtype), 'bfloat16', 'float32',
                             # or 'float16' (GPU, with a gradient scaler)
compile = False
seed = 1337
max_bad_steps = 20           # consecutive non-finite updates before giving up
ddp_timeout_minutes = 60.0   # how long a rank waits in a collective (NCCL's default, 10, is short for a save)
config_keys = [k for k, v in globals().items() if k[0] != '_' and isinstance(v, (int, float, bool, str))]


def override(config, args):
    """nanoGPT's configurator, strict: config files first, each executed over the settings so far (it may
    read them, d_ff = 4 * d_model, and import), then each --key=value parsed as a Python literal. Unknown
    keys and wrong types name the key."""
    def check(key, value, where):
        if key not in config:
            sys.exit(f"{where}: unknown setting {key!r}")
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(config[key], float):
            value = float(value)
        if type(value) is not type(config[key]):
            sys.exit(f"{where}: {key} must be {type(config[key]).__name__}, got {value!r}")
        config[key] = value
    for arg in sorted(args, key=lambda a: a.startswith('--')):  # the files first, each group in its order
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                sys.exit(f"config file {arg} not found")
            scope = dict(config)
            try:
                with open(arg, encoding='utf-8') as f:
                    exec(builtins.compile(f.read(), arg, 'exec'), scope)  # builtins: `compile` is a setting
            except Exception as e:  # the file's own mistake: its line, not a traceback through train.py
                lines = [e.lineno] if isinstance(e, SyntaxError) else \
                    [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
                sys.exit(f"config file {arg}, line {(lines or ['?'])[-1]}: {type(e).__name__}: {e}")
            for key, value in scope.items():  # any name but its imports and functions must be a setting
                if not key.startswith('_') and not callable(value) and not isinstance(value, type(sys)):
                    check(key, value, arg)
        else:
            key, eq, raw = arg[2:].partition('=')
            if not eq:
                sys.exit(f"{arg}: expected --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare word is a string
            if isinstance(config.get(key), str) and not isinstance(value, str):
                value = raw  # --out_dir=2024 names the folder '2024'
            check(key, value, arg)
    return config


config = override({k: globals()[k] for k in config_keys}, sys.argv[1:])
globals().update(config)
for keys, ok, what in [  # each setting's range, checked before any work
        ('max_tokens update_freq max_steps warmup log_interval keep_last keep_state average_last bleu_beam '
         'n_enc_layers n_dec_layers d_model d_ff n_heads max_len max_bad_steps', lambda v: v >= 1,
         'at least 1'),
        ('dropout attn_dropout label_smoothing beta1 beta2', lambda v: 0 <= v < 1, 'in [0, 1)'),
        ('lr lr_scale adam_eps weight_decay clip_grad max_minutes save_minutes eval_interval save_interval '
         'bleu_lenpen seed', lambda v: v >= 0, 'at least 0'),
        ('bleu_interval', lambda v: v >= -1, 'at least -1 (-1: never)'),
        ('cooldown', lambda v: 0 <= v <= 1, 'in [0, 1]'),
        ('schedule', lambda v: v in ('noam', 'inverse_sqrt'), "'noam' or 'inverse_sqrt'"),
        ('dtype', lambda v: v in ('auto', 'float32', 'bfloat16', 'float16'),
         "'auto', 'float32', 'bfloat16' or 'float16'"),
        ('device', lambda v: re.fullmatch(r'auto|cpu|cuda(:\d+)?', v), "'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ('n_heads', lambda v: d_model % v == 0, 'a divisor of d_model')]:
    for key in keys.split():
        if not ok(config[key]):
            sys.exit(f"{key} must be {what}, got {config[key]!r}")

# -----------------------------------------------------------------------------------------------
# processes, device and precision
ddp = 'RANK' in os.environ
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
if device_type == 'cuda' and not torch.cuda.is_available():
    sys.exit(f"device={device!r} but torch sees no GPU (device='auto' picks one when there is)")
if dtype == 'float16' and device_type == 'cpu':
    sys.exit("dtype='float16' needs a GPU; use 'bfloat16' or 'float32' on CPU")
if ddp:
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    if device_type == 'cuda':
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo',
                            timeout=datetime.timedelta(minutes=ddp_timeout_minutes))
else:
    rank, world = 0, 1
master = rank == 0
log = print if master else (lambda *a, **k: None)  # rank 0 speaks for all
if dtype == 'auto':
    dtype = data_prep.fast_dtype(device_type)
elif dtype == 'bfloat16' and data_prep.fast_dtype(device_type) != 'bfloat16':
    log(f"warning: this {device_type} has no native bfloat16 matrix multiply: dtype='bfloat16' is far "
        f"slower than 'float32' here (dtype='auto' picks the faster one)")
torch.manual_seed(seed + rank)
if device_type == 'cpu':
    data_prep.keep_freed_memory()
    if dtype == 'bfloat16':  # at sentence lengths the CPU flash kernel is slower (docs/performance.md)
        torch.backends.cuda.enable_flash_sdp(False)
else:  # cuDNN attention plans anew for each shape: bf16 ran 5-10x slower on an H100 (docs/performance.md)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = (contextlib.nullcontext() if dtype == 'float32'
            else torch.autocast(device_type=device_type, dtype=ptdtype))

# -----------------------------------------------------------------------------------------------
# out_dir: a new run's or the one being resumed, held by this run alone
data_prep.make_writable(out_dir, 'out_dir')
if master:
    try:  # held until this process ends: a second run would mix its checkpoints into this one's
        data_prep.lock_folder(out_dir)
    except BlockingIOError:
        sys.exit(f"out_dir {out_dir} is in use by another train.py run: let it end, or use another --out_dir")
run_files = [f for f in sorted(os.listdir(out_dir)) if re.fullmatch(r'log\.jsonl|(ckpt|state)\w*\.pt', f)]
if init_from != 'resume' and run_files and not overwrite:
    sys.exit(f"out_dir {out_dir} already holds a run ({', '.join(run_files[:3])}, ...): continue it with "
             f"--init_from=resume, use another --out_dir, or start over with --overwrite=True (deletes it)")

# -----------------------------------------------------------------------------------------------
# data: the token files data_prep.py writes
if not os.path.exists(os.path.join(data_dir, 'meta.json')):
    named = re.fullmatch(r'(multi30k|wmt14)_([a-z]+)_([a-z]+)', os.path.basename(os.path.normpath(data_dir)))
    how = f"{named[1]} --src {named[2]} --tgt {named[3]}" if named else "custom --train PREFIX ..."
    sys.exit(f"no prepared data in {data_dir}: run `python data_prep.py {how} --out {data_dir}`")
try:
    meta = data_prep.load_meta(data_dir)
    PAD, BOS, EOS = meta['pad_id'], meta['bos_id'], meta['eos_id']
    tokenizer = data_prep.tokenizer_dict(data_dir)
    enc = data_prep.load_tokenizer(tokenizer)
    valid_ref = open(os.path.join(data_dir, f"valid.{meta['tgt']}.txt"), encoding='utf-8').read().splitlines()
except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: {data_dir} is incomplete or damaged ({type(e).__name__}: {e}): prepare it again")
train_data, valid_data = data_prep.load_split(data_dir, 'train'), data_prep.load_split(data_dir, 'valid')
train_tgt_len = np.diff(train_data[3]) + 1  # + EOS: the target tokens the loss counts
for split, data in (('training', train_data), ('validation', valid_data)):
    sizes = data_prep.pair_sizes(data)  # a pair's padded tokens: its longer side + EOS
    if len(sizes) and sizes.min() > max_tokens:
        sys.exit(f"max_tokens={max_tokens} is smaller than every {split} pair in {data_dir}: raise it to at "
                 f"least {sizes.min()}")
    if (sizes > max_tokens).any():
        log(f"warning: {(sizes > max_tokens).sum()} {split} pairs need more than max_tokens={max_tokens} "
            f"padded tokens and are left out; max_tokens={sizes.max()} would keep them all")


def get_batch(data, ids):
    # From pinned host memory the copy is asynchronous; from pageable memory the CUDA driver may first
    # wait for the stream, a host sync per step.
    pin = device_type == 'cuda'
    return [(torch.from_numpy(x).pin_memory() if pin else torch.from_numpy(x)).to(device, non_blocking=True)
            for x in data_prep.collate(data, ids, PAD, BOS, EOS)]


# -----------------------------------------------------------------------------------------------
# model, optimiser, and the state to resume or fine-tune from
state, fine_tuned_from = None, None
if init_from == 'resume':
    init_path = (data_prep.checkpoints(out_dir, 'state') or [None])[-1]
    if init_path is None:
        sys.exit(f"init_from='resume' but {out_dir} has no state_*.pt")
    state = data_prep.read_checkpoint(init_path, ('model', 'model_cfg', 'tokenizer', 'optimizer'))
    fine_tuned_from = state['fine_tuned_from']
elif init_from != 'scratch':
    init_path, state, fine_tuned_from = init_from, data_prep.read_checkpoint(init_from), init_from
if state is None:  # the vocabulary rounded up to a multiple of 8, so the output matmul fits tensor cores
    model_cfg = M.Config(**{f.name: config[f.name] for f in fields(M.Config) if f.name in config},
                         vocab_size=(meta['vocab_size'] + 7) // 8 * 8, pad_id=PAD, bos_id=BOS, eos_id=EOS)
else:
    if not data_prep.same_tokenizer(data_prep.checkpoint_tokenizer(init_path, state), tokenizer):
        # Same size is not enough: two BPEs of 8000 merges map the same ids to different words.
        sys.exit(f"{init_path} was trained with another tokenizer than {data_dir}: its token ids would mean "
                 f"other words; train on data prepared with its tokenizer (data_prep.py --tokenizer)")
    log(f"{'resuming' if init_from == 'resume' else 'fine-tuning'} from {init_path} (step {state['step']})")
    model_cfg = M.Config(**state['model_cfg'])  # the checkpoint's architecture, whatever the settings say
if init_from == 'resume':  # the run goes on as it began: architecture, optimizer, batch plan and data
    fixed = ['beta1', 'beta2', 'adam_eps', 'weight_decay', 'seed', 'max_tokens'] + [
        f.name for f in fields(M.Config) if f.name in config and (not fine_tuned_from or 'drop' in f.name)]
    changed = [f"{k}={config[k]!r} (the run's: {state['config'][k]!r})" for k in fixed
               if config[k] != state['config'][k]]
    if state['train_split'] != meta['splits']['train']:
        changed.append(f"data_dir={data_dir!r} (other training pairs than the run's {state['data_dir']!r})")
    if changed:
        sys.exit(f"init_from='resume' continues {out_dir} as it was trained, but these settings differ: "
                 f"{', '.join(changed)}; drop them, or start a new run from its weights with "
                 f"--init_from={os.path.join(out_dir, 'ckpt.pt')}")
elif state is not None:  # fine-tuning: dropout is a training setting, the rest is the checkpoint's
    model_cfg.dropout, model_cfg.attn_dropout = dropout, attn_dropout
arch = {k: v for k, v in asdict(model_cfg).items() if fine_tuned_from and k in config and config[k] != v}
if arch:  # said, and the settings made to agree, so the config saved with each checkpoint is the model's
    log(f"fine-tuning keeps the checkpoint's architecture: {arch}")
    config.update(arch)
    globals().update(arch)
for split, data in (('training', train_data), ('validation', valid_data)):
    sizes = data_prep.pair_sizes(data)  # positions past max_len have no encoding: found now, not mid-run
    if sizes[sizes <= max_tokens].max(initial=0) > model_cfg.max_len:
        sys.exit(f"{data_dir} has {split} sentences over the model's max_len={model_cfg.max_len} tokens "
                 f"(with EOS): raise max_len, or leave them out (data_prep.py --max-len)")
raw_model = M.Transformer(model_cfg).to(device)


def cpu_dropout(self, x):  # torch's CPU dropout draws its mask with bernoulli_: twice the cost (docs/performance.md)
    if not self.training or self.p == 0:
        return x
    keep = torch.rand_like(x, dtype=torch.float32) >= self.p  # float32: bf16 would round p
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))


for m in raw_model.modules() if device_type == 'cpu' else []:
    if isinstance(m, torch.nn.Dropout):
        m.forward = cpu_dropout.__get__(m)
# Fused Adam (CPU and GPU) reads a found_inf flag and skips the update on the device: no host sync.
optimizer = torch.optim.Adam(raw_model.parameters(), lr=0.0, betas=(beta1, beta2), eps=adam_eps,
                             weight_decay=weight_decay, fused=True)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
step, epoch, batch_idx, best_bleu, elapsed = 0, 0, 0, -1.0, 0.0
if state is not None:
    try:
        raw_model.load_state_dict(state['model'])
    except RuntimeError as e:
        sys.exit(f"{init_path}: its weights do not fit its model_cfg ({' '.join(str(e).split())[:200]})")
if init_from == 'resume':
    optimizer.load_state_dict(state['optimizer'])
    if state['scaler'] and dtype == 'float16':  # empty where the run did not train in float16
        scaler.load_state_dict(state['scaler'])
    step, epoch, batch_idx, elapsed = state['step'], state['epoch'], state['next_batch'], state['elapsed']
    best_bleu = state['best_bleu']
    with contextlib.suppress(Exception):  # the final evaluation's ckpt_best.pt postdates the state
        best = torch.load(os.path.join(out_dir, 'ckpt_best.pt'), weights_only=True, mmap=True)['valid_bleu']
        best_bleu = max(best_bleu, float(best))
    if len(state['rng']) == world:  # every rank's own generator: dropout masks go on as if never stopped
        torch.set_rng_state(state['rng'][rank]['cpu'])
        if device_type == 'cuda' and state['rng'][rank]['cuda'] is not None:
            torch.cuda.set_rng_state(state['rng'][rank]['cuda'])
    else:
        log(f"warning: saved with {len(state['rng'])} process(es), resumed with {world}: dropout reseeded")
        torch.manual_seed(seed + rank + 1000003 * step)
    for f in os.listdir(out_dir) if master else []:  # a save killed midway leaves its temporary file
        if re.fullmatch(r'(ckpt|state)_\d+\.pt\.\w+\.tmp', f):
            os.remove(os.path.join(out_dir, f))
del state


def epoch_plan(epoch):  # the same on every rank: the seed and the epoch decide it
    plan = data_prep.batch_plan(train_data, max_tokens, seed, epoch)
    if world * update_freq > len(plan):
        sys.exit(f"the training set makes {len(plan)} batches of max_tokens={max_tokens}, fewer than the "
                 f"{world * update_freq} an update needs ({world} process(es) x update_freq {update_freq})")
    return plan


plan = epoch_plan(epoch)
if init_from != 'resume' and run_files:  # --overwrite: only now that every input has loaded
    if ddp:
        dist.barrier()  # every rank has listed the old run
    for f in run_files if master else []:
        os.remove(os.path.join(out_dir, f))
model = torch.compile(raw_model) if compile else raw_model
# Compiled, the loss reads the (tokens x vocab) logits once forward and once backward instead of in
# several float32 passes: at 25k tokens and 37k words that is tens of GB per step (docs/performance.md).
loss_fn = torch.compile(M.label_smoothed_loss, dynamic=True) if compile else M.label_smoothed_loss
if ddp:  # the positional table is a constant: no broadcast of buffers before each forward
    model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == 'cuda' else None,
                broadcast_buffers=False, gradient_as_bucket_view=True)


def get_lr(step, elapsed=0.0):
    if schedule == 'noam':  # section 5.3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        rate = lr_scale * model_cfg.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    else:  # 'inverse_sqrt', fairseq's: linear warmup to lr, then lr * sqrt(warmup / step)
        rate = lr * min(step / warmup, (warmup / step) ** 0.5)
    if cooldown > 0:  # linear decay to 0 over the last `cooldown` of the run, by the budget ending it first
        done = max(step / max_steps, elapsed / (max_minutes * 60) if max_minutes > 0 else 0.0)
        rate *= min(1.0, max(0.0, (1.0 - done) / cooldown))
    return rate


def gather(obj):  # every rank's obj, in rank order
    out = [obj] * world
    if ddp:
        dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def validation_bleu():
    """Beam search (translate.py's default rule) over every world-th validation source, batched as
    translate.py batches: longest first, up to 4096 padded source tokens; empty or too long sources give ''."""
    lengths = np.diff(valid_data[1])
    mine = [i for i in range(rank, len(valid_ref), world) if 0 < lengths[i] < model_cfg.max_len]
    sizes, hyps = lengths[mine] + 1, {}
    for batch in data_prep.token_batches(sizes, np.argsort(-sizes, kind='stable'), 4096):
        ids = [mine[j] for j in batch]
        src = torch.from_numpy(data_prep.collate(valid_data, ids, PAD, BOS, EOS)[0]).to(device)
        with autocast:
            out = M.beam_search(raw_model, src, bleu_beam, bleu_lenpen)
        hyps.update((i, enc.decode([t for t in h[0][0] if t < enc.n_vocab])) for i, h in zip(ids, out))
    hyps = {i: h for share in gather(hyps) for i, h in share.items()}
    return BLEU().corpus_score([hyps.get(i, '') for i in range(len(valid_ref))], [valid_ref]).score


@torch.no_grad()
def evaluate(final=False):  # every rank takes part: each validates its share
    global best_bleu
    raw_model.eval()
    sums = torch.zeros(3, device=device)  # smoothed loss, NLL, tokens over this rank's share of batches
    for ids in data_prep.batch_plan(valid_data, max_tokens, seed, 0, shuffle=False)[rank::world]:
        src, tgt_in, tgt_out = get_batch(valid_data, ids)
        with autocast:
            sums += torch.stack([x.float() for x in M.label_smoothed_loss(raw_model(src, tgt_in), tgt_out,
                                                                            label_smoothing, PAD)])
    if ddp:
        dist.all_reduce(sums)
    total, nll, ntok = sums.tolist()
    record = {'step': step, 'valid_loss': total / ntok, 'valid_ppl': math.exp(nll / ntok)}
    if bleu_interval >= 0 and (final or (bleu_interval and step % bleu_interval == 0)):
        record['valid_bleu'] = validation_bleu()
        if record['valid_bleu'] > best_bleu:
            best_bleu = record['valid_bleu']
            save(os.path.join(out_dir, 'ckpt_best.pt'), valid_bleu=best_bleu)
    raw_model.train()
    log(' | '.join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    log_record(record)


def save(path, full=False, **extra):
    """Weights only (what averaging and translate.py read), or with full=True the whole training state,
    every rank's random generators included; with full=True every rank must call it (it gathers)."""
    ckpt = {'model': raw_model.state_dict(), 'model_cfg': asdict(model_cfg), 'tokenizer': tokenizer,
            'step': step, 'config': config, 'data_dir': data_dir, 'fine_tuned_from': fine_tuned_from, **extra}
    if full:
        rng = gather({'cpu': torch.get_rng_state(),
                      'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), epoch=epoch, rng=rng,
                    next_batch=batch_idx, best_bleu=best_bleu, elapsed=clock, train_split=meta['splits']['train'])
    if master:
        data_prep.save_atomic(ckpt, path)


def checkpoint():  # a training state to resume from and a weights snapshot to average, the oldest removed
    save(os.path.join(out_dir, f'state_{step:07d}.pt'), full=True)
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))
    for prefix, keep in (('state', keep_state), ('ckpt', keep_last)) if master else []:
        for old in data_prep.checkpoints(out_dir, prefix)[:-keep]:
            os.remove(old)
    if ddp:
        dist.barrier()  # the other ranks read these files at the end (averaging)


logfile = None


def log_record(record):  # log.jsonl opens with the first record: a run stopped before it leaves none behind
    global logfile
    if master:
        logfile = logfile or open(os.path.join(out_dir, 'log.jsonl'), 'a')
        logfile.write(json.dumps(record) + '\n')
        logfile.flush()


if init_from == 'resume' and master and not os.path.exists(os.path.join(out_dir, f'ckpt_{step:07d}.pt')):
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))  # killed between a state and its snapshot

# -----------------------------------------------------------------------------------------------
# training loop
log(json.dumps(config, indent=1))
log(f"model: {raw_model.num_params() / 1e6:.2f}M parameters; {world} process(es) x update_freq "
    f"{update_freq} x max_tokens {max_tokens}; device {device}, {dtype}")
log(f"{len(plan):,} batches this epoch; ready to train {time.time() - _t_process:.1f}s after start")
per_update = world * update_freq
t_last = time.time()
t_start = t_last - elapsed
# clock: the training time all ranks agree on, which times the saves, stops the run and drives the cooldown.
# Under DDP it is agreed at log steps only, where the host waits for the GPU anyway.
tokens_since, clock = 0, elapsed
last_save = clock
# Kept on the device and read only at log steps: a .item() per step would stall the GPU queue.
loss_acc, nll_acc, bad_run, worst_run, skipped = (torch.zeros((), device=device) for _ in range(5))
raw_model.train()
if max_minutes > 0 and elapsed > max_minutes * 60:  # resumed after its time ran out: not one more step
    max_steps = step
while step < max_steps:
    if batch_idx + per_update > len(plan):  # the epoch's last few batches do not fill an update
        epoch, batch_idx = epoch + 1, 0
        plan = epoch_plan(epoch)
    update = plan[batch_idx:batch_idx + per_update]
    # Every rank holds the same plan, so each knows the update's global target-token count without a
    # collective; normalising by it makes N ranks and update_freq N give the same update.
    ntok_update = sum(int(train_tgt_len[ids].sum()) for ids in update)
    step, batch_idx = step + 1, batch_idx + per_update
    lr_now = get_lr(step, clock)
    for group in optimizer.param_groups:
        group['lr'] = lr_now
    try:
        for micro in range(update_freq):
            src, tgt_in, tgt_out = get_batch(train_data, update[micro * world + rank])
            if ddp:  # all-reduce gradients only on the last micro-step
                model.require_backward_grad_sync = micro == update_freq - 1
            with autocast:
                loss, nll, _ = loss_fn(model(src, tgt_in), tgt_out, label_smoothing, PAD)
            # DDP averages gradients over ranks; scaling by world turns that average into the sum.
            scaler.scale(loss * world / ntok_update).backward()
            loss_acc += loss.detach()
            nll_acc += nll
    except torch.cuda.OutOfMemoryError:
        sys.exit(f"CUDA out of memory at max_tokens={max_tokens}: lower max_tokens and raise update_freq "
                 f"to keep the same tokens per update")
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip_grad or math.inf)
    # A non-finite norm (the gradients are all-reduced, so every rank agrees) skips the update, as the
    # fp16 grad scaler does: with float16 the scaler sets found_inf itself and also lowers its scale.
    bad = ~torch.isfinite(grad_norm)
    optimizer.found_inf = bad.float()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    bad_run = (bad_run + 1) * bad
    worst_run, skipped = torch.maximum(worst_run, bad_run), skipped + bad
    tokens_since += ntok_update
    elapsed = time.time() - t_start
    log_step = step % log_interval == 0 or step == max_steps
    if ddp and log_step:  # the line rank 0 prints is over every rank's tokens, the clock the slowest rank's
        sums, slowest = torch.stack([loss_acc, nll_acc]), torch.tensor(elapsed, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        (loss_acc, nll_acc), clock = sums, slowest.item()
    elif not ddp:
        clock = elapsed
    if max_minutes > 0 and clock > max_minutes * 60:  # under DDP, decided at a log step
        log(f"max_minutes={max_minutes} reached at step {step}")
        max_steps, log_step = step, True
    if log_step:
        if worst_run.item() >= max_bad_steps:  # every rank reads it: all stop together
            sys.exit(f"{int(worst_run.item())} non-finite updates in a row: lower the learning rate, use "
                     f"dtype='bfloat16' or 'float32', or set clip_grad")
        if skipped.item():
            log(f"warning: {int(skipped.item())} update(s) with a non-finite gradient norm skipped")
        if master:
            dt, t_last = time.time() - t_last, time.time()
            loss_tok, ppl = loss_acc.item() / tokens_since, math.exp(min(nll_acc.item() / tokens_since, 50))
            eta = (max_steps - step) * elapsed / step
            eta = max(min(eta, max_minutes * 60 - elapsed) if max_minutes > 0 else eta, 0)
            log_record(dict(step=step, epoch=epoch, loss=loss_tok, ppl=ppl, lr=lr_now, grad_norm=grad_norm.item(),
                            tok_per_s=tokens_since / dt, elapsed_min=elapsed / 60, eta_min=eta / 60))
            log(f"step {step} | epoch {epoch} | loss {loss_tok:.3f} | ppl {ppl:.2f} | lr {lr_now:.2e} | "
                f"gnorm {grad_norm.item():.2f} | {tokens_since / dt:,.0f} tgt tok/s | "
                f"{elapsed / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
        tokens_since = 0
        for t in (loss_acc, nll_acc, worst_run, skipped):
            t.zero_()
    if ((eval_interval and step % eval_interval == 0) or (bleu_interval > 0 and step % bleu_interval == 0)) \
            and step != max_steps:
        evaluate()
    if (save_interval and step % save_interval == 0) or step == max_steps \
            or (save_minutes > 0 and clock - last_save > save_minutes * 60):
        checkpoint()
        last_save = clock
    if step % log_interval == 0:
        t_last = time.time()  # evaluation and saving do not count against tokens/s

# Section 6.1: the reported models average the last checkpoints, written at regular intervals.
newest = data_prep.checkpoints(out_dir)[-average_last:]
raw_model.load_state_dict(data_prep.average_checkpoints(newest))
save(os.path.join(out_dir, 'ckpt.pt'))
log(f"averaged {len(newest)} checkpoint(s) into {os.path.join(out_dir, 'ckpt.pt')}")
evaluate(final=True)
log(f"done: step {step}, {(time.time() - t_start) / 60:.1f} min"
    + (f', best valid BLEU {best_bleu:.2f}' if best_bleu >= 0 else ''))
if ddp:
    dist.barrier()  # no rank tears down its process group while another still uses it
    dist.destroy_process_group()
    # A Gloo worker thread may still release the last collective's tensors, which needs the interpreter: if
    # Python is shutting down by then, a finished run aborts (SIGABRT). Leave without that shutdown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
