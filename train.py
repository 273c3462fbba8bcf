"""Trains the Transformer. One process:
$ python train.py config/multi30k.py
Data-parallel on one node (8 GPUs), or on CPU with gloo:
$ torchrun --nproc_per_node=8 train.py config/wmt_base.py
Settings below are defaults; a config file overrides them, then --key=value overrides both:
$ python train.py config/multi30k.py --max_steps=2000 --dtype=float32
"""
import contextlib
import copy
import datetime
import glob
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
from sacrebleu.metrics import BLEU
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import dataset
import model as M
import speed
from configurator import override

_t_process = time.time()  # '_': not a setting

# -----------------------------------------------------------------------------------------------
# I/O
data_dir = 'data/multi30k_en_de'
out_dir = 'out/multi30k_en_de'
init_from = 'scratch'        # 'scratch', 'resume' (out_dir's newest state), or a checkpoint to fine-tune
overwrite = False            # a new run into an out_dir that holds one: True deletes its checkpoints and log
log_interval = 100           # steps
eval_interval = 1000         # validation loss every N steps (0 = only at the end)
bleu_interval = 0            # validation BLEU every N steps (0: at the end, -1: never); best in ckpt_best.pt
bleu_beam, bleu_lenpen = 4, 0.6  # validation BLEU's; the lenpen is also translate.py's default (section 6.1)
save_interval = 1000         # checkpoint every N steps ...
save_minutes = 0.0           # ... and/or every N minutes (the paper: every 10 minutes)
keep_last = 5                # weights-only ckpt_STEP.pt snapshots kept, for averaging
keep_state = 1               # full training states state_STEP.pt kept (weights + Adam moments), for resuming
average_last = 5             # ckpt.pt = average of the newest N (section 6.1: 5 for base, 20 for big)
# model (Table 3, base)
n_enc_layers = n_dec_layers = 6  # N
d_model = 512
d_ff = 2048
n_heads, d_head = 8, 0       # h, and d_k = d_v (0: d_model / h; Table 3 rows A, B: other widths)
dropout = 0.1
attn_dropout = 0.0
pre_norm = False
max_len, positions = 1024, 'sinusoidal'  # the table's length; 'learned': Table 3 row (E)
# optimisation (section 5.3, 5.4)
max_tokens = 4096            # padded source or target tokens per GPU per micro-step
update_freq = 1              # micro-steps accumulated per update: N GPUs ~ 1 GPU with update_freq N
max_steps = 100000
max_minutes = 0.0            # also stop after this much training time, resumed runs' included (0 = no limit)
schedule = 'noam'            # 'noam': the paper's formula; 'inverse_sqrt': fairseq's; 'constant': flat
lr = 5e-4                    # peak learning rate of 'inverse_sqrt' and 'constant' (warmup to lr, then flat)
lr_scale = 1.0               # multiplier on the 'noam' formula
warmup = 4000
cooldown = 0.0               # LR falls linearly to 0 over this last share of the run (steps or minutes)
beta1, beta2, adam_eps = 0.9, 0.98, 1e-9
weight_decay = 0.0           # AdamW's, on matrices (the paper: none)
label_smoothing = 0.1
clip_grad = 0.0              # max gradient norm (0 = off; the paper does not clip)
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto' (bf16 where native), 'bfloat16', 'float32', 'float16' (GPU, scaled)
compile = False
cuda_graphs = False          # GPU: rows packed to a fixed size, forward and backward as CUDA graphs
master_weights = False       # the steps on a copy in dtype, Adam on the float32 model (fairseq's --bf16)
checkpoint_activations = False  # backward recomputes each layer from its input: less memory, more compute
seed = 1337
max_bad_steps = 20           # consecutive non-finite updates before giving up
ddp_timeout_minutes = 60.0   # how long a rank waits in a collective (NCCL's default, 10, is short for a save)
config_keys = [k for k, v in globals().items() if k[0] != '_' and isinstance(v, (int, float, bool, str))]

