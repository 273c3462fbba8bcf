"""
Translate with a trained checkpoint: batched beam search (or greedy) over a file or stdin, results in
input order, optionally scored against a reference with sacreBLEU, chrF and the paper's tokenised BLEU.

    python translate.py --ckpt out/wmt_base/ckpt.pt < newstest2014.en > hyp.de
    python translate.py --ckpt out/wmt_base --average-last 5 --input test.en --output hyp.de --ref test.de --paper-bleu
    python translate.py --ckpt out/wmt_base/ckpt.pt        # on a terminal: translates each line as it is typed

Also the library train.py uses: load_checkpoint, average_checkpoints, save_atomic, translate_lines, bleu.
"""
import argparse
import ctypes
import glob
import json
import math
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

import data_prep
import model as M


def fail(msg):  # named after the running script: train.py and export_ct2.py import these too
    raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {msg}")


def warn(msg):
    print(f"{os.path.basename(sys.argv[0])}: warning: {msg}", file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# checkpoints

def temporary(path):
    """A new, empty file beside path, for writing it under another name and renaming it into place when
    complete. Its name is unique: two runs writing one file never touch each other's, nor a user's NAME.tmp."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + '.', suffix='.tmp', dir=os.path.dirname(path) or '.')
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private (0600); the renamed file is read as any other
    return tmp


def save_atomic(obj, path):
    # Write then rename: a crash or a full disk mid-save never leaves a truncated file under the real name.
    # fsync before the rename, or a power cut can leave the new name pointing at unwritten blocks.
    tmp = temporary(path)
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def is_stream(path):
    # /dev/stdout, /dev/fd/N (a pipe, or a file the shell opened), a device, a FIFO: appended to as they are, never
    # replaced: resolved, /dev/stdout of `>> log` is log itself, which a rename would overwrite. A file that
    # happens to live under /dev (/dev/shm) is a file.
    p = os.path.abspath(path)
    return (p in ('/dev/stdout', '/dev/stderr') or p.startswith(('/dev/fd/', '/proc/'))
            or os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p))


def output_path(flag, path, others):
    """The file an output flag writes, checked before any work: a symlink's target (the link stays), never a
    folder or another of the run's files (others: (flag, path) pairs), and in a folder where a temporary file
    can be made. A stream (is_stream) is returned as it is, for --output only."""
    def never_an_input(real):
        for other, q in others:
            if q and (os.path.realpath(q) == real or os.path.isfile(real) and os.path.exists(q) and os.path.samefile(q, real)):
                fail(f"{flag} {path} is also {other} {q}, which it would overwrite")
    if is_stream(path):
        if flag != '--output':
            fail(f"{flag} {path}: a checkpoint is written to a file")
        if not os.path.exists(path):  # /dev/fd/N of a descriptor nobody opened: not opened here (a FIFO would block)
            fail(f"{flag} {path}: No such file or directory")
        never_an_input(path)  # a stream may be a file the shell opened: `< my.en`, `>> my.en`
        return path
    real = os.path.realpath(path)
    if os.path.isdir(real):
        fail(f"{flag} {path} is a folder")
    never_an_input(real)
    try:  # what is left is a file, or none yet: a temporary one must be possible beside it
        os.remove(temporary(real))
    except OSError as e:
        fail(f"{flag} {path}: {e.strerror}")
    return real


def read_checkpoint(path, keys=('model', 'model_cfg', 'tokenizer')):
    if is_ct2_export(path):  # not a folder of checkpoints, as the message below would have it
        fail(f"{path} is a CTranslate2 export (export_ct2.py), not a checkpoint: give the checkpoint it was made from")
    if os.path.isdir(path):
        fail(f"{path} is a folder: give a checkpoint file in it, or --average-last N to average its newest ckpt_STEP.pt")
    if not os.path.isfile(path):
        fail(f"checkpoint {path} not found")
    try:  # weights_only: our checkpoints hold only tensors and plain containers, and loading runs no code
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        # Not torch's advice for such files, to load them with weights_only=False: that runs their code.
        detail = str(e).split('WeightsUnpickler error:')[-1].split('Check the documentation')[0].strip()
        fail(f"cannot read checkpoint {path}: not a checkpoint, or a damaged one "
             f"({type(e).__name__}: {(detail.splitlines() or [''])[0]})")
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        fail(f"{path} is not a model checkpoint: missing {', '.join(missing)}")
    return ckpt


def check_tokenizer(path, cfg, enc):
    # A model trained with another tokenizer would silently produce garbage: refuse it instead.
    if cfg.vocab_size < enc.n_vocab:
        fail(f"{path}: model vocab_size {cfg.vocab_size} is smaller than the tokenizer's {enc.n_vocab} tokens")
    for name, want in (('<pad>', cfg.pad_id), ('<s>', cfg.bos_id), ('</s>', cfg.eos_id)):
        try:
            got = enc.encode_single_token(name)
        except KeyError:
            got = None
        if got != want:
            fail(f"{path}: tokenizer's {name} id is {got} but the model's is {want}")


def fast_dtype(device_type):
    """'bfloat16' where bf16 matrix multiply is native (GPUs; CPUs with AVX512-BF16 or AMX), else
    'float32': an AVX2-only CPU emulates bf16 at hundreds of times the cost of float32 (README, Performance)."""
    if device_type == 'cuda':
        return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float32'
    native = [getattr(torch.cpu, f'_is_{isa}_supported', lambda: False)() for isa in ('avx512_bf16', 'amx_tile')]
    return 'bfloat16' if device_type == 'cpu' and any(native) else 'float32'


def default_dtype(device):
    # translate.py's default: float32 on a CPU, bf16 on a GPU that has it (before Ampere, float32).
    return fast_dtype('cuda') if device.startswith('cuda') else 'float32'


def keep_freed_memory():
    """glibc returns a freed block over 32 MB (a batch's logits, tokens x vocab floats) to the OS, so the
    next step page-faults it back in, zeroed, page by page (README, Performance). Keep freed memory in the
    process instead, as MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_ would. A no-op without glibc."""
    try:
        libc = ctypes.CDLL('libc.so.6')
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 30))


@contextmanager
def packed_weights(model, reuse=None):
    """Within it, a float32 CPU model.Transformer multiplies with weights prepacked for oneDNN (model.linear).
    The copies are set on entry and removed on exit, so the model never uses them outside it; `reuse`, a dict
    kept by the caller across calls, keeps them for the next entry, repacking a weight changed in between."""
    w = model.embed.weight if isinstance(model, M.Transformer) else None
    if not (w is not None and w.device.type == 'cpu' and w.dtype == torch.float32
            and not torch.is_autocast_enabled('cpu') and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, '_reorder_linear_weight')):  # private ops: where absent, F.linear
        yield
        return
    reuse = {} if reuse is None else reuse

    def pack(weight):  # keyed on the storage and its version counter, which every in-place change bumps
        key = (weight.data_ptr(), weight._version)
        if reuse.get(id(weight), (None,))[0] != key:
            reuse[id(weight)] = key, torch.ops.mkldnn._reorder_linear_weight(weight)
        return reuse[id(weight)][1]

    layers = [m for m in model.modules() if isinstance(m, M.Linear)]
    try:
        for m in layers:
            m.packed = pack(m.weight)
        model.packed_embed = pack(w)
        yield
    finally:
        for m in layers:
            m.packed = None
        model.packed_embed = None


def default_lenpen(ckpt):
    # The model's own length penalty: the one its training config validated with (train.py bleu_lenpen).
    config = ckpt.get('config')
    return config.get('bleu_lenpen', 0.6) if isinstance(config, dict) else 0.6  # older checkpoints: the paper's


def checkpoint_tokenizer(path, ckpt):
    """The tokenizer dict of checkpoint `path`: embedded, or read from the file or data folder it names,
    taken relative to the checkpoint where not found as is."""
    tok = ckpt['tokenizer']
    if isinstance(tok, str) and not os.path.exists(tok):
        tok = os.path.join(os.path.dirname(path), tok)
    try:
        return data_prep.read_tokenizer(tok)
    except (OSError, ValueError, TypeError) as e:  # TypeError: neither a dict nor a path
        fail(f"{path}: cannot read its tokenizer {tok}: {e}")


def load_checkpoint(path, device='cpu', state_dict=None):
    """-> (model in eval mode on device, tiktoken Encoding, checkpoint dict). The tokenizer comes from the
    checkpoint itself (embedded dict, or a path, taken relative to the checkpoint if not found as is).
    state_dict replaces the checkpoint's weights (averaging)."""
    ckpt = read_checkpoint(path)
    cfg = checkpoint_config(path, ckpt)
    alpha = default_lenpen(ckpt)
    if type(alpha) not in (int, float) or not 0 <= alpha < math.inf:  # as --lenpen would be refused
        fail(f"{path}: its config's bleu_lenpen {alpha!r} is not a number of at least 0")
    try:
        enc = data_prep.load_tokenizer(checkpoint_tokenizer(path, ckpt))
    except Exception as e:
        fail(f"{path}: cannot load its tokenizer: {type(e).__name__}: {e}")
    check_tokenizer(path, cfg, enc)
    model = load_weights(M.Transformer(cfg), path, ckpt['model'] if state_dict is None else state_dict)
    return model.to(device).eval(), enc, ckpt


def checkpoint_config(path, ckpt):  # train.py's fine-tuning reads checkpoints through these two as well
    try:
        cfg = M.Config(**ckpt['model_cfg'])
    except TypeError as e:
        fail(f"{path}: model_cfg does not fit model.Config: {e}")
    # Else a shape or index error deep in the first decoding step.
    sizes = ('vocab_size', 'n_enc_layers', 'n_dec_layers', 'd_model', 'd_ff', 'n_heads', 'max_len')
    for k in sizes:
        if type(getattr(cfg, k)) is not int or getattr(cfg, k) < 1:
            fail(f"{path}: model_cfg {k}={getattr(cfg, k)!r} is not a size of at least 1")
    for k in ('pad_id', 'bos_id', 'eos_id'):
        if type(getattr(cfg, k)) is not int or not 0 <= getattr(cfg, k) < cfg.vocab_size:
            fail(f"{path}: model_cfg {k}={getattr(cfg, k)!r} is not an id below vocab_size={cfg.vocab_size}")
    if cfg.d_model % cfg.n_heads:
        fail(f"{path}: model_cfg d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}")
    return cfg


def load_weights(model, path, state_dict):
    try:
        model.load_state_dict(state_dict)
    except (RuntimeError, TypeError, AttributeError) as e:  # TypeError: not a dict of tensors at all
        fail(f"{path}: weights do not fit its model_cfg: {' '.join(str(e).split())[:300]}")
    return model


def average_checkpoints(paths):
    """Element-wise mean of the checkpoints' model weights (section 6.1 averages the last 5 or 20).
    Sums in float64, then casts each tensor back to its own dtype; non-float tensors come from the last."""
    if not paths:
        raise ValueError("average_checkpoints: no checkpoints given")
    total, dtypes, first = None, {}, None
    for p in paths:
        ckpt = read_checkpoint(p, keys=('model',))
        sd = ckpt['model']
        if total is None:
            total, dtypes, first = {}, {k: v.dtype for k, v in sd.items()}, ckpt
        # Weights of one shape from two runs average to nonsense: same tokenizer and model config, or no mean.
        tok, tok0 = ckpt.get('tokenizer') or {}, first.get('tokenizer') or {}  # a dict, or a path (load_checkpoint)
        if tok != tok0 and not (isinstance(tok, dict) and isinstance(tok0, dict) and data_prep.same_tokenizer(tok, tok0)):
            fail(f"{p}: its tokenizer differs from that of {paths[0]}: not checkpoints of one run")
        cfg, cfg0 = ckpt.get('model_cfg') or {}, first.get('model_cfg') or {}
        diff = sorted(k for k in cfg.keys() | cfg0.keys() if cfg.get(k) != cfg0.get(k) and 'dropout' not in k)
        if diff:  # dropout is a training setting (a fine-tune may change it), the rest the architecture
            fail(f"{p}: its model config differs from that of {paths[0]} in {', '.join(diff)}")
        if ckpt is not first and sd.keys() != total.keys():
            fail(f"{p}: its parameters differ from those of {paths[0]}")
        for k, v in sd.items():
            if not v.is_floating_point():
                total[k] = v.clone()
            elif k not in total:
                total[k] = v.double()
            elif v.shape != total[k].shape:
                fail(f"{p}: {k} has shape {tuple(v.shape)}, {paths[0]} has {tuple(total[k].shape)}")
            else:
                total[k] += v.double()
    return {k: (v / len(paths)).to(dtypes[k]) if v.is_floating_point() else v for k, v in total.items()}


def checkpoints(folder, prefix='ckpt'):
    """{prefix}_{step}.pt in folder, oldest first by step number (not by name): train.py writes ckpt_STEP.pt
    weight snapshots and state_STEP.pt full training states; ckpt.pt and ckpt_best.pt are not among them."""
    found = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(glob.escape(folder), f'{prefix}_*.pt'))
                   if (m := re.fullmatch(rf'{prefix}_(\d+)\.pt', os.path.basename(p))))
    return [p for _, p in found]


