"""
Checkpoints and run folders, shared by train.py, translate.py, export_ct2.py and plot.py:
- files written whole or not at all (atomic), and folder locks;
- a run folder: who may write into it, the snapshots kept, the state a run starts from, the
  architecture it trains, whether it can resume with the settings given, and putting a training
  state back (optimizer, generators);
- reading, listing and averaging checkpoints (section 6.1);
- loading a model for translation, with a check that its tokenizer fits it (size and specials).
docs/formats.md describes the files.
"""
import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import signal
import sys
import tempfile

import torch

import dataset
import model as M

# --- atomic files and locks ----------------------------------------------------------------------


def make_writable(folder, option):
    """Create folder if need be and check that it takes files, else one line naming the option."""
    try:
        os.makedirs(folder, exist_ok=True)
        # A name of its own: two runs may check one folder at once.
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        sys.exit(f'error: {option} {folder} cannot be created or written: {e.strerror}')


def temporary(path):
    """A new, empty file beside path with a name of its own (PATH.RANDOM.tmp), to be renamed."""
    tmp = f'{path}.{os.urandom(4).hex()}.tmp'
    # 'x': never another's file; and as readable as the umask allows, as path will be.
    open(tmp, 'xb').close()
    return tmp


@contextlib.contextmanager
def atomic(path):
    """A file to write path through: fsynced and renamed to path when the block ends, removed if it
    fails; so a crash or a full disk never leaves a truncated file as path."""
    tmp = temporary(path)
    try:
        with open(tmp, 'wb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # before the rename: a power cut could leave unwritten blocks
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def stop_on_signals():
    """kill and timeout (SIGTERM) and a closed terminal (SIGHUP) stop a script as Ctrl-C does: its
    partial files go (they have temporary names until complete) and it says so in one line. A
    signal ignored from the start stays ignored (nohup)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, signal.default_int_handler)


def save_atomic(obj, path):
    """torch.save, whole or not at all; a failed write is one line."""
    try:
        with atomic(path) as f:
            torch.save(obj, f)
    except OSError as e:  # a missing or read-only folder, a full disk
        fail(f"cannot write {path}: {e.strerror or e}")
    except RuntimeError as e:
        message = str(e).strip()
        # torch's zip writer reports a short write (a full disk) this way; other errors are bugs
        if 'inline_container' not in message and 'PytorchStreamWriter' not in message:
            raise
        fail(f"cannot write {path} (a full disk?): {message.splitlines()[0]}")


def write_json(path, obj):
    with atomic(path) as f:
        f.write(json.dumps(obj, ensure_ascii=False, indent=1).encode('utf-8'))


def lock_folder(folder, busy=None):
    """flock folder until the fd returned closes or the process ends. If another process holds it:
    print busy and wait, or with busy None raise BlockingIOError."""
    import fcntl  # POSIX only: importing this module must work everywhere
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if busy is None:
            os.close(fd)
            raise
        print(busy, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


# --- the run folder of train.py ------------------------------------------------------------------

# The code that decides what a run computes: a run goes on only under the code it began with, else
# a rerun after an edit would put the old run's weights under the new code.
CODE_FILES = ('model.py', 'train.py', 'dataset.py', 'speed.py', 'decode.py')
RUN_FILE = re.compile(r'log\.jsonl|(ckpt|state)\w*\.pt')
held_locks = []  # open until the process ends


def open_run(out_dir, init_from, overwrite, master, given, defaults):
    """Make out_dir ready for a run: writable, held by this run alone (rank 0 takes the lock), and
    not holding another run unless that run is resumed or overwritten. A run of the same settings
    (given: the settings as this command gives them) goes on: a preempted job rerun with the same
    command continues. -> init_from as this run takes it ('resume' when it goes on), and the run
    files found in out_dir (to delete, when the run starts over)."""
    if master:
        try:
            held_locks.append(lock_folder(out_dir))
        except BlockingIOError:
            sys.exit(f"out_dir {out_dir} is in use by another train.py run: let it end, "
                     f"or use another --out_dir")
    run_files = [f for f in sorted(os.listdir(out_dir)) if RUN_FILE.fullmatch(f)]
    start = init_from
    if init_from == 'auto':
        start = 'scratch'
    if init_from == 'resume' or not run_files or overwrite:
        return start, run_files
    states = checkpoints(out_dir, 'state')
    if init_from != 'scratch' and states:
        differ = settings_differ(states[-1], given, defaults)
        if not differ:
            return 'resume', run_files
        sys.exit(f"out_dir {out_dir} holds a run that differs ({', '.join(differ[:3])}): "
                 f"use another --out_dir, start over with --overwrite=True (deletes it), "
                 f"or continue it as it is with --init_from=resume")
    # A run killed before its first state (validation BLEU may have written ckpt_best.pt): nothing
    # to go on from.
    no_state = set(run_files) <= {'log.jsonl', 'ckpt_best.pt'}
    if init_from != 'scratch' and no_state:
        if master:
            print(f"out_dir {out_dir} holds only {' and '.join(run_files)} of a run that saved no "
                  f"state: starting over")
        return start, run_files
    sys.exit(f"out_dir {out_dir} already holds a run ({', '.join(run_files[:3])}, ...): "
             f"continue it with --init_from=resume, use another --out_dir, "
             f"or start over with --overwrite=True (deletes it)")


def code_digests():
    """{name: SHA-256} of CODE_FILES as they are now; a file left out (a serving copy without
    train.py, say) is not compared."""
    here = os.path.dirname(os.path.abspath(__file__))
    digests = {}
    for name in CODE_FILES:
        path = os.path.join(here, name)
        if not os.path.isfile(path):
            continue
        with open(path, 'rb') as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    return digests


def settings_differ(path, given, defaults):
    """The settings and code files of a training state's run that differ from those given and
    these. A setting newer than the state: its run had the default."""
    state = read_checkpoint(path, keys=('config',), mmap=True)
    saved = state.get('given_config', state['config'])
    differ = []
    # The run goes on only if it began as this command begins one: fine-tuned from the same
    # checkpoint, or ('auto') from scratch.
    init_from = given['init_from']
    tuned_from = state.get('fine_tuned_from')
    if init_from == 'auto':
        began_alike = tuned_from is None
    else:
        began_alike = same_file(init_from, tuned_from)
    if not began_alike:
        was = tuned_from or 'scratch'
        differ.append(f"init_from={init_from!r} (the run began from {was!r})")
    for key, value in given.items():
        if key in ('init_from', 'overwrite', 'out_dir'):  # out_dir: the folder looked in
            continue
        was = saved.get(key, defaults.get(key))
        if value != was:
            # the command's, not the model's: a fine-tune keeps its checkpoint's architecture
            differ.append(f"{key}={value!r} (the run's command: {was!r})")
    differ += code_changed(state)
    return differ


def code_changed(state):
    """Which CODE_FILES changed since a training state's run began (a state older than the
    digests: none known)."""
    saved = state.get('code', {})
    changed = []
    for name, digest in code_digests().items():
        if saved.get(name, digest) != digest:
            changed.append(f"{name} changed since the run began")
    return changed


def same_file(path, other):
    """Whether two paths name one file: the same path as written, or where both exist, one file."""
    if other is None:
        return False
    if os.path.normpath(path) == os.path.normpath(other):
        return True
    if not os.path.exists(path) or not os.path.exists(other):
        return False
    return os.path.samefile(path, other)


def trim_log(out_dir, step, final=False):
    """A resumed run logs the steps after its state again: the log keeps the records up to it.
    final: before the final evaluation, which replaces the one a rerun of a finished run finds."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return
    with open(path, encoding='utf-8') as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the torn last line of a killed run
            continue
        evaluated = 'valid_loss' in record and record.get('step') == step
        if record.get('step', 0) <= step and not (final and evaluated):
            kept.append(line)
    if len(kept) < len(lines):
        with atomic(path) as f:
            f.write(''.join(kept).encode('utf-8'))