config = override({k: globals()[k] for k in config_keys}, sys.argv[1:])
globals().update(config)
for keys, ok, what in [  # each setting's range, checked before any work
        ('max_tokens update_freq max_steps warmup log_interval keep_last keep_state average_last bleu_beam '
         'n_enc_layers n_dec_layers d_model d_ff n_heads max_len max_bad_steps', lambda v: v >= 1, '>= 1'),
        ('dropout attn_dropout label_smoothing beta1 beta2', lambda v: 0 <= v < 1, 'in [0, 1)'),
        ('lr lr_scale adam_eps weight_decay clip_grad max_minutes save_minutes eval_interval save_interval '
         'bleu_lenpen seed d_head', lambda v: v >= 0, '>= 0'),
        ('bleu_interval', lambda v: v >= -1, '>= -1 (-1: never)'),
        ('cooldown', lambda v: 0 <= v <= 1, 'in [0, 1]'),
        ('schedule', lambda v: v in ('noam', 'inverse_sqrt', 'constant'), 'noam, inverse_sqrt or constant'),
        ('positions', lambda v: v in ('sinusoidal', 'learned'), "'sinusoidal' or 'learned'"),
        ('dtype', lambda v: v in ('auto', 'float32', 'bfloat16', 'float16'), 'auto/float32/bfloat16/float16'),
        ('master_weights', lambda v: not v or config['dtype'] != 'float32', 'False with dtype float32'),
        ('device', lambda v: re.fullmatch(r'auto|cpu|cuda(:\d+)?', v), 'auto, cpu, cuda or cuda:N'),
        ('n_heads', lambda v: d_head or d_model % v == 0, 'a divisor of d_model, or d_head set')]:
    for key in [k for k in keys.split() if not ok(config[k])]:
        sys.exit(f"{key} must be {what}, got {config[key]!r}")

# -----------------------------------------------------------------------------------------------
# processes, device and precision
ddp = 'RANK' in os.environ
rank, world = (int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) if ddp else (0, 1)
master, log = rank == 0, print if rank == 0 else (lambda *a, **k: None)  # rank 0 speaks for all
device = ('cuda' if torch.cuda.is_available() else 'cpu') if device == 'auto' else device
device_type = device[:4]
if device_type == 'cuda' and not torch.cuda.is_available():
    sys.exit(f"device={device!r} but torch sees no GPU (device='auto' picks one when there is)")
if dtype == 'float16' and device_type == 'cpu':
    sys.exit("dtype='float16' needs a GPU; use 'bfloat16' or 'float32' on a CPU")
if cuda_graphs and (device_type != 'cuda' or dtype == 'float32' or update_freq > 1 or checkpoint_activations):
    sys.exit("cuda_graphs needs a GPU, dtype bfloat16 or float16, update_freq=1, no checkpoint_activations")
if ddp and device_type == 'cuda':
    torch.cuda.set_device(device := f"cuda:{os.environ['LOCAL_RANK']}")
if ddp:  # device_id: NCCL connects each rank to its own GPU at once
    dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo', timeout=datetime.timedelta(
        minutes=ddp_timeout_minutes), device_id=torch.device(device) if device_type == 'cuda' else None)
if dtype == 'bfloat16' != speed.fast_dtype(device_type):
    log(f"warning: this {device_type} has no native bfloat16 matrix multiply: far slower than float32")
dtype = speed.fast_dtype(device_type) if dtype == 'auto' else dtype
torch.manual_seed(seed + rank)
speed.keep_freed_memory(not checkpoint_activations) if device_type == 'cpu' else None  # faster CPU steps
torch.backends.cuda.enable_flash_sdp(device_type != 'cpu' or dtype != 'bfloat16')  # CPU bf16: flash slower
if device_type == 'cuda':  # cuDNN attention plans anew for each shape: bf16 ran 5-10x slower on an H100
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
autocast = torch.autocast(device_type, getattr(torch, dtype), enabled=dtype != 'float32',
                          cache_enabled=not cuda_graphs)  # a graph casts the weights in its replays
# out_dir: a new run's or the one being resumed, held by this run alone
checkpoint.make_writable(out_dir, 'out_dir')
try:  # held until this process ends: a second run would mix its checkpoints into this one's
    lock = checkpoint.lock_folder(out_dir) if master else None
except BlockingIOError:
    sys.exit(f"out_dir {out_dir} is in use by another train.py run: let it end, or use another --out_dir")
