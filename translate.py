"""
Translate with a trained checkpoint: batched beam search (or greedy) over a file or stdin, results
in input order, optionally scored against a reference with sacreBLEU, chrF and the paper's tokenised
BLEU.

    python translate.py --ckpt out/wmt_base/ckpt.pt < newstest2014.en > hyp.de
    python translate.py --ckpt out/wmt_base --average-last 5 --input test.en --ref test.de
    python translate.py --ckpt out/wmt_base/ckpt.pt         # at a terminal: lines as typed
    python translate.py --ckpt out/multi30k_en_de/ct2 ...   # an export_ct2.py export

Checkpoints are read and averaged by checkpoint.py; an export is served by export_ct2.CT2Model.
"""
import argparse
import math
import os
import re
import shutil
import sys
import time
from contextlib import nullcontext, suppress

import torch
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

import checkpoint
import data_prep
import export_ct2
import decode
import speed
from checkpoint import fail

# -----------------------------------------------------------------------------------------------
# translation

def encode_sources(enc, cfg, lines, first_line):
    """{line index: source ids + EOS} of the non-empty lines, an over-long one truncated with a
    warning: source + EOS fill at most the positional table."""
    limit = cfg.max_len - 1
    srcs = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        toks = enc.encode_ordinary(line.strip())  # ordinary: text spelling '</s>' is words, not EOS
        if len(toks) > limit:
            checkpoint.warn(f"line {first_line + i}: {len(toks)} tokens, "
                            f"truncated to the model's limit of {limit}")
            toks = toks[:limit]
        srcs[i] = toks + [cfg.eos_id]
    return srcs


def warn_at_limit(cfg, srcs, batch, out, max_len_a, max_len_b, first_line):
    # The output cap a * |src| + b is lowered to the positional table where it must be
    # (decode.max_lengths), as fairseq does; a translation that reaches the table is named.
    for i, hyps in zip(batch, out):
        cap = int(max_len_a * len(srcs[i]) + max_len_b)
        if cap > cfg.max_len - 1 and len(hyps[0][0]) >= cfg.max_len - 2:
            checkpoint.warn(f"line {first_line + i}: translation stopped at the model's limit of "
                            f"{cfg.max_len - 2} tokens (max_len {cfg.max_len}), "
                            f"below a * |src| + b = {cap}")


def texts_of(enc, hyps):
    # Ids past the tokenizer's (a vocabulary padded for speed) have no text; a line break in a
    # hypothesis would shift every later line of the output.
    texts = []
    for toks, _ in hyps:
        text = enc.decode([t for t in toks if t < enc.n_vocab])
        texts.append(data_prep.LINE_BREAKS.sub(' ', text))
    return texts