def remove_run(out_dir, run_files, ddp, master):
    """--overwrite: the old run's files go, once every rank has listed them."""
    if ddp:
        torch.distributed.barrier()
    if master:
        for f in run_files:
            os.remove(os.path.join(out_dir, f))


def remove_partial_saves(out_dir):
    """The temporary files of a save (or of the log's trim) that was killed midway."""
    for pattern in ('*.pt.*.tmp', 'log.jsonl.*.tmp'):
        for f in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            os.remove(f)


def rotate(out_dir, keep_state, keep_last):
    """Remove the oldest training states and weight snapshots beyond the numbers kept."""
    for prefix, keep in (('state', keep_state), ('ckpt', keep_last)):
        for old in checkpoints(out_dir, prefix)[:-keep]:
            os.remove(old)


def rng_state(device_type):
    """This process's random generators, for dropout to go on after a resume as if never stopped."""
    cuda = None
    if device_type == 'cuda':
        cuda = torch.cuda.get_rng_state()
    return {'cpu': torch.get_rng_state(), 'cuda': cuda}


def restore_rng(saved, rank, world, device_type):
    """Set this rank's generators from a state's list of one per rank. -> False, untouched, when
    another number of ranks saved them."""
    if len(saved) != world:
        return False
    torch.set_rng_state(saved[rank]['cpu'])
    if saved[rank]['cuda'] is not None and device_type == 'cuda':
        torch.cuda.set_rng_state(saved[rank]['cuda'])
    return True