def run_folder(path):  # where --average-last looks: --ckpt's folder, or --ckpt itself
    return path if os.path.isdir(path) else os.path.dirname(path) or '.'


def newest_checkpoints(path, n):
    if n < 1:  # found[-n:] would quietly take the oldest
        fail(f"--average-last {n}: must be at least 1")
    if not os.path.exists(path):  # not quietly its folder
        fail(f"checkpoint {path} not found")
    folder = run_folder(path)
    found = checkpoints(folder)
    if not found:
        fail(f"no ckpt_STEP.pt checkpoints in {folder} to average")
    if len(found) < n:
        warn(f"--average-last {n}: only {len(found)} checkpoint(s) in {folder}")
    return found[-n:]


# -----------------------------------------------------------------------------------------------
# CTranslate2 exports (written by export_ct2.py)

CT2_MARKER = 'export_ct2.json'  # our Config and provenance, next to CTranslate2's model.bin


def is_ct2_export(path):
    return os.path.isfile(os.path.join(path, CT2_MARKER))


class CT2Model:
    """An export decoded by ctranslate2.Translator, with what translate_lines needs of a model: cfg, device,
    train()/eval() (no-ops), and decode(), which returns what model.greedy_decode / beam_search return.

    The output length cap is model.py's, a * |src incl. EOS| + b per sentence, exactly: CTranslate2 has
    one max_decoding_length per call, so a batch is decoded under its longest cap and the sentences whose
    output reached their own cap (where a shorter cap could have changed it) are decoded again under it.

    Length penalty: CTranslate2 ranks finished hypotheses by log P / |Y|^alpha (src/decoding.cc,
    finalize_hypothesis_score), not GNMT's log P / ((5 + |Y|) / 6)^alpha of model.py. All its beam-size
    finished hypotheses are therefore asked for, with EOS (so |Y| counts it, as model.py's does), log P is
    recovered from the score and they are re-ranked by GNMT's penalty; scores are then model.py's. What
    still differs: CTranslate2 stops once beam-size hypotheses have finished (model.py: once no live beam
    can beat them), at the cap it ends the best continuations rather than appending EOS to live beams,
    and it bans <pad> and <s> before the softmax rather than after (a few 1e-5 in the scores)."""
    training = False

    def __init__(self, path, device='cpu', compute_type='default'):
        try:
            import ctranslate2
        except ImportError:
            fail(f"{path} is a CTranslate2 export: pip install ctranslate2")
        try:
            with open(os.path.join(path, CT2_MARKER), encoding='utf-8') as f:
                marker = json.load(f)
            self.cfg, self.lenpen = M.Config(**marker['model_cfg']), marker.get('lenpen', 0.6)
            with open(os.path.join(path, 'shared_vocabulary.json'), encoding='utf-8') as f:
                self.tokens = json.load(f)
            kind, _, index = device.partition(':')
            self.translator = ctranslate2.Translator(
                path, device=kind, device_index=int(index or 0), compute_type=compute_type,
                intra_threads=torch.get_num_threads() if kind == 'cpu' else 0)  # OMP_NUM_THREADS, as torch
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            fail(f"cannot load CTranslate2 export {path}: {type(e).__name__}: {(str(e).strip() + ' ').splitlines()[0]}")
        self.path, self.device, self.ids = path, torch.device('cpu'), {t: i for i, t in enumerate(self.tokens)}
        self.compute_type = self.translator.compute_type

    @staticmethod
    def default_device():
        try:
            import ctranslate2
        except ImportError:
            return 'cpu'  # the constructor then says what to install
        return 'cuda' if ctranslate2.get_cuda_device_count() else 'cpu'

    def train(self, mode=True):  # translate_lines' switch to eval mode and back is for torch models
        return self

    def eval(self):
        return self

    def decode(self, src, beam, alpha, max_len_a, max_len_b, nbest):
        cfg = self.cfg
        limit = M.max_lengths(self, src, max_len_a, max_len_b).tolist()
        # The export appends EOS itself (add_source_eos, as CTranslate2's fairseq converter sets it).
        rows = [[self.tokens[t] for t in row if t != cfg.pad_id][:-1] for row in src.tolist()]
        out = [None] * len(rows)
        todo = [i for i in range(len(rows)) if limit[i] > 1]
        short = [i for i in range(len(rows)) if limit[i] <= 1]  # a cap of 1 leaves room for EOS alone: score it
        for i, s in zip(short, self.translator.score_batch([rows[i] for i in short], [[]] * len(short),
                                                           max_input_length=0) if short else []):
            out[i] = [([], sum(s.log_probs) / (M.length_penalty(1, alpha) if beam > 1 else 1))]
        if beam == 1 or alpha != 0:
            groups = [todo]
        else:  # without a penalty CTranslate2 stops early, and when it stopped cannot be told: cap by cap
            groups = [[i for i in todo if limit[i] == n] for n in sorted({limit[i] for i in todo})]
        while groups:
            group = groups.pop()
            if not group:
                continue
            steps = max(limit[i] for i in group) - 1  # model.py's cap includes the EOS it forces
            results = self.translator.translate_batch(
                [rows[i] for i in group], beam_size=beam, num_hypotheses=beam,
                length_penalty=alpha if beam > 1 else 0, max_decoding_length=steps, min_decoding_length=0,
                max_input_length=0, return_scores=True, return_end_token=True,
                suppress_sequences=[['<pad>'], ['<s>']])
            redo, finished = {}, []
            for i, r in zip(group, results):
                # Search finished on the step its longest hypothesis ended; before this sentence's own last
                # step, a shorter cap would have found the same.
                if limit[i] - 1 < steps and max(map(len, r.hypotheses)) >= limit[i] - 1:
                    redo.setdefault(limit[i], []).append(i)
                else:
                    finished.append((i, r))
            # At the cap CTranslate2 ends a hypothesis without EOS, and its score lacks EOS's log-probability,
            # which model.py forces there and counts: those are scored again, score_batch appending EOS.
            capped = [(i, h) for i, r in finished for h in r.hypotheses if h[-1:] != ['</s>']]
            scored = self.translator.score_batch([rows[i] for i, _ in capped], [h for _, h in capped],
                                                 max_input_length=0) if capped else []
            logp = {}
            for (i, h), s in zip(capped, scored):
                logp.setdefault(i, {})[tuple(h)] = sum(s.log_probs)
            for i, r in finished:
                out[i] = self.rerank(r, beam, alpha, logp.get(i, {}))[:nbest]
            groups += redo.values()
        return out

    def rerank(self, result, beam, alpha, capped_logp):
        hyps = []
        for toks, score in zip(result.hypotheses, result.scores):
            ids = [self.ids[t] for t in toks]
            logp = capped_logp.get(tuple(toks), score * len(ids) ** alpha if beam > 1 else score)
            if ids and ids[-1] == self.cfg.eos_id:
                ids.pop()
            # |Y| counts EOS, also where the cap cut the hypothesis before it (model.py forces one there).
            hyps.append((ids, logp / M.length_penalty(len(ids) + 1, alpha) if beam > 1 else logp))
        return sorted(hyps, key=lambda h: -h[1])