run_files = [f for f in sorted(os.listdir(out_dir)) if re.fullmatch(r'log\.jsonl|(ckpt|state)\w*\.pt', f)]
if init_from != 'resume' and run_files and not overwrite:
    sys.exit(f"out_dir {out_dir} already holds a run ({', '.join(run_files[:3])}, ...): continue it with "
             f"--init_from=resume, use another --out_dir, or start over with --overwrite=True (deletes it)")

# -----------------------------------------------------------------------------------------------
# data: the token files data_prep.py writes
if not os.path.exists(os.path.join(data_dir, 'meta.json')):
    sys.exit(f"no prepared data in {data_dir}: prepare it, `python data_prep.py CORPUS ... --out {data_dir}`")
try:
    meta, tokenizer = dataset.load_meta(data_dir), dataset.tokenizer_dict(data_dir)
    PAD, BOS, EOS, enc = meta['pad_id'], meta['bos_id'], meta['eos_id'], dataset.load_tokenizer(tokenizer)
    valid_ref = open(os.path.join(data_dir, f"valid.{meta['tgt']}.txt"), encoding='utf-8').read().splitlines()
except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: {data_dir} is incomplete or damaged ({type(e).__name__}: {e}): prepare it again")
train_data, valid_data = dataset.load_split(data_dir, 'train'), dataset.load_split(data_dir, 'valid')
train_tgt_len = np.diff(train_data[3]) + 1  # + EOS: the target tokens the loss counts

# model, optimiser, and the state to resume or fine-tune from
if init_from == 'resume' and not checkpoint.checkpoints(out_dir, 'state'):
    sys.exit(f"init_from='resume' but {out_dir} has no state_*.pt")