def initial_state(init_from, out_dir, config, meta, tokenizer, log):
    """-> (state, its path, the checkpoint the run was fine-tuned from) for init_from 'scratch'
    (no state), 'resume' (out_dir's newest training state) or a checkpoint to fine-tune; checked
    against the data (its tokenizer) and, to resume, against the settings."""
    if init_from == 'scratch':
        return None, None, None
    path = init_from
    if init_from == 'resume':
        states = checkpoints(out_dir, 'state')
        if not states:
            sys.exit(f"init_from='resume' but {out_dir} has no state_*.pt")
        path = states[-1]
    state = read_checkpoint(path)
    check_tokenizer_of_data(path, state, tokenizer, config['data_dir'])
    if init_from != 'resume':
        log(f"fine-tuning from {path} (step {state['step']})")
        return state, path, path
    log(f"resuming from {path} (step {state['step']})")
    for change in code_changed(state):
        log(f"warning: {change}: the run goes on under the new code")
    check_resume(state, config, state['fine_tuned_from'], meta['splits']['train'], out_dir)
    return state, path, state['fine_tuned_from']


def check_tokenizer_of_data(path, state, tokenizer, data_dir):
    # The same size is not enough: two BPEs of 8000 merges give the same ids to different words.
    if not dataset.same_tokenizer(checkpoint_tokenizer(path, state), tokenizer):
        sys.exit(f"{path} was trained with another tokenizer than {data_dir}: its token ids would "
                 f"mean other words; train on data prepared with its tokenizer "
                 f"(data_prep.py --tokenizer)")


def check_resume(state, config, fine_tuned_from, train_split, out_dir):
    """A run goes on as it began: its architecture (a fine-tuned run's is its checkpoint's, said
    anyway), optimizer, batch plan and training pairs; other settings (max_steps, lr) may change."""
    fixed = ['beta1', 'beta2', 'adam_eps', 'weight_decay', 'seed', 'max_tokens']
    for f in dataclasses.fields(M.Config):
        if f.name in config and (not fine_tuned_from or f.name in ('dropout', 'attn_dropout')):
            fixed.append(f.name)
    changed = []
    for key in fixed:
        # A model setting newer than the state: its run had Config's default. Any other setting
        # missing from it reads as None, which differs: refused.
        was = state['config'].get(key, getattr(M.Config, key, None))
        if config[key] != was:
            changed.append(f"{key}={config[key]!r} (the run's: {was!r})")
    if state['train_split'] != train_split and same_file(config['data_dir'], state['data_dir']):
        changed.append(f"data_dir={config['data_dir']!r} (prepared again since: "
                       f"{train_split['pairs']} training pairs, the run's: "
                       f"{state['train_split']['pairs']})")
    elif state['train_split'] != train_split:
        changed.append(f"data_dir={config['data_dir']!r} (other training pairs than the run's "
                       f"{state['data_dir']!r})")
    if changed:
        sys.exit(f"the run in {out_dir} goes on only as it began, but these differ: "
                 f"{', '.join(changed)}; give the run's, or start anew from its weights with "
                 f"--init_from={out_dir}/ckpt.pt")