def load_ct2(path, device='cpu', compute_type='default'):
    """-> (CT2Model, tiktoken Encoding) of an export_ct2.py directory."""
    model = CT2Model(path, device, compute_type)
    try:
        enc = data_prep.load_tokenizer(os.path.join(path, 'tokenizer.json'))
    except Exception as e:
        fail(f"{path}: cannot load its tokenizer: {type(e).__name__}: {e}")
    check_tokenizer(path, model.cfg, enc)
    return model, enc


# -----------------------------------------------------------------------------------------------
# translation

def translate_lines(model, enc, lines, beam=4, alpha=0.6, max_len_a=1, max_len_b=50, max_tokens=4096,
                    nbest=1, greedy=False, dtype=None, first_line=1, stats=None, early_stop=False):
    """Yields one result per line of `lines`, in input order, each as soon as it and all lines before
    it are decoded: the hypothesis string, or with nbest > 1 a list of (score, string), best first.
    Sources are length-sorted and batched so that a batch holds at most max_tokens (padded) source
    tokens. dtype: autocast to it (torch.float32: none); None leaves the caller's autocast as it is.
    Empty lines give ''. Over-long lines are truncated with a warning naming line first_line + i.
    stats, a dict, gets 'sentences', 'src_tokens' and 'tgt_tokens' (best hypotheses) added to it."""
    if nbest > (1 if greedy else beam):
        raise ValueError(f"nbest {nbest} needs a beam at least that wide")
    cfg = model.cfg
    device = model.device if isinstance(model, CT2Model) else next(model.parameters()).device
    # Source tokens + EOS fill at most the positional table. The output cap a * |src| + b is lowered to the
    # table where it must be (model.max_lengths), as fairseq does, rather than cutting the source to leave
    # room for it; a translation that reaches the lowered cap is named below.
    limit = cfg.max_len - 1
    lines, srcs = list(lines), {}
    for i, line in enumerate(lines):
        if line.strip():
            # encode_ordinary: text that happens to spell '</s>' is words, not a control token.
            toks = enc.encode_ordinary(line.strip())
            if len(toks) > limit:
                warn(f"line {first_line + i}: {len(toks)} tokens, truncated to the model's limit of {limit}")
                toks = toks[:limit]
            srcs[i] = toks + [cfg.eos_id]
    # Longest first: padding stays small, and a batch too large for memory fails at once, not at the end.
    ids = list(srcs)
    sizes = np.array([len(srcs[i]) for i in ids], dtype=np.int64)
    batches = [[ids[j] for j in b] for b in data_prep.token_batches(sizes, np.argsort(-sizes, kind='stable'), max_tokens)]
    autocast = (nullcontext() if dtype is None else
                torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32))
    if stats is not None:
        for k in ('sentences', 'src_tokens', 'tgt_tokens'):
            stats.setdefault(k, 0)
        stats['sentences'] += len(lines)
        stats['src_tokens'] += sum(map(len, srcs.values()))
    done, nxt, was_training, packs = {}, 0, model.training, {}  # packs: packed_weights' copies, kept across batches
    model.eval()
    try:
        for batch in [[]] + batches:  # the empty first batch emits any leading empty lines at once
            if batch:
                S = len(srcs[batch[0]])
                src = torch.tensor([srcs[i] + [cfg.pad_id] * (S - len(srcs[i])) for i in batch], device=device)
                # no_grad, autocast and packed weights only around the work: a generator must not leak them
                # to the caller (who may train the model between two lines).
                with torch.no_grad(), autocast, packed_weights(model, packs):
                    if isinstance(model, CT2Model):
                        out = model.decode(src, 1 if greedy else beam, alpha, max_len_a, max_len_b, nbest)
                    elif greedy:
                        out = M.greedy_decode(model, src, max_len_a, max_len_b)
                    else:
                        out = M.beam_search(model, src, beam, alpha, max_len_a, max_len_b, nbest, early_stop)
                for i, hyps in zip(batch, out):
                    cap = int(max_len_a * len(srcs[i]) + max_len_b)
                    if cap > cfg.max_len - 1 and len(hyps[0][0]) >= cfg.max_len - 2:
                        warn(f"line {first_line + i}: translation stopped at the model's limit of {cfg.max_len - 2} "
                             f"tokens (max_len {cfg.max_len}), below a * |src| + b = {cap}")
                done.update(zip(batch, out))
            while nxt < len(lines) and (nxt in done or nxt not in srcs):
                hyps = done.pop(nxt, [([], 0.0)])
                if stats is not None:
                    stats['tgt_tokens'] += len(hyps[0][0])
                # Ids past the tokenizer's (a vocabulary padded for speed) have no text.
                # A hypothesis holding a line break would shift every later line of the output.
                texts = [data_prep.LINE_BREAKS.sub(' ', enc.decode([t for t in toks if t < enc.n_vocab]))
                         for toks, _ in hyps]
                yield texts[0] if nbest == 1 else [(s, t) for t, (_, s) in zip(texts, hyps)]
                nxt += 1
    finally:
        model.train(was_training)