def translate_lines(model, enc, lines, beam=4, alpha=0.6, max_len_a=1, max_len_b=50,
                    max_tokens=4096, nbest=1, greedy=False, dtype=None, first_line=1, stats=None,
                    exact=False, pack=True):
    """Yields one result per line of `lines`, in input order, each as soon as it and all lines
    before it are decoded: the hypothesis string, or with nbest > 1 a list of (score, string), best
    first. Sources are length-sorted and batched to at most max_tokens padded source tokens. dtype:
    autocast to it (None leaves the caller's as it is). Empty lines give '' (with nbest > 1,
    [(0.0, '')]); over-long ones are truncated with a warning. stats, a dict, gets 'sentences',
    'src_tokens' and 'tgt_tokens' (of the best hypotheses) added."""
    width = 1 if greedy else beam
    if nbest > width:
        raise ValueError(f"nbest {nbest} needs a beam at least that wide")
    cfg = model.cfg
    ct2 = isinstance(model, export_ct2.CT2Model)
    if ct2:
        device = model.device
    else:
        device = next(model.parameters()).device
    lines = list(lines)
    srcs = encode_sources(enc, cfg, lines, first_line)
    batches = decode.length_batches(srcs, max_tokens)
    autocast = nullcontext()
    if dtype is not None:
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if stats is not None:
        for k in ('sentences', 'src_tokens', 'tgt_tokens'):
            stats.setdefault(k, 0)
        stats['sentences'] += len(lines)
        stats['src_tokens'] += sum(map(len, srcs.values()))
    done = {}  # line index -> hypotheses, until every line before it is out
    nxt = 0  # the next line to yield
    packs = {}  # speed.packed_weights' copies, kept across batches
    was_training = model.training
    model.eval()
    try:
        for batch in [[]] + batches:  # the empty first batch emits any leading empty lines at once
            if batch:
                src = decode.padded(srcs, batch, cfg.pad_id, device)
                packing = speed.packed_weights(model, packs) if pack else nullcontext()
                # no_grad, autocast and packed weights only around the work: a generator must not
                # leak them to the caller (who may train the model between two lines).
                with torch.no_grad(), autocast, packing:
                    if ct2:
                        out = model.decode(src, width, alpha, max_len_a, max_len_b, nbest)
                    elif greedy:
                        out = decode.greedy_decode(model, src, max_len_a, max_len_b)
                    else:
                        out = decode.beam_search(model, src, beam, alpha, max_len_a, max_len_b,
                                                 nbest, exact)
                warn_at_limit(cfg, srcs, batch, out, max_len_a, max_len_b, first_line)
                done.update(zip(batch, out))
            while nxt < len(lines) and (nxt in done or nxt not in srcs):
                hyps = done.pop(nxt, [([], 0.0)])  # an empty line: no hypothesis
                if stats is not None:
                    stats['tgt_tokens'] += len(hyps[0][0])
                texts = texts_of(enc, hyps)
                if nbest == 1:
                    yield texts[0]
                else:
                    yield [(score, text) for text, (_, score) in zip(texts, hyps)]
                nxt += 1
    finally:
        model.train(was_training)


# -----------------------------------------------------------------------------------------------
# scoring

def bleu(hyps, refs):
    """Corpus sacreBLEU (13a tokenisation, mixed case): the comparable, signed number."""
    return BLEU().corpus_score(list(hyps), [list(refs)])


def split_compounds(text, tokenize=Tokenizer13a()):
    return re.sub(r'(\S)-(\S)', r'\1 ##AT##-##AT## \2', tokenize(text))


def paper_bleu(hyps, refs):
    """The paper's tokenised BLEU with compounds split, as tensor2tensor's get_ende_bleu.sh
    computes it (Moses tokenizer, then 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g', then
    multi-bleu.perl): here sacreBLEU's 13a tokenizer stands in for Moses, then the same regex, then
    BLEU on whitespace tokens. Usually about a point above sacreBLEU on WMT14 en-de, since a
    half-right compound still earns n-gram matches."""
    split_hyps = [split_compounds(h) for h in hyps]
    split_refs = [split_compounds(r) for r in refs]
    return BLEU(tokenize='none', force=True).corpus_score(split_hyps, [split_refs])


