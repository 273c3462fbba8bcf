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

import data_prep
import model as M
import translate

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
bleu_interval = 0            # validation BLEU every N steps (0: only at the end, -1: never); best kept as ckpt_best.pt
bleu_beam = 4
bleu_lenpen = 0.6            # length penalty alpha of validation BLEU, and translate.py's default for the model
                             # (section 6.1: 0.6, chosen on the development set)
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
cooldown = 0.0               # the LR falls linearly to 0 over this last share of the run (max_steps or max_minutes; 0 = off)
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-9
weight_decay = 0.0
label_smoothing = 0.1
clip_grad = 0.0              # max gradient norm (0 = off; the paper does not clip)
# system
device = 'auto'              # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'               # 'auto' (bfloat16 where native, see translate.fast_dtype), 'bfloat16', 'float16' (GPU,
                             # with a gradient scaler) or 'float32'
compile = False
seed = 1337
max_bad_steps = 20           # consecutive non-finite updates before giving up
ddp_timeout_minutes = 60.0   # how long a rank waits in a collective (NCCL's default, 10, is short for a slow save)
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]


def override(config, args):
    """nanoGPT's configurator, strict: each config file is executed over the settings so far (it may read them,
    d_ff = 4 * d_model, and import modules), then each --key=value is parsed as a Python literal, wherever it
    stands among the files; unknown keys and wrong types name the key."""
    def check(key, value, where):
        if key not in config:
            sys.exit(f"{where}: unknown setting {key!r}")
        old = config[key]
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(old, float):
            value = float(value)
        if type(value) is not type(old):
            sys.exit(f"{where}: {key} must be {type(old).__name__}, got {value!r}")
        config[key] = value
    for arg in sorted(args, key=lambda a: a.startswith('--')):  # the files first, each group in its order
        if not arg.startswith('--'):
            if not os.path.exists(arg):
                sys.exit(f"config file {arg} not found")
            scope = dict(config)  # one namespace: its comprehensions and lambdas see its names too
            try:
                with open(arg, encoding='utf-8') as f:
                    exec(builtins.compile(f.read(), arg, 'exec'), scope)  # compile: also a setting here
            except OSError as e:
                sys.exit(f"config file {arg}: {e.strerror}")
            except Exception as e:  # the file's own mistake: its line, not a traceback through train.py
                lines = [e.lineno] if isinstance(e, SyntaxError) else \
                    [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
                sys.exit(f"config file {arg}{f', line {lines[-1]}' if lines else ''}: {type(e).__name__}: {e}")
            for key, value in scope.items():
                if not key.startswith('_') and not callable(value) and not isinstance(value, type(sys)):
                    check(key, value, arg)  # any name but its imports and functions must be a setting
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
for key in ('max_tokens', 'update_freq', 'max_steps', 'warmup', 'log_interval', 'keep_last', 'keep_state',
            'average_last', 'bleu_beam', 'n_enc_layers', 'n_dec_layers', 'd_model', 'd_ff', 'n_heads', 'max_len',
            'max_bad_steps'):
    if config[key] < 1:
        sys.exit(f"{key} must be at least 1, got {config[key]}")
if not 0 <= seed < 2 ** 63:  # torch.manual_seed takes below 2**64, with the rank and the step added (resume)
    sys.exit(f"seed must be at least 0 and below 2**63, got {seed}")
if bleu_lenpen < 0:
    sys.exit(f"bleu_lenpen must be at least 0, got {bleu_lenpen}")
for key in ('dropout', 'attn_dropout', 'label_smoothing', 'beta1', 'beta2'):
    if not 0 <= config[key] < 1:
        sys.exit(f"{key} must be at least 0 and below 1, got {config[key]}")
if not 1e-3 <= ddp_timeout_minutes <= 1e6:  # a timedelta in milliseconds: below rounds to 0, above overflows
    sys.exit(f"ddp_timeout_minutes must be between 0.001 and 1e6, got {ddp_timeout_minutes}")
for key in ('lr', 'lr_scale', 'adam_eps', 'weight_decay', 'clip_grad', 'max_minutes', 'save_minutes',
            'eval_interval', 'save_interval'):
    if not config[key] >= 0:  # 0: off, where it can be
        sys.exit(f"{key} must be at least 0, got {config[key]}")
if bleu_interval < -1:
    sys.exit(f"bleu_interval must be at least -1 (-1: never), got {bleu_interval}")
if schedule not in ('noam', 'inverse_sqrt'):
    sys.exit(f"schedule must be 'noam' or 'inverse_sqrt', got {schedule!r}")
if not 0 <= cooldown <= 1:
    sys.exit(f"cooldown must be between 0 and 1 (a share of the run), got {cooldown}")
if d_model % n_heads:
    sys.exit(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
    sys.exit(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
try:
    _type = 'auto' if device == 'auto' else torch.device(device).type
except RuntimeError:
    _type = None
if _type not in ('auto', 'cpu', 'cuda'):
    sys.exit(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
if device.startswith('cuda') and not torch.cuda.is_available():
    sys.exit(f"device={device!r} but torch sees no GPU (device='auto' picks one when there is)")

# -----------------------------------------------------------------------------------------------
# processes, device and precision
ddp = 'RANK' in os.environ
if ddp and not all(k in os.environ for k in ('WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')):
    sys.exit("RANK is set but not the rest of torchrun's environment (WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
             "MASTER_PORT): launch with torchrun, or unset RANK for one process")
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
if ddp:
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    # Validation is split across ranks, but a checkpoint save or a slow rank can still outlast NCCL's default.
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo',
                            timeout=datetime.timedelta(minutes=ddp_timeout_minutes))
else:
    rank, world = 0, 1
master = rank == 0
log = print if master else (lambda *a, **k: None)  # rank 0 speaks for all
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
if dtype == 'float16' and device_type == 'cpu':
    sys.exit("dtype='float16' needs a GPU; use 'bfloat16' or 'float32' on CPU")
if dtype == 'auto':
    dtype = translate.fast_dtype(device_type)
elif dtype == 'bfloat16' and translate.fast_dtype(device_type) != 'bfloat16':
    log(f"WARNING: this {device_type} has no native bfloat16 matrix multiply; dtype='bfloat16' will be far "
          "slower than 'float32' (dtype='auto' picks the faster one)", file=sys.stderr)
if average_last > keep_last:
    log(f"warning: average_last={average_last} but keep_last={keep_last}: ckpt.pt will average only the {keep_last} "
        f"newest snapshots (raise keep_last to average {average_last})")
torch.manual_seed(seed + rank)
if device_type == 'cpu':
    translate.keep_freed_memory()
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
if device_type == 'cpu' and dtype == 'bfloat16':
    # At sentence lengths the CPU flash-attention kernel is slower than the plain one in bf16 (README,
    # Performance). The switch is named 'cuda' but governs the CPU too.
    torch.backends.cuda.enable_flash_sdp(False)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = (contextlib.nullcontext() if dtype == 'float32'
            else torch.autocast(device_type=device_type, dtype=ptdtype))

# -----------------------------------------------------------------------------------------------
# out_dir: writable, and either a new run's or the one being resumed, before any work is done
data_prep.make_writable(out_dir, 'out_dir')
out_dir_locked = False
if master:  # one run in out_dir at a time: a second would mix its checkpoints into it
    try:
        out_dir_locked = data_prep.lock_folder(out_dir) is not None  # held until this process ends
    except BlockingIOError:
        sys.exit(f"out_dir {out_dir} is in use by another train.py run: let it end, or train into another --out_dir")
# With the temporary files of a save that a killed run left (translate.save_atomic): --overwrite deletes them too.
run_files = sorted(f for f in os.listdir(out_dir)
                   if f == 'log.jsonl' or re.fullmatch(r'(ckpt|state)(_\w+)?\.pt(\.\w+\.tmp)?', f))
if init_from == 'resume' and out_dir_locked:  # a killed save's leftovers: no other run writes here (the lock)
    for f in run_files:
        if f.endswith('.tmp'):
            os.remove(os.path.join(out_dir, f))
if init_from != 'resume' and run_files:
    if not overwrite:
        sys.exit(f"out_dir {out_dir} already holds a run ({', '.join(run_files[:4])}{', ...' if len(run_files) > 4 else ''}):"
                 f" continue it with --init_from=resume, train into another --out_dir, or start over with "
                 f"--overwrite=True (deletes them)")

# -----------------------------------------------------------------------------------------------
# data: the token files data_prep.py writes
if not os.path.exists(os.path.join(data_dir, 'meta.json')):
    # data_prep.py's own folder names say which corpus (config/wmt_base.py's is data/wmt14_en_de), else custom
    named = re.fullmatch(r'(multi30k|wmt14)_([a-z]+)_([a-z]+)', os.path.basename(os.path.normpath(data_dir)))
    how = (f"{named[1]} --src {named[2]} --tgt {named[3]}" if named else
           "custom --train PREFIX --valid PREFIX --test PREFIX --src SRC --tgt TGT")
    sys.exit(f"no prepared data in {data_dir} (meta.json missing): run `python data_prep.py {how} --out {data_dir}`")
try:  # the token files themselves are checked by load_split
    meta = data_prep.load_meta(data_dir)
    src_lang, tgt_lang, PAD, BOS, EOS = meta['src'], meta['tgt'], meta['pad_id'], meta['bos_id'], meta['eos_id']
    tokenizer = data_prep.tokenizer_dict(data_dir)
    enc = data_prep.load_tokenizer(tokenizer)
    if meta['vocab_size'] != enc.n_vocab or type(meta['vocab_size']) is not int:  # the embedding's rows
        raise ValueError(f"meta.json: vocab_size {meta['vocab_size']!r} is not the tokenizer's {enc.n_vocab} tokens")
    for key, name in (('pad_id', '<pad>'), ('bos_id', '<s>'), ('eos_id', '</s>')):
        if meta[key] != tokenizer['special_tokens'].get(name) or type(meta[key]) is not int:
            raise ValueError(f"meta.json: {key} {meta[key]!r} is not the tokenizer's {name} id")
    valid_src, valid_ref = (open(os.path.join(data_dir, f'valid.{lang}.txt'), encoding='utf-8').read().splitlines()
                            for lang in (src_lang, tgt_lang))
    if len(valid_src) != len(valid_ref):  # else validation BLEU fails at its first call, maybe at the end of the run
        raise ValueError(f"valid.{src_lang}.txt has {len(valid_src)} lines, valid.{tgt_lang}.txt {len(valid_ref)}")
except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: {data_dir} is incomplete or damaged ({type(e).__name__}: {e}): prepare it again with data_prep.py")


def get_batch(data, ids):
    # From pinned host memory the copy is asynchronous; from pageable memory the CUDA driver may first
    # wait for the stream (CUDA's notes on API synchronization), a host sync per step.
    pin = device_type == 'cuda'
    return [(torch.from_numpy(x).pin_memory() if pin else torch.from_numpy(x)).to(device, non_blocking=True)
            for x in data_prep.collate(data, ids, PAD, BOS, EOS)]


train_data, valid_data = data_prep.load_split(data_dir, 'train'), data_prep.load_split(data_dir, 'valid')
train_tgt_len = np.diff(train_data[3]) + 1  # + EOS: the target tokens the loss counts
for split, data, fate in (('training', train_data, 'are skipped'), ('validation', valid_data, 'are left out of valid_loss')):
    sizes = data_prep.pair_sizes(data)
    if len(sizes) and sizes.min() > max_tokens:
        sys.exit(f"max_tokens={max_tokens} is smaller than every {split} pair in {data_dir}: the shortest needs "
                 f"{sizes.min()} padded tokens (its longer side + EOS); raise max_tokens to at least {sizes.min()}")
    if len(sizes) and sizes.max() > max_tokens:
        log(f"warning: {(sizes > max_tokens).sum()} {split} pairs need more than max_tokens={max_tokens} padded "
            f"tokens and {fate}; max_tokens={sizes.max()} would keep them all")

# -----------------------------------------------------------------------------------------------
# model, optimiser, and the state to resume or fine-tune from
state = None
if init_from == 'resume':
    states = translate.checkpoints(out_dir, 'state')
    if not states:
        sys.exit(f"init_from='resume' but {out_dir} has no state_*.pt")
    init_path, state = states[-1], translate.read_checkpoint(states[-1], ('model', 'model_cfg', 'tokenizer', 'optimizer'))
    newer = [os.path.basename(p) for p in translate.checkpoints(out_dir) if int(os.path.basename(p)[5:-3]) > state['step']]
    if newer:  # another trajectory's weights (its state deleted or damaged): the final average would mix them in
        sys.exit(f"{out_dir} holds snapshots newer than {init_path} (step {state['step']}): {', '.join(newer[:4])}; "
                 f"move them out of it to resume from step {state['step']}")
    for path in translate.checkpoints(out_dir)[-average_last:]:  # the final average reads them: found now, not then
        try:  # mmap: the file's index, not its weights
            torch.load(path, map_location='cpu', weights_only=True, mmap=True)
        except Exception as e:
            sys.exit(f"{path} is damaged ({type(e).__name__}): move it out of {out_dir} to resume without it")
elif init_from != 'scratch':
    if os.path.isdir(init_from):  # not translate.py's advice, which names its own --average-last
        sys.exit(f"init_from={init_from!r} is a folder: give a checkpoint file in it (ckpt.pt), or continue the run "
                 f"in out_dir with --init_from=resume")
    init_path, state = init_from, translate.read_checkpoint(init_from)
if state is not None and not data_prep.same_tokenizer(translate.checkpoint_tokenizer(init_path, state), tokenizer):
    # Same size is not enough: two BPEs of 8000 merges map the same ids to different words.
    sys.exit(f"{init_path} was trained with another tokenizer than {data_dir}/tokenizer.json: its token ids "
             f"would mean other words; train on data prepared with its tokenizer "
             f"(it came from {state.get('data_dir', 'an unknown data_dir')})")
# A fine-tuned run, resumed or not, has its checkpoint's architecture whatever the settings say (said below).
fine_tuned_from = None if state is None else state.get('fine_tuned_from') if init_from == 'resume' else init_path
if init_from == 'resume':  # the saved architecture and optimizer state win: a different setting would be ignored
    # seed and max_tokens too: they make the batch plan that the saved position (next_batch) indexes.
    fixed = [f.name for f in fields(M.Config) if f.name in config and (not fine_tuned_from or 'dropout' in f.name)]
    fixed += ['beta1', 'beta2', 'adam_eps', 'weight_decay', 'seed', 'max_tokens']
    changed = [f"{k}={config[k]!r} (the run's: {state['config'][k]!r})" for k in fixed
               if k in state.get('config', {}) and config[k] != state['config'][k]]
    # The training set makes that plan too: a corpus of the same tokenizer (as a fine-tune's is), or the run's own
    # folder prepared again, would go on from this one's position. A copy or a moved folder resumes. (States
    # of older versions lack train_split: their data_dir's meta.json, where it is still there, stands in.)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = state.get('train_split') or data_prep.load_meta(state['data_dir'])['splits']['train']
        if saved != meta['splits']['train']:
            if os.path.abspath(state['data_dir']) == os.path.abspath(data_dir):
                sys.exit(f"{data_dir} holds other training pairs than {out_dir} was trained on ({saved} then, "
                         f"{meta['splits']['train']} now: prepared again?); resume on the data it began with, or "
                         f"start a new run from its weights with --init_from={os.path.join(out_dir, 'ckpt.pt')}")
            changed.append(f"data_dir={data_dir!r} (the run's: {state['data_dir']!r}, other training pairs)")
    if changed:
        sys.exit(f"init_from='resume' continues {out_dir} as it was trained, but these settings differ from "
                 f"its own: {', '.join(changed)}; drop them, or start a new run from its weights with "
                 f"--init_from={os.path.join(out_dir, 'ckpt.pt')}")
    others = [f"{k}={v!r} (was {state['config'][k]!r})" for k, v in config.items()
              if k not in ('init_from', 'overwrite', *(f.name for f in fields(M.Config)))  # those: refused or said below
              and k in state.get('config', {}) and v != state['config'][k]]
    if others:  # allowed (a longer run, another learning rate), but no longer the run as it began
        log(f"settings changed since {os.path.basename(init_path)}: {', '.join(others)}")
if state is not None:
    log(f"{'resuming' if init_from == 'resume' else 'fine-tuning'} from {init_path} (step {state.get('step', '?')})")
    # The architecture is the checkpoint's; dropout is a training setting, so a fine-tune may change it.
    model_cfg = translate.checkpoint_config(init_path, state)
    if init_from != 'resume':
        model_cfg.dropout, model_cfg.attn_dropout = dropout, attn_dropout
    if fine_tuned_from:
        # Said, and the settings made to agree, so that the config saved with each checkpoint is the model's.
        arch = {k: v for k, v in asdict(model_cfg).items() if k in config and config[k] != v}
        if arch:
            log(f"{'fine-tuning' if init_from != 'resume' else f'a run fine-tuned from {fine_tuned_from}'} keeps "
                f"the checkpoint's architecture: {', '.join(f'{k}={v!r} (settings: {config[k]!r})' for k, v in arch.items())}")
            config.update(arch)
            globals().update(arch)
else:
    # Round the vocabulary up to a multiple of 8 so the output matmul maps onto tensor cores.
    model_cfg = M.Config(**{f.name: config[f.name] for f in fields(M.Config) if f.name in config},
                         vocab_size=(meta['vocab_size'] + 7) // 8 * 8, pad_id=PAD, bos_id=BOS, eos_id=EOS)
# Positions past max_len have no encoding: a longer sentence would stop the run at the first batch holding it.
# Only pairs that some batch holds count: those over max_tokens are left out (reported above).
for split, data, remedy in (('training', train_data, 'leave long training pairs out (data_prep.py --max-len)'),
                            ('validation', valid_data, 'shorten the validation set')):
    sizes = data_prep.pair_sizes(data)  # the longer side + EOS (or BOS): the positions a pair needs
    longest = int(sizes[sizes <= max_tokens].max(initial=0))
    if longest > model_cfg.max_len:
        source = 'raise max_len, or ' if state is None else f"max_len is {init_path}'s: "
        sys.exit(f"{data_dir} has a {split} sentence of {longest} tokens (with EOS or BOS) but the model's max_len "
                 f"is {model_cfg.max_len}: {source}{remedy}")
raw_model = M.Transformer(model_cfg).to(device)
# Fused Adam (CPU and GPU) reads a found_inf flag and skips the update on the device: no host sync.
optimizer = torch.optim.Adam(raw_model.parameters(), lr=0.0, betas=(beta1, beta2), eps=adam_eps,
                             weight_decay=weight_decay, fused=True)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
step, epoch, batch_idx, best_bleu, elapsed = 0, 0, 0, -1.0, 0.0
if state is not None:
    translate.load_weights(raw_model, init_path, state['model'])
if init_from == 'resume':
    optimizer.load_state_dict(state['optimizer'])
    if state['scaler']:  # empty where the run did not train in float16
        scaler.load_state_dict(state['scaler'])
    step, epoch, best_bleu = state['step'], state['epoch'], state['best_bleu']
    try:  # the final evaluation writes ckpt_best.pt after the run's last state; mmap: its BLEU, not its weights
        best = torch.load(os.path.join(out_dir, 'ckpt_best.pt'), map_location='cpu', weights_only=True, mmap=True)
        best_bleu = max(best_bleu, float(best.get('valid_bleu', -1.0)))
    except FileNotFoundError:
        pass
    except Exception as e:  # a number to compare with, not worth stopping the run for
        log(f"warning: cannot read the valid_bleu of {os.path.join(out_dir, 'ckpt_best.pt')} "
            f"({type(e).__name__}); the first validation BLEU above the state's best replaces it")
    # The position in the epoch's batch plan, in batches: a resume with another number of processes or
    # another update_freq continues from the same batch. (Older states counted updates.)
    batch_idx = state['next_batch'] if 'next_batch' in state else \
        state['batch_idx'] * len(state['rng']) * state['config']['update_freq']
    elapsed = state.get('elapsed', 0.0)  # max_minutes and the cooldown count the run's training time so far
    if len(state['rng']) == world:  # every rank's own generator: dropout masks continue as if never stopped
        torch.set_rng_state(state['rng'][rank]['cpu'])
        if device_type == 'cuda' and state['rng'][rank]['cuda'] is not None:
            torch.cuda.set_rng_state(state['rng'][rank]['cuda'])
    else:
        log(f"warning: saved with {len(state['rng'])} process(es), resumed with {world}: dropout masks are reseeded")
        torch.manual_seed(seed + rank + 1000003 * step)
del state


def epoch_plan(epoch):  # the same on every rank: the seed and the epoch decide it
    plan = data_prep.batch_plan(train_data, max_tokens, seed, epoch)
    if world * update_freq > len(plan):
        sys.exit(f"the training set makes {len(plan)} batches of max_tokens={max_tokens}, fewer than the "
                 f"{world * update_freq} an update needs ({world} process(es) x update_freq {update_freq}): "
                 f"lower max_tokens")
    return plan


plan = epoch_plan(epoch)
if init_from != 'resume' and run_files:
    # --overwrite: the old run goes only now that every input has loaded and the model is built (a typo in
    # data_dir, a max_len too short, too few batches for an update, or fine-tuning from this out_dir's own
    # ckpt.pt must not cost it), and only after every rank has listed it.
    if ddp:
        dist.barrier()
    if master:
        for f in run_files:
            os.remove(os.path.join(out_dir, f))
    if ddp:
        dist.barrier()
model = torch.compile(raw_model) if compile else raw_model
# Compiled, the loss reads the (tokens x vocab) logits once forward and once backward instead of in
# several float32 passes: at 25k tokens and 37k words that is tens of GB per step (README, GPU).
loss_fn = torch.compile(M.label_smoothed_loss, dynamic=True) if compile else M.label_smoothed_loss
if ddp:
    model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == 'cuda' else None)


def get_lr(step, elapsed=0.0):
    if schedule == 'noam':  # section 5.3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        rate = lr_scale * model_cfg.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    else:  # 'inverse_sqrt', fairseq's: linear warmup to lr, then lr * sqrt(warmup / step)
        rate = lr * min(step / warmup, (warmup / step) ** 0.5)
    if cooldown > 0:  # linear decay to 0 over the last `cooldown` of the run, by whichever budget ends it first
        done = max(step / max_steps, elapsed / (max_minutes * 60) if max_minutes > 0 else 0.0)
        rate *= min(1.0, max(0.0, (1.0 - done) / cooldown))
    return rate


# agree's answer before its first all-reduce: the training time the run resumed with.
pending = torch.tensor([elapsed], device=device) if ddp else None


def agree(*values):
    """Time-based decisions taken the same on every rank, whose clocks differ (the elapsed time that times
    the saves, stops the run and drives the cooldown): each value's maximum over ranks, as floats. Under DDP it
    is read one step late, so that the host never waits for the GPU: the all-reduce runs on the training
    device (NCCL reduces GPU tensors only) behind the step's work."""
    global pending
    if not ddp:
        return [float(v) for v in values]
    now = torch.zeros(len(values), device=device)
    for i, v in enumerate(values):
        now[i] = float(v)
    dist.all_reduce(now, op=dist.ReduceOp.MAX)
    previous, pending = pending, now
    return [0.0] * len(values) if previous is None else previous.tolist()


def gather(obj):  # every rank's obj, in rank order
    if not ddp:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def validation_loss():
    raw_model.eval()
    sums = torch.zeros(3, device=device)  # smoothed loss, NLL, tokens: summed over this rank's share of batches
    for ids in data_prep.batch_plan(valid_data, max_tokens, seed, 0, shuffle=False)[rank::world]:
        src, tgt_in, tgt_out = get_batch(valid_data, ids)
        with autocast:
            sums += torch.stack([x.float() for x in M.label_smoothed_loss(raw_model(src, tgt_in), tgt_out,
                                                                            label_smoothing, PAD)])
    if ddp:
        dist.all_reduce(sums)
    raw_model.train()
    total, nll, ntok = sums.tolist()
    return total / ntok, math.exp(nll / ntok)


def validation_bleu():
    raw_model.eval()
    with autocast:  # each rank translates every world-th sentence
        hyps = list(translate.translate_lines(raw_model, enc, valid_src[rank::world], beam=bleu_beam,
                                              alpha=bleu_lenpen))
    raw_model.train()
    shares = gather(hyps)
    return translate.bleu([shares[i % world][i // world] for i in range(len(valid_src))], valid_ref).score


def save(path, full=False, **extra):
    """Weights only (what averaging and translate.py read), or with full=True the whole training state,
    every rank's random generators included; with full=True every rank must call it (it gathers)."""
    ckpt = {'model': raw_model.state_dict(), 'model_cfg': asdict(model_cfg), 'tokenizer': tokenizer,
            'step': step, 'config': config, 'data_dir': data_dir, 'fine_tuned_from': fine_tuned_from, **extra}
    if full:
        rng = gather({'cpu': torch.get_rng_state(),
                      'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})
        ckpt.update(optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), epoch=epoch,
                    next_batch=batch_idx, best_bleu=best_bleu, rng=rng, elapsed=clock,
                    train_split=meta['splits']['train'])
    if master:
        translate.save_atomic(ckpt, path)


def checkpoint():
    save(os.path.join(out_dir, f'state_{step:07d}.pt'), full=True)
    save(os.path.join(out_dir, f'ckpt_{step:07d}.pt'))
    if master:
        for prefix, keep in (('state', keep_state), ('ckpt', keep_last)):
            for old in translate.checkpoints(out_dir, prefix)[:-keep]:
                os.remove(old)
    if ddp:
        dist.barrier()  # the other ranks read these files at the end (averaging)


def evaluate(final=False):  # every rank takes part: each validates its share
    global best_bleu
    record = {'step': step}
    record['valid_loss'], record['valid_ppl'] = validation_loss()
    if bleu_interval >= 0 and (final or (bleu_interval and step % bleu_interval == 0)):
        record['valid_bleu'] = validation_bleu()
        if record['valid_bleu'] > best_bleu:
            best_bleu = record['valid_bleu']
            save(os.path.join(out_dir, 'ckpt_best.pt'), valid_bleu=best_bleu)
    log(' | '.join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    log_record(record)


logfile = None


def log_record(record):  # log.jsonl opens with the first record: a run stopped before it leaves none behind
    global logfile
    if master:
        logfile = logfile or open(os.path.join(out_dir, 'log.jsonl'), 'a')
        logfile.write(json.dumps(record) + '\n')
        logfile.flush()


if init_from == 'resume':  # killed between a state and its snapshot: the average would lack it (or have none)
    snapshot = os.path.join(out_dir, f'ckpt_{step:07d}.pt')
    if master and not os.path.exists(snapshot):
        save(snapshot)
    if ddp:
        dist.barrier()  # every rank averages it at the end

# -----------------------------------------------------------------------------------------------
# training loop
log(json.dumps(config, indent=1))
log(f"model: {raw_model.num_params() / 1e6:.2f}M parameters; {world} process(es) x update_freq "
    f"{update_freq} x max_tokens {max_tokens}; device {device}, {dtype}")
log(f"{len(plan):,} batches this epoch; ready to train {time.time() - _t_process:.1f}s after start")
per_update = world * update_freq
t_last = time.time()
t_start = t_last - elapsed
tokens_since, clock = 0, elapsed  # clock: the elapsed seconds all ranks agree on
last_save = clock  # on that clock: a save it times is one decision on every rank, taken once
# Kept on the device and read only at log steps: a .item() per step would stall the GPU queue.
loss_acc, nll_acc = torch.zeros((), device=device), torch.zeros((), device=device)
streak, worst_streak, skipped = (torch.zeros((), device=device) for _ in range(3))
raw_model.train()
if max_minutes > 0 and elapsed > max_minutes * 60:  # resumed after its time ran out: not one more step
    log(f"max_minutes={max_minutes} reached at step {step}")
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
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip_grad if clip_grad > 0 else float('inf'))
    # A non-finite norm (the gradients are all-reduced, so every rank agrees) skips the update, as the
    # fp16 grad scaler does: with float16 the scaler sets found_inf itself and also lowers its scale.
    bad = ~torch.isfinite(grad_norm)
    optimizer.found_inf = bad.float()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    streak = (streak + 1) * bad
    worst_streak, skipped = torch.maximum(worst_streak, streak), skipped + bad
    tokens_since += ntok_update
    elapsed = time.time() - t_start
    (clock,) = agree(elapsed)
    if max_minutes > 0 and clock > max_minutes * 60:
        log(f"max_minutes={max_minutes} reached at step {step}")
        max_steps = step
    if step % log_interval == 0 or step == max_steps:  # every rank reads the bad-step counters
        if ddp:  # the line rank 0 prints is over every rank's tokens
            sums = torch.stack([loss_acc, nll_acc])
            dist.all_reduce(sums)
            loss_acc.copy_(sums[0]), nll_acc.copy_(sums[1])
        if worst_streak.item() >= max_bad_steps:
            sys.exit(f"{int(worst_streak.item())} non-finite updates in a row: lower the learning rate, use "
                     f"dtype='bfloat16' or 'float32', or set clip_grad")
        if skipped.item():
            log(f"warning: {int(skipped.item())} update(s) with a non-finite gradient norm skipped since the last log line")
        if master:
            dt, t_last = time.time() - t_last, time.time()
            loss_tok = loss_acc.item() / tokens_since
            ppl = math.exp(min(nll_acc.item() / tokens_since, 50))
            eta = (max_steps - step) * elapsed / step
            if max_minutes > 0:
                eta = min(eta, max_minutes * 60 - elapsed)
            record = dict(step=step, epoch=epoch, loss=loss_tok, ppl=ppl, lr=lr_now, grad_norm=grad_norm.item(),
                          tok_per_s=tokens_since / dt, elapsed_min=elapsed / 60, eta_min=max(eta, 0) / 60)
            log(f"step {step} | epoch {epoch} | loss {loss_tok:.3f} | ppl {ppl:.2f} | lr {lr_now:.2e} | "
                f"gnorm {grad_norm.item():.2f} | {tokens_since / dt:,.0f} tgt tok/s | "
                f"{elapsed / 60:.1f} min | ETA {max(eta, 0) / 60:.1f} min", flush=True)
            log_record(record)
        tokens_since = 0
        loss_acc.zero_(), nll_acc.zero_(), worst_streak.zero_(), skipped.zero_()
    if ((eval_interval and step % eval_interval == 0) or (bleu_interval > 0 and step % bleu_interval == 0)) \
            and step != max_steps:
        evaluate()
    if ((save_interval and step % save_interval == 0) or (save_minutes > 0 and clock - last_save > save_minutes * 60)
            or step == max_steps):
        checkpoint()
        last_save = clock
    if step % log_interval == 0:
        t_last = time.time()  # evaluation and saving do not count against tokens/s

# Section 6.1: the reported models average the last checkpoints, written at regular intervals.
newest = translate.checkpoints(out_dir)[-average_last:]
raw_model.load_state_dict(translate.average_checkpoints(newest))
save(os.path.join(out_dir, 'ckpt.pt'))
log(f"averaged {len(newest)} checkpoint(s) into {os.path.join(out_dir, 'ckpt.pt')}")
evaluate(final=True)
bleu_note = f', best valid BLEU {best_bleu:.2f}' if best_bleu >= 0 else ''  # -1: BLEU never computed
log(f"done: step {step}, {(time.time() - t_start) / 60:.1f} min{bleu_note}")
if ddp:
    dist.barrier()  # no rank tears down its process group while another still uses it
    dist.destroy_process_group()
    # A Gloo worker thread can still be releasing the last collective's tensors, which takes the interpreter
    # lock; if Python is shutting down by then, the process aborts ("terminate called without an active
    # exception", SIGABRT) after a run that finished. Everything is written, so leave without that shutdown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