# -----------------------------------------------------------------------------------------------
# scoring

def bleu(hyps, refs):
    """Corpus sacreBLEU (13a tokenisation, mixed case): the comparable, signed number. -> BLEUScore."""
    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    return BLEU().corpus_score(hyps, [refs])


def split_compounds(text, tokenize=Tokenizer13a()):
    return re.sub(r'(\S)-(\S)', r'\1 ##AT##-##AT## \2', tokenize(text))


def paper_bleu(hyps, refs):
    """Tokenised BLEU with compound splitting, as the paper's WMT14 en-de numbers (and GNMT's,
    ConvS2S's) are computed by tensor2tensor's get_ende_bleu.sh: Moses tokenizer.perl -l de on
    hypothesis and reference, then perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g', then multi-bleu.perl.
    Here, without Moses: sacreBLEU's 13a tokenizer (mteval-v13a; like Moses without -a it splits
    punctuation but leaves hyphens between letters), the same regex on both sides, then sacreBLEU
    with tokenize='none' (split at whitespace, case-sensitive, like multi-bleu.perl). It can differ
    from the perl pipeline in small details (apostrophes, hyphens after digits, HTML escaping).
    It is usually higher than sacreBLEU (13a too, but no splitting) by about a point on WMT14 en-de:
    to sacreBLEU 'Software-Update' is one token, matched whole or not at all; split, it is three,
    so a half-right compound ('Software-Paket') still earns n-gram matches, and every hyphen in a
    compound becomes a '##AT##-##AT##' token that matches whenever the reference has one too."""
    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    return BLEU(tokenize='none', force=True).corpus_score(
        [split_compounds(h) for h in hyps], [[split_compounds(r) for r in refs]])


