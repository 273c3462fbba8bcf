"""
Checkpoints and run folders: atomic files and folder locks, reading, listing and averaging checkpoints,
loading a model for translation, and the tokenizer check that keeps a model with its own token ids.
"""
import contextlib
import glob
import json
import math
import os
import re
import sys
import tempfile

import torch

import dataset
import model as M


def make_writable(folder, option):
    """Create folder if need be and check that it takes files: else a one-line error naming the option."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # a name of its own: two runs may check one folder at once
    except OSError as e:
        sys.exit(f'error: {option} {folder} cannot be created or written: {e.strerror}')


def temporary(path):
    """A new, empty file beside path with a name of its own (PATH.RANDOM.tmp), to be renamed to path."""
    tmp = f'{path}.{os.urandom(4).hex()}.tmp'
    open(tmp, 'xb').close()  # 'x': never another's; and as readable as the umask allows, as path will be
    return tmp


@contextlib.contextmanager
def atomic(path):
    """A file to write path through: fsynced and renamed to path when the block ends, removed if it fails;
    so a crash or a full disk never leaves a truncated file as path."""
    tmp = temporary(path)
    try:
        with open(tmp, 'wb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # before the rename, or a power cut can leave path on unwritten blocks
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def save_atomic(obj, path):
    with atomic(path) as f:
        torch.save(obj, f)


def write_json(path, obj):
    with atomic(path) as f:
        f.write(json.dumps(obj, ensure_ascii=False, indent=1).encode('utf-8'))


def lock_folder(folder, busy=None):
    """flock folder till the fd returned closes or the process ends; held: print busy and wait, or raise."""
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


def locked(folder, doing):
    """Keep other data_prep.py runs, which would delete or rename our temporary files, out of folder."""
    stack = contextlib.ExitStack()
    stack.callback(os.close, lock_folder(folder, f'another data_prep.py is {doing} {folder}: waiting for it'))
    return stack


def fail(msg):  # named after the running script: every script reads checkpoints through these
    raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {msg}")


def read_checkpoint(path, keys=('model', 'model_cfg', 'tokenizer')):
    if not os.path.isfile(path):
        fail(f"{path} is a folder: give a checkpoint file in it, or --average-last N to average its newest "
             "ckpt_STEP.pt" if os.path.isdir(path) else f"checkpoint {path} not found")
    try:  # weights_only: our checkpoints hold only tensors and plain containers, and loading runs no code
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        fail(f"cannot read checkpoint {path}: not a checkpoint, or a damaged one ({type(e).__name__})")
    if missing := [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]:
        fail(f"{path} is not a model checkpoint: missing {', '.join(missing)}")
    return ckpt


def checkpoint_tokenizer(path, ckpt):
    """The tokenizer dict of a checkpoint: embedded, or the file or data folder it names (maybe relative)."""
    tok = ckpt['tokenizer']
    if isinstance(tok, str) and not os.path.exists(tok):
        tok = os.path.join(os.path.dirname(path), tok)
    try:
        return dataset.read_tokenizer(tok)
    except (OSError, ValueError, TypeError) as e:
        fail(f"{path}: cannot read its tokenizer {tok}: {e}")


def checkpoints(folder, prefix='ckpt'):
    """{prefix}_STEP.pt in folder by step: train.py's weight snapshots (ckpt) or training states (state)."""
    found = sorted((int(m[1]), p) for p in glob.glob(os.path.join(glob.escape(folder), f'{prefix}_*.pt'))
                   if (m := re.fullmatch(rf'{prefix}_(\d+)\.pt', os.path.basename(p))))
    return [p for _, p in found]


def average_checkpoints(paths):
    """Section 6.1: the checkpoints' mean weights (in float64), refused for checkpoints of different runs."""
    total, first = {}, None
    for p in paths:
        ckpt = read_checkpoint(p, keys=('model',))
        first = first or ckpt
        if ckpt.get('tokenizer') != first.get('tokenizer'):
            fail(f"{p}: its tokenizer differs from that of {paths[0]}: not checkpoints of one run")
        cfg, cfg0 = ckpt.get('model_cfg') or {}, first.get('model_cfg') or {}  # older ones lack newer fields
        diff = sorted(k for k in cfg.keys() & cfg0.keys() if cfg[k] != cfg0[k] and 'dropout' not in k)
        if diff or ckpt['model'].keys() != first['model'].keys():  # dropout: a training setting
            fail(f"{p}: its model differs from that of {paths[0]} ({', '.join(diff) or 'parameters'})")
        for k, v in ckpt['model'].items():
            total[k] = total[k] + v.double() if k in total else v.double()
    return {k: (v / len(paths)).to(first['model'][k].dtype) for k, v in total.items()}


def warn(msg):
    print(f"{os.path.basename(sys.argv[0])}: warning: {msg}", file=sys.stderr)


def check_tokenizer(path, cfg, enc):
    # A model trained with another tokenizer would silently produce garbage: refuse it instead.
    if cfg.vocab_size < enc.n_vocab:
        fail(f"{path}: model vocab_size {cfg.vocab_size} is below the tokenizer's {enc.n_vocab} tokens")
    for name, want in (('<pad>', cfg.pad_id), ('<s>', cfg.bos_id), ('</s>', cfg.eos_id)):
        if enc.encode(name, allowed_special='all') != [want]:
            fail(f"{path}: the tokenizer's {name} is not the model's id {want}")
    cfg.tokenizer_size = enc.n_vocab  # decoding never generates the ids past it (a checkpoint may not say)


def default_lenpen(ckpt, path='checkpoint'):
    # The model's own length penalty: the one its training config validated with (train.py bleu_lenpen).
    config = ckpt.get('config')
    alpha = config.get('bleu_lenpen', 0.6) if isinstance(config, dict) else 0.6
    if type(alpha) not in (int, float) or not 0 <= alpha < math.inf:
        fail(f"{path}: its config's bleu_lenpen {alpha!r} is not a number of at least 0")
    return alpha


def load_checkpoint(path, device='cpu', state_dict=None):
    """-> (model in eval mode on device, tiktoken Encoding, checkpoint dict). state_dict replaces the
    checkpoint's weights (averaging)."""
    ckpt = read_checkpoint(path)
    try:
        cfg = M.Config(**ckpt['model_cfg'])
        if cfg.d_model % cfg.n_heads and not cfg.d_head:  # d_head: any h, h * d_k need not be d_model
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}")
        enc = dataset.load_tokenizer(checkpoint_tokenizer(path, ckpt))
        model = M.Transformer(cfg)
        model.load_state_dict(ckpt['model'] if state_dict is None else state_dict)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        fail(f"{path}: its model_cfg, tokenizer and weights do not fit ({type(e).__name__}: "
             f"{' '.join(str(e).split())[:200]})")
    check_tokenizer(path, cfg, enc)
    default_lenpen(ckpt, path)
    return model.to(device).eval(), enc, ckpt


def newest_checkpoints(path, n):
    """--average-last: the newest n ckpt_STEP.pt of --ckpt's folder (or of --ckpt, a folder)."""
    if n < 1:
        fail(f"--average-last {n}: must be at least 1")
    if not os.path.exists(path):
        fail(f"checkpoint {path} not found")
    folder = path if os.path.isdir(path) else os.path.dirname(path) or '.'
    found = checkpoints(folder)
    if not found:
        fail(f"no ckpt_STEP.pt checkpoints in {folder} to average")
    if len(found) < n:
        warn(f"--average-last {n}: only {len(found)} checkpoint(s) in {folder}")
    return found[-n:]