init_path = checkpoint.checkpoints(out_dir, 'state')[-1] if init_from == 'resume' else init_from
state = None if init_from == 'scratch' else checkpoint.read_checkpoint(init_path)  # its weights and config
fine_tuned_from = state['fine_tuned_from'] if init_from == 'resume' else state and init_path
if state is None:  # the vocabulary rounded up to a multiple of 8, so the output matmul fits tensor cores
    model_cfg = M.Config(**{f.name: config[f.name] for f in fields(M.Config) if f.name in config},
                         vocab_size=(meta['vocab_size'] + 7) // 8 * 8, pad_id=PAD, bos_id=BOS, eos_id=EOS)
else:
    if not dataset.same_tokenizer(checkpoint.checkpoint_tokenizer(init_path, state), tokenizer):
        # Same size is not enough: two BPEs of 8000 merges map the same ids to different words.
        sys.exit(f"{init_path} was trained with another tokenizer than {data_dir}: its token ids would mean "
                 f"other words; train on data prepared with its tokenizer (data_prep.py --tokenizer)")
    log(f"{'resuming' if init_from == 'resume' else 'fine-tuning'} from {init_path} (step {state['step']})")
    model_cfg = M.Config(**state['model_cfg'])  # the checkpoint's architecture, whatever the settings say
if init_from == 'resume':  # the run goes on as it began: architecture, optimizer, batch plan and data
    fixed = ['beta1', 'beta2', 'adam_eps', 'weight_decay', 'seed', 'max_tokens'] + [  # and the batch plan
        f.name for f in fields(M.Config) if f.name in config and (not fine_tuned_from or 'drop' in f.name)]
    changed = [f"{k}={config[k]!r} (the run's: {was!r})" for k in fixed  # newer than the state: its default
               if config[k] != (was := state['config'].get(k, getattr(M.Config, k, None)))]
    if state['train_split'] != meta['splits']['train']:
        changed.append(f"data_dir={data_dir!r} (other training pairs than the run's {state['data_dir']!r})")
    if changed:
        sys.exit(f"init_from='resume' continues {out_dir} as it began, but these settings differ: "
                 f"{', '.join(changed)}; drop them, or start anew with --init_from={out_dir}/ckpt.pt")
# Dropout is a training setting (a resume keeps the run's); ids past the tokenizer's are never generated.
model_cfg.dropout, model_cfg.attn_dropout, model_cfg.tokenizer_size = dropout, attn_dropout, enc.n_vocab
arch = {k: v for k, v in asdict(model_cfg).items() if fine_tuned_from and k in config and config[k] != v}
if arch:  # said, and the settings made to agree, so the config saved with each checkpoint is the model's
    log(f"fine-tuning keeps the checkpoint's architecture: {arch}")
    config.update(arch), globals().update(arch)
for split, data in (('training', train_data), ('validation', valid_data)):
    sizes = dataset.pair_sizes(data)  # a pair's padded tokens: its longer side + EOS
    if len(sizes) and sizes.min() > max_tokens:
        sys.exit(f"max_tokens={max_tokens} is below every {split} pair: raise it to at least {sizes.min()}")
    if (sizes > max_tokens).any():
        log(f"warning: {(sizes > max_tokens).sum()} {split} pairs need more than max_tokens={max_tokens} "
            f"padded tokens and are left out; max_tokens={sizes.max()} would keep them all")
    if sizes[sizes <= max_tokens].max(initial=0) > model_cfg.max_len:  # past it positions have no encoding
        sys.exit(f"{data_dir} has {split} sentences over the model's max_len={model_cfg.max_len} tokens "
                 f"(with EOS): raise max_len, or leave them out (data_prep.py --max-len)")
raw_model = M.Transformer(model_cfg).to(device)
speed.cpu_dropout(raw_model) if device_type == 'cpu' else None  # a faster mask on CPUs
optimizer = M.configure_optimizer(raw_model, 0.0, (beta1, beta2), adam_eps, weight_decay)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
step, epoch, batch_idx, best_bleu, elapsed = (0, 0, 0, -1.0, 0.0) if init_from != 'resume' else (
    state['step'], state['epoch'], state['next_batch'], state['best_bleu'], state['elapsed'])
raw_model.load_state_dict(state['model']) if state is not None else None  # resumed or fine-tuned
if init_from == 'resume':
    optimizer.load_state_dict(state['optimizer'])
    scaler.load_state_dict(state['scaler']) if state['scaler'] and dtype == 'float16' else None  # else empty
    with contextlib.suppress(Exception):  # the final evaluation's ckpt_best.pt postdates the state
        best_bleu = max(best_bleu, torch.load(os.path.join(out_dir, 'ckpt_best.pt'), mmap=True)['valid_bleu'])
    rng = state['rng'][rank] if len(state['rng']) == world else None  # dropout goes on as if never stopped
    torch.set_rng_state(rng['cpu']) if rng else torch.manual_seed(seed + rank + 1000003 * step)
    if not rng:  # the generators were saved per rank: another number of ranks cannot go on with them
        log(f"resumed by {world} process(es), saved by {len(state['rng'])}: dropout is reseeded")
    if rng and rng['cuda'] is not None and device_type == 'cuda':
        torch.cuda.set_rng_state(rng['cuda'])
    for f in glob.glob(os.path.join(out_dir, '*.pt.*.tmp')) if master else []:  # a save killed midway
        os.remove(f)
del state

def get_batch(data, ids, packed=False):  # src, tgt_in, the real target rows, their targets; pinned: no wait
    batch = [torch.from_numpy(x) for x in dataset.collate(data, ids, PAD, BOS, EOS)]
    if packed:  # cuda_graphs: each side one row of a fixed size, and where its sentences lie (speed.py)
        src, tgt_in, rows, sides = speed.pack(batch[0], batch[1], PAD, max_tokens + graph_len, graph_len)
        return [src, tgt_in, rows, batch[3], *sides]  # copied by the step, not by the prefetching thread
    return [(x.pin_memory() if device_type == 'cuda' else x).to(device, non_blocking=True) for x in batch]
graph_len = min(2 ** int(np.ceil(np.log2(dataset.pair_sizes(train_data).max()))), model_cfg.max_len)

def epoch_plan(epoch):  # the same on every rank: the seed and the epoch decide it
    plan = dataset.batch_plan(train_data, max_tokens, seed, epoch)
    if world * update_freq > len(plan):
        sys.exit(f"the training set makes {len(plan)} batches of max_tokens={max_tokens}, fewer than the "
                 f"{world * update_freq} an update needs ({world} process(es) x update_freq {update_freq})")
    return plan

def updates(epoch, batch_idx, plan):
    # -> epoch, next batch_idx, the update's target tokens over all ranks (each normalises by them), batches
    n = world * update_freq
    while True:
        if batch_idx + n > len(plan):  # the epoch's last batches do not fill an update
            epoch, batch_idx, plan = epoch + 1, 0, epoch_plan(epoch + 1)
        update, batch_idx = plan[batch_idx:batch_idx + n], batch_idx + n
        yield (epoch, batch_idx, sum(int(train_tgt_len[ids].sum()) for ids in update),
               [get_batch(train_data, update[m * world + rank], cuda_graphs) for m in range(update_freq)])

def prefetched(items):  # the next item is made by a background thread while this one's step runs
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(next, items)
        while True:
            item, job = job.result(), pool.submit(next, items)
            yield item

batches = prefetched(updates(epoch, batch_idx, epoch_plan(epoch)))
if init_from != 'resume' and run_files:  # --overwrite: only now that every input has loaded
    dist.barrier() if ddp else None  # every rank has listed the old run
    for f in run_files if master else []:
        os.remove(os.path.join(out_dir, f))
train_model = copy.deepcopy(raw_model).to(getattr(torch, dtype)) if master_weights else raw_model
for p in raw_model.parameters() if ddp and master_weights else []:  # DDP broadcasts only the copy's
    dist.broadcast(p.detach(), 0)
for layer in (*train_model.encoder, *train_model.decoder) if checkpoint_activations else []:  # fairseq's
    layer.forward = lambda *a, f=layer.forward: (torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)
                                                 if torch.is_grad_enabled() else f(*a))  # no_grad: none saved