# -----------------------------------------------------------------------------------------------
# command line

def write_translations(args, model, enc, lines, out, opts, interactive):
    """-> None for an interactive session; else stats (translate_lines'), the best hypotheses, seconds."""

    def write(result):
        if args.nbest == 1:
            out.write(result + '\n')
            return result
        result += [(float('-inf'), '')] * (args.nbest - len(result))  # always exactly N lines per input
        out.write(''.join(f"{s:.4f}\t{t}\n" for s, t in result))
        return result[0][1]

    if interactive:  # one line at a time, as typed
        print(f"translate.py: {args.ckpt} loaded; type a sentence, Ctrl-D to quit", file=sys.stderr)
        try:
            for n, line in enumerate(data_prep.read_lines(None, errors='replace'), 1):
                write(list(translate_lines(model, enc, [line], first_line=n, **opts))[0])
                out.flush()
        except KeyboardInterrupt:
            pass
        return None
    stats, hyps, t0 = {}, [], time.time()
    for result in translate_lines(model, enc, lines, stats=stats, **opts):
        hyps.append(write(result))
        out.flush()  # streaming: each line is visible as soon as it and those before it are done
    return stats, hyps, max(time.time() - t0, 1e-9)


def main(argv=None):
    p = argparse.ArgumentParser(description="Translate a file or stdin with a trained checkpoint.")
    p.add_argument('--ckpt', required=True,
                   help="checkpoint file (with --average-last, a file or folder), or an export_ct2.py directory")
    p.add_argument('--input', help="source text, one sentence per line (default: stdin)")
    p.add_argument('--output', help="where the translations go (default: stdout)")
    p.add_argument('--beam', type=int, default=4, help="beam size (the paper: 4)")
    # Same names as fairseq's flags, other meanings: said here and in the README.
    p.add_argument('--lenpen', type=float, help="GNMT's length penalty alpha, score = log P / ((5 + |Y|) / 6)^alpha, "
                   "not fairseq's log P / |Y|^lenpen (default: the model's own, its training config's bleu_lenpen, "
                   "which config/multi30k.py tunes on the validation set; else the paper's 0.6)")
    p.add_argument('--max-len-a', type=float, default=1.0, help="at most a * (source tokens + EOS) + b output "
                   "tokens, EOS included (default 1 and 50: the paper's input + 50; fairseq's are 0 and 200)")
    p.add_argument('--max-len-b', type=int, default=50)
    p.add_argument('--greedy', action='store_true', help="greedy decoding instead of beam search")
    p.add_argument('--nbest', type=int, default=1, help="N lines 'score<TAB>hypothesis' per input line")
    p.add_argument('--early-stop', action='store_true', help="end a sentence's beam search once `beam` hypotheses "
                   "have finished, as fairseq and CTranslate2 do: faster, not exact (README, Serving)")
    p.add_argument('--max-tokens', type=int, default=4096, help="padded source tokens per batch: sentences x the "
                   "longest source incl. EOS (fairseq counts target tokens too); beam search decodes beam x as many")
    p.add_argument('--average-last', type=int, default=0, help="average the newest N ckpt_STEP.pt first")
    p.add_argument('--save-average', help="write the averaged checkpoint here")
    p.add_argument('--device', help="cpu, cuda or cuda:N (default: cuda where there is one)")
    p.add_argument('--compile', action='store_true', help="torch.compile the decoder with its weights frozen: "
                   "a long first batch (about 75 s on 2 CPU cores), then 1.0-1.1x eager there (README, Serving)")
    p.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'],
                   help="autocast dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument('--ct2-compute-type', default='default',
                   help="a CTranslate2 export's compute type (default: its quantization, where the device has it)")
    p.add_argument('--ref', help="reference translations: print sacreBLEU and chrF to stderr")
    p.add_argument('--paper-bleu', action='store_true', help="also the paper's tokenised, compound-split BLEU")
    args = p.parse_args(argv)
    if args.beam < 1 or args.max_tokens < 1 or not 1 <= args.nbest <= (1 if args.greedy else args.beam):
        p.error("need beam >= 1, max-tokens >= 1 and 1 <= nbest <= beam (1 with --greedy)")
    for flag, value in (('--max-len-a', args.max_len_a), ('--lenpen', args.lenpen)):
        if value is not None and not math.isfinite(value):
            p.error(f"{flag} must be a finite number, got {value}")
    if args.lenpen is not None and args.lenpen < 0:
        p.error("--lenpen must be at least 0")
    if args.max_len_a < 0 or args.max_len_b < 0:
        p.error("--max-len-a and --max-len-b must be at least 0 (the output may have a * source tokens + b)")
    if args.paper_bleu and not args.ref:
        p.error("--paper-bleu needs --ref")
    if args.save_average and not args.average_last:
        p.error("--save-average needs --average-last")
    ct2 = is_ct2_export(args.ckpt)
    if ct2 and (args.average_last or args.dtype or args.compile):
        p.error("--average-last, --dtype and --compile are for checkpoints: export the average; see --ct2-compute-type")
    if not ct2 and args.ct2_compute_type != 'default':
        p.error("--ct2-compute-type is for a CTranslate2 export (export_ct2.py)")
    args.device = args.device or (CT2Model.default_device() if ct2 else
                                  'cuda' if torch.cuda.is_available() else 'cpu')
    try:
        device_type = torch.device(args.device).type
    except RuntimeError:
        device_type = None
    if device_type not in ('cpu', 'cuda'):
        p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.device == 'cpu':
        keep_freed_memory()
    if args.device.startswith('cuda') and not ct2 and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no GPU available")
    if args.input is None and sys.stdin is None:
        p.error("no --input, and standard input is closed")
    if args.output is None and sys.stdout is None:
        p.error("no --output, and standard output is closed")
    interactive = args.input is None and sys.stdin.isatty()
    if interactive and args.ref:
        p.error("--ref scores a whole --input (or piped text), not sentences typed one at a time")
    # Before the model loads: an output that cannot be written fails at once.
    # What --ckpt reads besides itself: an export's files, or every checkpoint --average-last may average.
    ckpts = [args.ckpt, *([os.path.join(args.ckpt, f) for f in os.listdir(args.ckpt)] if ct2 else
                          checkpoints(run_folder(args.ckpt)) if args.average_last else [])]
    # Standard input resolves to the file the shell opened for `< my.en`, which --output my.en would replace.
    inputs = [('--input', args.input) if args.input else ('standard input', '/dev/stdin'), ('--ref', args.ref),
              *(('--ckpt', q) for q in ckpts if os.path.isfile(q))]
    if args.output:
        args.output = output_path('--output', args.output, inputs)
    if args.save_average:
        args.save_average = output_path('--save-average', args.save_average, [*inputs, ('--output', args.output)])
    lines = None if interactive else list(data_prep.read_lines(args.input, errors='replace'))
    refs = list(data_prep.read_lines(args.ref, errors='replace')) if args.ref else None
    if refs is not None and lines is not None and len(refs) != len(lines):
        fail(f"{args.ref} has {len(refs)} lines but {args.input or '<stdin>'} has {len(lines)}")

    if ct2:
        model, enc = load_ct2(args.ckpt, args.device, args.ct2_compute_type)
    elif args.average_last:
        paths = newest_checkpoints(args.ckpt, args.average_last)
        warn(f"averaging {len(paths)} checkpoint(s): {', '.join(os.path.basename(q) for q in paths)}")
        model, enc, ckpt = load_checkpoint(paths[-1], args.device, average_checkpoints(paths))
        if args.save_average:
            keep = ('model_cfg', 'step', 'config', 'data_dir')
            # The tokenizer embedded: a path the checkpoints name may not resolve from the average's folder.
            save_atomic({'model': model.state_dict(), **{k: ckpt[k] for k in keep if k in ckpt},
                         'tokenizer': checkpoint_tokenizer(paths[-1], ckpt),
                         'averaged': [os.path.basename(q) for q in paths]}, args.save_average)
    else:
        model, enc, ckpt = load_checkpoint(args.ckpt, args.device)
    if args.compile:
        import torch._inductor.config as inductor
        # Frozen weights are constants to inductor, which on a CPU prepacks them for oneDNN itself (eager
        # decoding does the same through packed_weights) and fuses the small operations.
        inductor.freezing = True
        model.decode = torch.compile(model.decode, dynamic=True)
    if args.lenpen is None:
        args.lenpen = model.lenpen if ct2 else default_lenpen(ckpt)
    dtype = None if ct2 else getattr(torch, args.dtype or default_dtype(args.device))
    opts = dict(beam=args.beam, alpha=args.lenpen, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                max_tokens=args.max_tokens, nbest=args.nbest, greedy=args.greedy, dtype=dtype,
                early_stop=args.early_stop)
    tmp = None
    if args.output:  # a temporary name until complete: a stopped run leaves no finished-looking file
        tmp = None if is_stream(args.output) else temporary(args.output)
        out = open(tmp or args.output, 'w' if tmp else 'a', encoding='utf-8', newline='\n')
    else:
        sys.stdout.reconfigure(encoding='utf-8', newline='\n')
        out = sys.stdout
    try:
        done = write_translations(args, model, enc, lines, out, opts, interactive)
        if out is not sys.stdout:
            out.close()
            if tmp:
                os.replace(tmp, args.output)
    except BrokenPipeError:
        raise
    except OSError as e:  # a full disk, a device that went away
        if out is sys.stdout:  # nothing more to flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        fail(f"{args.output or 'standard output'}: {e.strerror}")
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
    if done is None:
        return
    stats, hyps, dt = done
    print(f"translate.py: {stats['sentences']} sentences in {dt:.1f}s: {stats['sentences'] / dt:.1f} "
          f"sentences/s, {stats['tgt_tokens'] / dt:.0f} target tokens/s ({args.device}, "
          f"{f'CTranslate2 {model.compute_type}' if ct2 else dtype}, "
          f"{'greedy' if args.greedy else f'beam {args.beam}, lenpen {args.lenpen:g}'}"
          f"{', early stop' if args.early_stop and not args.greedy else ''})", file=sys.stderr)
    if refs is not None and not hyps:
        warn(f"{args.input or '<stdin>'} is empty: nothing to score")
    elif refs is not None:
        for name, metric in (('sacreBLEU', BLEU()), ('chrF', CHRF())):
            print(f"{name}: {metric.corpus_score(hyps, [refs])}  ({metric.get_signature()})", file=sys.stderr)
        if args.paper_bleu:
            print(f"paper BLEU (13a-tokenised, ##AT##-##AT## compounds): {paper_bleu(hyps, refs)}", file=sys.stderr)


if __name__ == '__main__':
    try:
        main()
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        sys.exit(1)
    except KeyboardInterrupt:  # the output file, if any, is left as it was
        sys.exit("translate.py: interrupted")