def model_config(state, fine_tuned_from, config, meta, tokenizer_size, log):
    """The model's Config: the settings' for a new model, else the checkpoint's architecture, which
    fine-tuning keeps (config takes it: the config saved with each checkpoint is the model's)."""
    if state is None:
        names = [f.name for f in dataclasses.fields(M.Config)]
        model_args = {key: config[key] for key in names if key in config}
        # The vocabulary rounded up to a multiple of 8: the output matmul fits the tensor cores.
        vocab_size = (meta['vocab_size'] + 7) // 8 * 8
        cfg = M.Config(**model_args, vocab_size=vocab_size, pad_id=meta['pad_id'],
                       bos_id=meta['bos_id'], eos_id=meta['eos_id'])
    else:
        cfg = M.Config(**state['model_cfg'])
    # Dropout is a training setting; ids past the tokenizer's are never made.
    cfg.dropout = config['dropout']
    cfg.attn_dropout = config['attn_dropout']
    cfg.tokenizer_size = tokenizer_size
    if fine_tuned_from:
        arch = {}
        for key, value in dataclasses.asdict(cfg).items():
            if key in config and config[key] != value:
                arch[key] = value
        if arch:
            log(f"fine-tuning keeps the checkpoint's architecture: {arch}")
            config.update(arch)
    return cfg


# What train.py's training state holds beyond a weights snapshot's keys
TRAINING_KEYS = ('optimizer', 'scaler', 'epoch', 'rng', 'next_batch', 'best_bleu', 'elapsed',
                 'train_split')


def resume(state, path, optimizer, scaler, out_dir, seed, rank, world, device_type, log):
    """Put a training state's optimizer, loss scaler and random generators back, and mend what a
    killed run left in out_dir (partial saves, the log past the state, a missing snapshot). -> its
    step, epoch, next batch, training seconds and best validation BLEU."""
    step = state['step']
    load_optimizer_state(optimizer, state, path)
    # The scaler runs for float16 alone: a float16 state resumed in bf16 or float32 needs no scale.
    if state['scaler'] and scaler.is_enabled():
        scaler.load_state_dict(state['scaler'])
    if not restore_rng(state['rng'], rank, world, device_type):
        # The generators were saved per rank: another number of ranks cannot go on with them.
        torch.manual_seed(seed + rank + 1000003 * step)
        log(f"resumed by {world} process(es), saved by {len(state['rng'])}: dropout is reseeded")
    if rank == 0:
        remove_partial_saves(out_dir)
        trim_log(out_dir, step)
        # Killed between the state and its weights snapshot: averaging needs the snapshot.
        snapshot = os.path.join(out_dir, f'ckpt_{step:07d}.pt')
        if not os.path.exists(snapshot):
            weights = {key: value for key, value in state.items() if key not in TRAINING_KEYS}
            save_atomic(weights, snapshot)
    best_bleu = max(state['best_bleu'], best_bleu_in(out_dir))
    return step, state['epoch'], state['next_batch'], state['elapsed'], best_bleu


def load_optimizer_state(optimizer, state, path):
    """The optimizer's moments from a training state, refused in one line when its parameter groups
    are not this optimizer's (one group for every parameter, where weight decay needs two)."""
    saved_groups = state['optimizer']['param_groups']
    if len(saved_groups) != len(optimizer.param_groups):
        sys.exit(f"{path} holds an optimizer of {len(saved_groups)} parameter group(s), "
                 f"this train.py has {len(optimizer.param_groups)} (decay on matrices only): "
                 f"it cannot resume; "
                 f"fine-tune from its weights instead, with --init_from={path}")
    optimizer.load_state_dict(state['optimizer'])