for layer in (*train_model.encoder, *train_model.decoder) if compile else []:  # as bench.py measures it: per
    layer.compile(dynamic=True)  # layer (identical ones share one graph), batch shapes symbolic
chunk_fn = torch.compile(M.loss_chunk, dynamic=True) if compile else M.loss_chunk  # the loss's chunks
model = DDP(train_model, device_ids=[torch.cuda.current_device()] if device_type == 'cuda' else None,
            gradient_as_bucket_view=True, **{'forward_sync_buffers' if torch.__version__ >= (2, 13) else
            'broadcast_buffers': False}) if ddp and not cuda_graphs else train_model  # sinusoids: constant
graphed = speed.Graphed(train_model) if cuda_graphs else None

def get_lr(step, elapsed=0.0):
    if schedule == 'noam':  # section 5.3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        rate = lr_scale * model_cfg.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    else:  # fairseq's 'inverse_sqrt': linear warmup to lr, then lr * sqrt(warmup / step); or flat at lr
        rate = lr * min(step / warmup, (warmup / step) ** 0.5 if schedule == 'inverse_sqrt' else 1.0)
    # cooldown: linear decay to 0 over the last `cooldown` of the run, by the budget that ends it first
    done = max(step / max_steps, elapsed / (max_minutes * 60) if max_minutes > 0 else 0.0)
    return rate * min(1.0, max(0.0, (1.0 - done) / cooldown)) if cooldown > 0 else rate

def gather(obj):  # every rank's obj, in rank order
    out = [obj] * world
    return dist.all_gather_object(out, obj) or out if ddp else out

@torch.no_grad()
def validation_bleu():
    """Beam search (translate.py's default rule) over every world-th validation source, batched as
    translate.py does: longest first, up to 4096 padded tokens; empty or too long sources give ''."""
    lengths = np.diff(valid_data[1])
    mine = [i for i in range(rank, len(valid_ref), world) if 0 < lengths[i] < model_cfg.max_len]
    sizes, hyps = lengths[mine] + 1, {}
    for batch in dataset.token_batches(sizes, np.argsort(-sizes, kind='stable'), 4096):
        ids = [mine[j] for j in batch]
        with autocast:
            out = M.beam_search(raw_model, get_batch(valid_data, ids)[0], bleu_beam, bleu_lenpen)
        hyps.update((i, enc.decode(h[0][0])) for i, h in zip(ids, out))
    hyps = {i: h for share in gather(hyps) for i, h in share.items()}
    return BLEU().corpus_score([hyps.get(i, '') for i in range(len(valid_ref))], [valid_ref]).score