def print_scores(hyps, refs, paper):
    for name, metric in (('sacreBLEU', BLEU()), ('chrF', CHRF())):
        score = metric.corpus_score(hyps, [refs])
        print(f"{name}: {score}  ({metric.get_signature()})", file=sys.stderr)
    if paper:
        score = paper_bleu(hyps, refs)
        print(f"paper BLEU (13a-tokenised, compounds split): {score}", file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# command line

def arg_parser():
    p = argparse.ArgumentParser(description="Translate a file or stdin with a trained checkpoint.")
    p.add_argument('--ckpt', required=True, help="checkpoint file (with --average-last, a file or "
                   "folder), or an export_ct2.py folder")
    p.add_argument('--input', help="source text, one sentence per line (default: stdin)")
    p.add_argument('--output', help="where the translations go (default: stdout)")
    p.add_argument('--beam', type=int, default=4, help="beam size (the paper: 4)")
    p.add_argument('--lenpen', type=float, help="GNMT's length penalty alpha: "
                   "log P / ((5 + |Y|) / 6)^alpha, not fairseq's log P / |Y|^lenpen "
                   "(default: the model's own, its config's bleu_lenpen)")
    p.add_argument('--max-len-a', type=float, default=1.0, help="at most a * (source tokens + EOS) "
                   "+ b output tokens, EOS included (paper: 1, 50)")
    p.add_argument('--max-len-b', type=int, default=50)
    p.add_argument('--greedy', action='store_true', help="greedy decoding instead of beam search")
    p.add_argument('--nbest', type=int, default=1,
                   help="N lines 'score<TAB>hypothesis' per input line")
    p.add_argument('--exact', action='store_true', help="decode a sentence until no live beam can "
                   "beat its finished ones (slower); default: stop once `beam` hypotheses "
                   "finished, as fairseq does")
    # accepted for old commands; stopping early is the default (--exact turns it off)
    p.add_argument('--early-stop', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--max-tokens', type=int, default=4096, help="padded source tokens per batch")
    p.add_argument('--average-last', type=int, default=0,
                   help="average the newest N ckpt_STEP.pt first")
    p.add_argument('--save-average', help="write the averaged checkpoint here")
    p.add_argument('--device', help="cpu, cuda or cuda:N (default: cuda where there is one)")
    p.add_argument('--compile', action='store_true', help="torch.compile the decoder with frozen "
                   "weights: a long first batch (docs/serving.md)")
    p.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'],
                   help="autocast dtype (default: bfloat16 on a GPU that has it, else float32)")
    p.add_argument('--ct2-compute-type', default='default',
                   help="a CTranslate2 export's compute type")
    p.add_argument('--ref', help="reference translations: print sacreBLEU and chrF to stderr")
    p.add_argument('--paper-bleu', action='store_true', help="also the paper's tokenised BLEU")
    return p


def check_options(p, args):
    width = 1 if args.greedy else args.beam
    if args.beam < 1 or args.max_tokens < 1 or not 1 <= args.nbest <= width:
        p.error("need beam >= 1, max-tokens >= 1 and 1 <= nbest <= beam (1 with --greedy)")
    lenpen_ok = args.lenpen is None or 0 <= args.lenpen < math.inf
    if not lenpen_ok or not 0 <= args.max_len_a < math.inf or args.max_len_b < 0:
        p.error("--lenpen, --max-len-a and --max-len-b must be finite numbers of at least 0")
    if args.paper_bleu and not args.ref:
        p.error("--paper-bleu needs --ref")
    if args.save_average and not args.average_last:
        p.error("--save-average needs --average-last")
    if args.save_average and args.output:
        if os.path.abspath(args.save_average) == os.path.abspath(args.output):
            p.error("--save-average and --output name one file")


def check_device(p, device, ct2):
    if not re.fullmatch(r'cpu|cuda(:\d+)?', device):
        p.error(f"--device {device}: expected cpu, cuda or cuda:N")
    if device.startswith('cuda') and not ct2 and not torch.cuda.is_available():
        p.error(f"--device {device}: no GPU available")


def check_outputs(p, args):
    # Before the model loads, so that a bad output fails at once.
    inputs = [q for q in (args.input, args.ref, args.ckpt) if q and os.path.exists(q)]
    run_folder = args.ckpt if os.path.isdir(args.ckpt) else os.path.dirname(args.ckpt)
    inputs += checkpoint.checkpoints(run_folder)
    for flag in ('output', 'save_average'):
        path = getattr(args, flag)
        if not path:
            continue
        option = '--' + flag.replace('_', '-')
        # The file is written under the name without the slash, which these checks would not see.
        if path.endswith('/'):
            p.error(f"{option} {path} names a folder: give a file name")
        if not os.path.exists(path):
            continue
        if os.path.isdir(path) or any(os.path.samefile(path, q) for q in inputs):
            p.error(f"{option} {path} is a folder or an input of this run")
        if flag == 'save_average':  # a run's own ckpt.pt, say: hours of training
            p.error(f"{option} {path} exists: give a new name, or delete it first")


def save_average(model, ckpt, paths, path):
    # The tokenizer goes in whole: a path that the checkpoints name may not resolve there.
    keep = {k: ckpt[k] for k in ('model_cfg', 'step', 'config', 'data_dir', 'code') if k in ckpt}
    keep['tokenizer'] = checkpoint.checkpoint_tokenizer(paths[-1], ckpt)
    keep['averaged'] = [os.path.basename(q) for q in paths]
    checkpoint.save_atomic({'model': model.state_dict(), **keep}, path)


def load_model(args, ct2):
    """-> (model, tokenizer, checkpoint dict; None for an export), averaged if --average-last."""
    if ct2:
        model, enc = export_ct2.load_ct2(args.ckpt, args.device, args.ct2_compute_type)
        return model, enc, None
    if not args.average_last:
        if os.path.isdir(args.ckpt):
            checkpoint.fail(f"--ckpt {args.ckpt} is a folder: give a checkpoint file in it, or "
                            f"--average-last N to average its newest ckpt_STEP.pt")
        return checkpoint.load_checkpoint(args.ckpt, args.device)
    paths = checkpoint.newest_checkpoints(args.ckpt, args.average_last)
    names = ', '.join(os.path.basename(q) for q in paths)
    checkpoint.warn(f"averaging {len(paths)} checkpoint(s): {names}")
    averaged = checkpoint.average_checkpoints(paths)
    model, enc, ckpt = checkpoint.load_checkpoint(paths[-1], args.device, averaged)
    if args.save_average:
        save_average(model, ckpt, paths, args.save_average)
    return model, enc, ckpt


def autocast_dtype(args, ct2):
    if ct2:
        return None  # an export computes in its own compute type
    if args.dtype:
        return getattr(torch, args.dtype)
    if args.device.startswith('cuda'):
        return getattr(torch, speed.fast_dtype('cuda'))
    return torch.float32


def write_translations(args, model, enc, lines, out, opts):
    """-> translate_lines' stats, the best hypotheses, seconds; None when lines are typed at a
    terminal (lines is None)."""

    def write(result):
        if args.nbest == 1:
            out.write(result + '\n')
            return result
        result += [(float('-inf'), '')] * (args.nbest - len(result))  # exactly N lines per input
        out.write(''.join(f"{s:.4f}\t{t}\n" for s, t in result))
        return result[0][1]

    if lines is None:  # on a terminal: one line at a time, as typed
        print(f"translate.py: {args.ckpt} loaded; type a sentence, Ctrl-D to quit", file=sys.stderr)
        with suppress(KeyboardInterrupt):
            for n, line in enumerate(data_prep.read_lines(None, errors='replace'), 1):
                results = list(translate_lines(model, enc, [line], first_line=n, **opts))
                write(results[0])
                out.flush()
        return None
    stats = {}
    hyps = []
    t0 = time.time()
    for result in translate_lines(model, enc, lines, stats=stats, **opts):
        hyps.append(write(result))
        out.flush()  # each line is visible as soon as it and those before it are done
    return stats, hyps, max(time.time() - t0, 1e-9)


def is_device(path):
    # A device (/dev/null, /dev/stdout) or a FIFO is written as it is: a rename would replace it.
    if path.startswith(('/dev/', '/proc/')):
        return True
    return os.path.exists(path) and not os.path.isfile(path)


def write_output(args, model, enc, lines, opts):
    """write_translations to --output or stdout -> what it returns. A file has a temporary name
    until it is complete: a stopped run leaves no finished-looking file."""
    real = os.path.realpath(args.output) if args.output else None
    out = sys.stdout
    tmp = None
    try:
        if real and is_device(real):
            out = open(args.output, 'a', encoding='utf-8', newline='\n')
        elif real:
            tmp = checkpoint.temporary(real)
            out = open(tmp, 'w', encoding='utf-8', newline='\n')
        done = write_translations(args, model, enc, lines, out, opts)
        if out is not sys.stdout:
            out.close()
        if tmp:
            if os.path.exists(real):  # it keeps the permissions of the file it replaces
                shutil.copymode(real, tmp)
            os.replace(tmp, real)
    except BrokenPipeError:  # the reader left: stopped quietly below, in __main__
        raise
    except OSError as e:  # a full disk, a device that went away
        fail(f"{args.output or 'standard output'}: {e.strerror}")
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
    return done


def summary(args, stats, seconds, precision):
    n = stats['sentences']
    search = 'greedy'
    if not args.greedy:
        search = f'beam {args.beam}, lenpen {args.lenpen:g}'
    if args.exact and not args.greedy:
        search += ', exact'
    return (f"translate.py: {n} sentences in {seconds:.1f}s: {n / seconds:.1f} sentences/s, "
            f"{stats['tgt_tokens'] / seconds:.0f} target tokens/s "
            f"({args.device}, {precision}, {search})")


def main(argv=None):
    p = arg_parser()
    args = p.parse_args(argv)
    sys.stdout.reconfigure(encoding='utf-8', newline='\n')
    check_options(p, args)
    ct2 = export_ct2.is_ct2_export(args.ckpt)
    if ct2 and (args.average_last or args.dtype or args.compile or args.exact):
        p.error("--average-last, --dtype, --compile and --exact are for checkpoints: "
                "an export decodes with its own")
    if not args.device:
        args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    check_device(p, args.device, ct2)
    interactive = args.input is None and sys.stdin.isatty()
    if interactive and args.ref:
        p.error("--ref scores a whole --input (or piped text), not sentences typed one at a time")
    check_outputs(p, args)
    lines = None
    if not interactive:
        lines = list(data_prep.read_lines(args.input, errors='replace'))
    refs = None
    if args.ref:
        refs = list(data_prep.read_lines(args.ref, errors='replace'))
    if refs is not None and lines is not None and len(refs) != len(lines):
        fail(f"{args.ref} has {len(refs)} lines but {args.input or '<stdin>'} has {len(lines)}")

    if args.device == 'cpu':
        speed.keep_freed_memory()
    if args.device.startswith('cuda'):
        # cuDNN attention plans anew for each shape (docs/performance.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, enc, ckpt = load_model(args, ct2)
    if args.compile:
        # Frozen weights are constants that inductor prepacks on a CPU (as speed.packed_weights).
        import torch._inductor.config as inductor
        inductor.freezing = True
        model.decode = torch.compile(model.decode, dynamic=True)
        model.output = torch.compile(model.output)
    if args.lenpen is None:
        args.lenpen = model.lenpen if ct2 else checkpoint.default_lenpen(ckpt)
    dtype = autocast_dtype(args, ct2)
    opts = dict(beam=args.beam, alpha=args.lenpen, max_len_a=args.max_len_a,
                max_len_b=args.max_len_b, max_tokens=args.max_tokens, nbest=args.nbest,
                greedy=args.greedy, dtype=dtype, exact=args.exact, pack=not args.compile)
    done = write_output(args, model, enc, lines, opts)
    if done is None:
        return
    stats, hyps, seconds = done
    precision = f'CTranslate2 {model.compute_type}' if ct2 else dtype
    print(summary(args, stats, seconds, precision), file=sys.stderr)
    if refs is not None and not hyps:
        checkpoint.warn(f"{args.input or '<stdin>'} is empty: nothing to score")
    elif refs is not None:
        print_scores(hyps, refs, args.paper_bleu)


if __name__ == '__main__':
    checkpoint.stop_on_signals()
    try:
        main()
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other Unix tools do
        # Nothing more to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except KeyboardInterrupt:  # the output file, if any, is left as it was
        sys.exit("translate.py: interrupted")