def best_bleu_in(out_dir):
    """The validation BLEU of out_dir's ckpt_best.pt, or -1: the final evaluation's best is newer
    than the last training state."""
    path = os.path.join(out_dir, 'ckpt_best.pt')
    if not os.path.exists(path):
        return -1.0
    best = read_checkpoint(path, keys=('valid_bleu',), mmap=True)
    return best['valid_bleu']


# --- reading, listing and averaging checkpoints --------------------------------------------------


def fail(msg):  # named after the running script: every script reads checkpoints through these
    raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {msg}")


def read_checkpoint(path, keys=('model', 'model_cfg', 'tokenizer'), mmap=False):
    """A checkpoint holding keys, or one line naming it; mmap: tensors read when used."""
    if os.path.isdir(path):
        fail(f"{path} is a folder: give a checkpoint file in it, such as ckpt.pt")
    if not os.path.isfile(path):
        fail(f"checkpoint {path} not found")
    # weights_only: our checkpoints hold only tensors and plain containers: loading runs no code.
    try:
        ckpt = torch.load(path, map_location='cpu', mmap=mmap, weights_only=True)
    except Exception as e:
        fail(f"cannot read checkpoint {path}: not a checkpoint, or a damaged one "
             f"({type(e).__name__})")
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        fail(f"{path} is not a model checkpoint: missing {', '.join(missing)}")
    return ckpt


def load_weights(model, weights, path):
    """model.load_state_dict(weights), or one line naming the parameters that do not fit: model.py
    changed since checkpoint path was saved."""
    own = model.state_dict()
    missing = [name for name in own if name not in weights]
    unexpected = [name for name in weights if name not in own]
    resized = [name for name in own if name in weights and own[name].shape != weights[name].shape]
    wrong = []
    kinds = (('missing', missing), ('unexpected', unexpected), ('other shapes', resized))
    for kind, names in kinds:
        if len(names) > 3:
            names = names[:3] + [f'{len(names) - 3} more']
        if names:
            wrong.append(f"{kind} {', '.join(names)}")
    if wrong:
        fail(f"{path} does not fit this model.py ({'; '.join(wrong)}): was model.py changed since "
             f"it was saved? Undo the change, or train a new model (train.py: another out_dir, or "
             f"--overwrite=True)")
    model.load_state_dict(weights)


def checkpoint_tokenizer(path, ckpt):
    """A checkpoint's tokenizer dict: embedded, or the file or data folder it names (maybe relative
    to the checkpoint's folder)."""
    tok = ckpt['tokenizer']
    if isinstance(tok, str) and not os.path.exists(tok):
        tok = os.path.join(os.path.dirname(path), tok)
    try:
        return dataset.read_tokenizer(tok)
    except (OSError, ValueError, TypeError) as e:
        fail(f"{path}: cannot read its tokenizer {tok}: {e}")