@torch.no_grad()
@torch.compiler.set_stance('force_eager')  # compiled layers run eagerly: no recompiles for eval or decoding
def evaluate(final=False):  # every rank takes part: each validates its share
    global best_bleu
    raw_model.eval()
    sums = torch.zeros(3, device=device)  # smoothed loss, NLL, tokens over this rank's share of batches
    for ids in dataset.batch_plan(valid_data, max_tokens, seed, 0, shuffle=False)[rank::world]:
        src, tgt_in, rows, targets = get_batch(valid_data, ids)
        with autocast:
            loss, nll = M.label_smoothed_loss(raw_model(src, tgt_in, rows), raw_model.embed.weight, targets,
                                              label_smoothing)
        sums += torch.stack([loss, nll, torch.tensor(len(rows), device=device)])
    dist.all_reduce(sums) if ddp else None
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

def save(path, full=False, **extra):  # weights (averaging and translate.py read them), or full: every rank
    ckpt = {'model': raw_model.state_dict(), 'model_cfg': asdict(model_cfg), 'tokenizer': tokenizer,
            'step': step, 'config': config, 'data_dir': data_dir, 'fine_tuned_from': fine_tuned_from, **extra}
    if full:
        rng = gather({'cpu': torch.get_rng_state(),
                      'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), epoch=epoch, rng=rng,
                    next_batch=batch_idx, best_bleu=best_bleu, elapsed=clock,
                    train_split=meta['splits']['train'])
    checkpoint.save_atomic(ckpt, path) if master else None

def save_snapshots():  # a training state to resume from and a weights snapshot to average; the oldest go
    save(os.path.join(out_dir, f'state_{step:07d}.pt'), full=True)
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))
    for prefix, keep in (('state', keep_state), ('ckpt', keep_last)) if master else []:
        for old in checkpoint.checkpoints(out_dir, prefix)[:-keep]:
            os.remove(old)
    dist.barrier() if ddp else None  # the other ranks read these files at the end (averaging)

def log_record(record):  # log.jsonl opens with the first record: a run stopped before it leaves none behind
    if master:
        with open(os.path.join(out_dir, 'log.jsonl'), 'a') as f:
            f.write(json.dumps(record) + '\n')

if init_from == 'resume' and master and not os.path.exists(os.path.join(out_dir, f'ckpt_{step:07d}.pt')):
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))  # killed between a state and its snapshot

# -----------------------------------------------------------------------------------------------
# training loop
log(json.dumps(config, indent=1))
log(f"model: {raw_model.num_params() / 1e6:.2f}M parameters; {world} process(es) x update_freq {update_freq} "
    f"x max_tokens {max_tokens}; device {device}, {dtype}; ready {time.time() - _t_process:.1f}s after start")
t_start = (t_last := time.time()) - elapsed
# clock: the training time all ranks agree on (under DDP at log steps, where the host waits for the GPU).
tokens_since, clock, last_save = 0, elapsed, elapsed  # the sums below: on the device until a log step too
loss_acc, nll_acc, bad_run, worst_run, skipped = (torch.zeros((), device=device) for _ in range(5))
max_steps = step if max_minutes > 0 and elapsed > max_minutes * 60 else max_steps  # resumed, time used up
while step < max_steps:
    epoch, batch_idx, ntok_update, micro_batches = next(batches)
    step += 1
    lr_now = get_lr(step, clock)
    for group in optimizer.param_groups:
        group['lr'] = lr_now
    try:
        for micro, (src, tgt_in, rows, targets, *sides) in enumerate(micro_batches):
            if ddp and not cuda_graphs:  # all-reduce gradients only on the last micro-step
                model.require_backward_grad_sync = micro == update_freq - 1
            if cuda_graphs:  # copied here: while a graph is captured, no other thread may use the GPU
                src, tgt_in, targets, *sides = (x.to(device) for x in (src, tgt_in, targets, *sides))
            with contextlib.nullcontext() if master_weights else autocast:  # real targets' decoder states
                x = graphed(src, tgt_in, rows, sides) if cuda_graphs else model(src, tgt_in, rows)
                loss, nll = M.label_smoothed_loss(x, train_model.embed.weight, targets, label_smoothing,
                                                  chunk_fn)
            # DDP averages gradients over ranks; scaling by world turns that average into the sum.
            scaler.scale(loss * world / ntok_update).backward()
            loss_acc += loss.detach()
            nll_acc += nll
    except torch.cuda.OutOfMemoryError:
        sys.exit(f"CUDA out of memory at max_tokens={max_tokens}: lower max_tokens and raise update_freq "
                 f"to keep the same tokens per update, or recompute with checkpoint_activations=True")
    speed.all_reduce_grads(train_model) if ddp and cuda_graphs else None  # DDP's hooks see no graph replay
    for p, q in zip(raw_model.parameters(), train_model.parameters()) if master_weights else []:
        p.grad, q.grad = q.grad.float(), None  # the float32 model takes the gradients (master_weights)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip_grad or math.inf)
    # A non-finite norm (all-reduced: every rank agrees) skips the update, as the fp16 grad scaler does.
    bad = ~torch.isfinite(grad_norm)
    optimizer.found_inf = bad.float()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if master_weights:  # and the copy in dtype its new weights
        torch._foreach_copy_([q.detach() for q in train_model.parameters()], list(raw_model.parameters()))
    bad_run = (bad_run + 1) * bad
    worst_run, skipped = torch.maximum(worst_run, bad_run), skipped + bad
    tokens_since += ntok_update
    elapsed = time.time() - t_start
    log_step = step % log_interval == 0 or step == max_steps
    clock = clock if ddp else elapsed
    if ddp and log_step:  # the line rank 0 prints is over every rank's tokens, the clock the slowest rank's
        sums, slowest = torch.stack([loss_acc, nll_acc]), torch.tensor(elapsed, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        (loss_acc, nll_acc), clock = sums, slowest.item()
    if max_minutes > 0 and clock > max_minutes * 60:  # under DDP, decided at a log step
        log(f"max_minutes={max_minutes} reached at step {step}")
        max_steps, log_step = step, True
    if log_step:
        if worst_run.item() >= max_bad_steps:  # every rank reads it: all stop together
            sys.exit(f"{int(worst_run.item())} non-finite updates in a row: lower the learning rate, use "
                     f"dtype='bfloat16' or 'float32', or set clip_grad")
        if master:
            dt, t_last = time.time() - t_last, time.time()
            loss_tok, ppl = loss_acc.item() / tokens_since, math.exp(min(nll_acc.item() / tokens_since, 50))
            eta = (max_steps - step) * elapsed / step
            eta = max(min(eta, max_minutes * 60 - elapsed) if max_minutes > 0 else eta, 0)
            log(f"step {step} | epoch {epoch} | loss {loss_tok:.3f} | ppl {ppl:.2f} | lr {lr_now:.2e} | "
                f"gnorm {grad_norm.item():.2f} | {tokens_since / dt:,.0f} tgt tok/s | "
                f"{elapsed / 60:.1f} min | ETA {eta / 60:.1f} min", flush=True)
            log_record(dict(step=step, epoch=epoch, loss=loss_tok, ppl=ppl, lr=lr_now,
                            grad_norm=grad_norm.item(), tok_per_s=tokens_since / dt, elapsed_min=elapsed / 60,
                            eta_min=eta / 60, skipped=int(skipped.item())))  # skipped: non-finite gradients
        tokens_since = 0
        torch._foreach_zero_([loss_acc, nll_acc, worst_run, skipped])
    if step != max_steps and any(n > 0 and step % n == 0 for n in (eval_interval, bleu_interval)):
        evaluate()
    if (save_interval and step % save_interval == 0) or step == max_steps \
            or (save_minutes > 0 and clock - last_save > save_minutes * 60):
        save_snapshots()
        last_save = clock
    t_last = time.time() if step % log_interval == 0 else t_last  # evaluation and saving: not in tokens/s

# Section 6.1: the reported models average the last checkpoints, written at regular intervals.
newest = checkpoint.checkpoints(out_dir)[-average_last:]
raw_model.load_state_dict(checkpoint.average_checkpoints(newest))
save(os.path.join(out_dir, 'ckpt.pt'))
log(f"averaged {len(newest)} checkpoint(s) into {os.path.join(out_dir, 'ckpt.pt')}")
evaluate(final=True)
log(f"done: step {step}, {(time.time() - t_start) / 60:.1f} min"
    + (f', best valid BLEU {best_bleu:.2f}' if best_bleu >= 0 else ''))
dist.barrier() if ddp else None  # no rank leaves while another still uses the process group
# Python's shutdown takes a second (torch's objects freed one by one) and, under DDP, a Gloo thread that still
# releases the last collective's tensors aborts it: leave at once.
sys.stdout.flush(), sys.stderr.flush(), os._exit(0)