def checkpoints(folder, prefix='ckpt'):
    """{prefix}_STEP.pt in folder by step: train.py's weight snapshots (ckpt) or training states
    (state)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(folder), f'{prefix}_*.pt')):
        match = re.fullmatch(rf'{prefix}_(\d+)\.pt', os.path.basename(path))
        if match:
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def average_checkpoints(paths):
    """Section 6.1: the checkpoints' mean weights (summed in float64), refused for checkpoints of
    another tokenizer, architecture or parameter names."""
    total, first = {}, None
    for p in paths:
        ckpt = read_checkpoint(p, keys=('model',))
        if first is None:
            first = ckpt
        if ckpt.get('tokenizer') != first.get('tokenizer'):
            fail(f"{p}: its tokenizer differs from that of {paths[0]}: not checkpoints of one run")
        # Older checkpoints lack newer fields; dropout is a training setting, not the model's.
        cfg = ckpt.get('model_cfg') or {}
        first_cfg = first.get('model_cfg') or {}
        shared = cfg.keys() & first_cfg.keys()
        diff = sorted(k for k in shared if cfg[k] != first_cfg[k] and 'dropout' not in k)
        if diff or ckpt['model'].keys() != first['model'].keys():
            what = ', '.join(diff) or 'parameters'
            fail(f"{p}: its model differs from that of {paths[0]} ({what})")
        for k, v in ckpt['model'].items():
            if k in total:
                total[k] = total[k] + v.double()
            else:
                total[k] = v.double()
    return {k: (v / len(paths)).to(first['model'][k].dtype) for k, v in total.items()}


# --- loading a model for translation -------------------------------------------------------------


def warn(msg):
    print(f"{os.path.basename(sys.argv[0])}: warning: {msg}", file=sys.stderr)


def check_tokenizer(path, cfg, enc):
    # A tokenizer too large for the model, or whose specials are not the model's ids, would
    # decode garbage: refuse it. (Another BPE of the same size passes: train.py compares them.)
    if cfg.vocab_size < enc.n_vocab:
        fail(f"{path}: model vocab_size {cfg.vocab_size} is below the tokenizer's "
             f"{enc.n_vocab} tokens")
    for name, want in (('<pad>', cfg.pad_id), ('<s>', cfg.bos_id), ('</s>', cfg.eos_id)):
        if enc.encode(name, allowed_special='all') != [want]:
            fail(f"{path}: the tokenizer's {name} is not the model's id {want}")
    # Decoding never generates the ids past the tokenizer's (a checkpoint may not say).
    cfg.tokenizer_size = enc.n_vocab


def default_lenpen(ckpt, path='checkpoint'):
    """The model's own length penalty: the one its training config validated with (bleu_lenpen)."""
    alpha = 0.6
    config = ckpt.get('config')
    if isinstance(config, dict):
        alpha = config.get('bleu_lenpen', 0.6)
    if type(alpha) not in (int, float) or not 0 <= alpha < math.inf:
        fail(f"{path}: its config's bleu_lenpen {alpha!r} is not a number of at least 0")
    return alpha


def load_checkpoint(path, device='cpu', state_dict=None):
    """-> (model in eval mode on device, tiktoken Encoding, checkpoint dict). state_dict replaces
    the checkpoint's weights (averaging)."""
    ckpt = read_checkpoint(path)
    try:
        cfg = M.Config(**ckpt['model_cfg'])
        # With d_head set any h will do: h * d_k need not be d_model.
        if cfg.d_model % cfg.n_heads and not cfg.d_head:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}")
        enc = dataset.load_tokenizer(checkpoint_tokenizer(path, ckpt))
        model = M.Transformer(cfg)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        reason = ' '.join(str(e).split())[:200]
        fail(f"{path}: its model_cfg, tokenizer and weights do not fit "
             f"({type(e).__name__}: {reason})")
    if state_dict is None:
        state_dict = ckpt['model']
    load_weights(model, state_dict, path)
    trained_under = ckpt.get('code', {}).get('model.py')
    if trained_under is not None and trained_under != code_digests().get('model.py'):
        warn(f"model.py has changed since the run that trained {path} began: it computes with "
             f"the new code")
    check_tokenizer(path, cfg, enc)
    default_lenpen(ckpt, path)
    return model.to(device).eval(), enc, ckpt


def newest_checkpoints(path, n):
    """--average-last: the newest n ckpt_STEP.pt of --ckpt's folder (or of --ckpt, a folder)."""
    if n < 1:
        fail(f"--average-last {n}: must be at least 1")
    if not os.path.exists(path):
        fail(f"checkpoint {path} not found")
    if os.path.isdir(path):
        folder = path
    else:
        folder = os.path.dirname(path) or '.'
    found = checkpoints(folder)
    if not found:
        fail(f"no ckpt_STEP.pt checkpoints in {folder} to average")
    if len(found) < n:
        warn(f"--average-last {n}: only {len(found)} checkpoint(s) in {folder}")
    return found[-n:]
