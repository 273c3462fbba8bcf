"""
Prepare a parallel corpus for train.py: fetch and read it, learn a joint byte-level BPE (rustbpe), encode with
tiktoken, clean the training pairs (Moses' clean-corpus-n), write token files (docs/formats.md). The other
scripts read, batch and write their files through it too.

    python data_prep.py multi30k --src en --tgt de      # -> data/multi30k_en_de  (also --tgt fr)
    python data_prep.py wmt14 --src en --tgt de         # -> data/wmt14_en_de     (also --tgt fr)
    python data_prep.py custom --train PREFIX --valid PREFIX --test PREFIX --src xx --tgt yy --out data/mine
    python data_prep.py custom ... --tokenizer out/multi30k_en_de/ckpt.pt   # its BPE, to fine-tune it
"""
import argparse
import base64
import contextlib
import gzip
import hashlib
import itertools
import json
import os
import re
import sys
import tarfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import urllib3

import checkpoint
import dataset

# Per split, (URL, member of the archive or None); {lang}: the side's language, {role}: src or ref.
MULTI30K = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/'
STATMT = 'http://statmt.org/'  # WMT14's own, as tensor2tensor's (fairseq's en-de: nc v12 unless --icml17)
CORPORA = {
    'multi30k': {split: [(MULTI30K + name + '.{lang}.gz', None)]
                 for split, name in (('train', 'train'), ('valid', 'val'), ('test', 'test_2016_flickr'))},
    'wmt14 de-en': {  # the paper's en-de data: about 4.5M training pairs
        'train': [(STATMT + 'wmt13/training-parallel-europarl-v7.tgz', 'training/europarl-v7.de-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-commoncrawl.tgz', 'commoncrawl.de-en.{lang}'),
                  (STATMT + 'wmt14/training-parallel-nc-v9.tgz', 'training/news-commentary-v9.de-en.{lang}')],
        'valid': [(STATMT + 'wmt14/dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(STATMT + 'wmt14/test-full.tgz', 'test-full/newstest2014-deen-{role}.{lang}.sgm')]},
    'wmt14 en-fr': {  # the paper reports 36M sentence pairs
        'train': [(STATMT + 'wmt13/training-parallel-europarl-v7.tgz', 'training/europarl-v7.fr-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-commoncrawl.tgz', 'commoncrawl.fr-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-un.tgz', 'un/undoc.2000.fr-en.{lang}'),
                  (STATMT + 'wmt14/training-parallel-nc-v9.tgz', 'training/news-commentary-v9.fr-en.{lang}'),
                  (STATMT + 'wmt10/training-giga-fren.tar', 'giga-fren.release2.fixed.{lang}.gz')],
        'valid': [(STATMT + 'wmt14/dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(STATMT + 'wmt14/test-full.tgz', 'test-full/newstest2014-fren-{role}.{lang}.sgm')]}}
DEFAULT_VOCAB = {'multi30k': 8000, 'wmt14 de-en': 37000, 'wmt14 en-fr': 32000, 'custom': 8000}  # with bytes
# name -> (bytes or None, sha256 or md5) of downloads and mirror files; Multi30k's: ../shared/data/multi30k
CHECKSUMS = {
    'train.en.gz': (568929, 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f'),
    'train.de.gz': (637044, '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6'),
    'train.fr.gz': (604242, '622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c'),
    'val.en.gz': (21650, '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28'),
    'val.de.gz': (24681, 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a'),
    'val.fr.gz': (23001, 'ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9'),
    'test_2016_flickr.en.gz': (21077, '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9'),
    'test_2016_flickr.de.gz': (22890, '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8'),
    'test_2016_flickr.fr.gz': (22310, '6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90'),
    'test-full.tgz': (None, 'a8cd784e006feb32ac6f3d9ec7eb389a'),  # sacrebleu's md5 (newstest2014, in full)
}
LINES = {'training/europarl-v7.de-en': 1920209, 'commoncrawl.de-en': 2399123, 'dev/newstest2013': 3000,
         'training/news-commentary-v9.de-en': 201288}  # WMT14 en-de's as published; others: a warning
LOCAL_MULTI30K = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'shared', 'data', 'multi30k')
# GPT-4's pre-tokenisation (also rustbpe's default), written out so the tokenizer is fully described here.
PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
           r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
SPECIALS = ('<pad>', '<s>', '</s>')
RETRY_WAIT = 2.0  # seconds before the first retry of a download, doubled each time
LINE_BREAKS = re.compile('[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')  # what str.splitlines() breaks on

def file_problem(path, name):
    """What differs between a file and its CHECKSUMS entry: None where nothing does, or it has none."""
    if name not in CHECKSUMS:
        return None
    (size, digest), h = CHECKSUMS[name], hashlib.new('md5' if len(CHECKSUMS[name][1]) == 32 else 'sha256')
    if size is not None and os.path.getsize(path) != size:
        return f'size {os.path.getsize(path)} bytes, expected {size}'
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return None if h.hexdigest() == digest else f'{h.name} {h.hexdigest()}, expected {digest}'

def download(url, path, retries=5):
    """Stream url into path + '.part', resumed (HTTP Range) after failures; renamed to path when checked."""
    name, part = os.path.basename(path), path + '.part'
    for attempt in range(retries + 1):
        have, total = os.path.getsize(part) if os.path.exists(part) else 0, None
        try:
            with requests.get(url, headers={'Accept-Encoding': 'identity', 'Range': f'bytes={have}-'},
                              stream=True, timeout=60) as r:
                if r.status_code == 416:  # nothing after byte `have`: the .part is whole
                    break
                if 400 <= r.status_code < 500:  # retrying will not help
                    sys.exit(f'error: downloading {url}: HTTP {r.status_code} {r.reason}')
                r.raise_for_status()
                have = have if r.status_code == 206 else 0  # else the whole file came: the .part anew
                total = have + int(r.headers['Content-Length']) if 'Content-Length' in r.headers else None
                size = f'{total / 1e6:.1f}' if total else '?'
                with open(part, 'ab' if have else 'wb') as f:
                    for chunk in r.raw.stream(1 << 20, decode_content=False):  # as sent: a .gz stays one
                        f.write(chunk)
                        have += len(chunk)
                        if have // 10 ** 8 > (have - len(chunk)) // 10 ** 8 or have == total:  # per 100 MB
                            print(f'{name}: {have / 1e6:.1f} of {size} MB', file=sys.stderr, flush=True)
            error = None if have == (total or have) else 'connection closed'
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            error = e
        if not error:
            break
        if attempt < retries:
            print(f'{name}: interrupted at {have} of {total or "?"} bytes ({error}); retry {attempt + 1} of '
                  f'{retries} in {RETRY_WAIT * 2 ** attempt:.0f}s', file=sys.stderr)
            time.sleep(RETRY_WAIT * 2 ** attempt)
    else:
        sys.exit(f'error: downloading {url} failed after {retries + 1} attempts ({error}): {have} of '
                 f'{total or "?"} bytes in {part} (run again to resume)')
    if problem := file_problem(part, name):
        os.remove(part)
        sys.exit(f'error: {url}: {problem}; removed the download, run again to fetch it anew')
    os.replace(part, path)
    return path

def fetch(url, mirror, download_dir):
    """Local path of the file named by url, read from mirror (a folder or a base URL) when given."""
    name, local = url.rsplit('/', 1)[1], mirror and not re.match(r'https?://', mirror)
    path = os.path.join(mirror if local else download_dir, name)
    if os.path.exists(path):  # a download was checked when it came; a file put there by hand was not
        if problem := file_problem(path, name):
            sys.exit(f'error: {path}: {problem}' + ('' if local else '; remove it to download it anew'))
        return path
    if local:
        sys.exit(f'error: {name} is not in the mirror folder {mirror}')
    url = mirror.rstrip('/') + '/' + name if mirror else url
    checkpoint.make_writable(download_dir, '--download-dir')
    with checkpoint.locked(download_dir, 'downloading into'):  # en-de and en-fr share files: one .part, one writer
        return path if os.path.exists(path) else download(url, path)  # (or another run got it meanwhile)

def label(src):  # a (path, member) source for messages
    return f'{src[0]}:{src[1]}' if src[1] else src[0]

def read_lines(path, member=None, errors='strict'):
    """Yield the lines of a plain or .gz file, a .tar/.tgz member or stdin (path None), without line ending;
    invalid UTF-8 is an error, or with errors='replace' (translate.py: a line out per line in) a warning."""
    where, name = label((path, member)) if path else '<stdin>', member or path or ''
    sgm = name.endswith('.sgm')  # of which only the text of the <seg> lines counts, as sacreBLEU reads it
    try:
        with (open(path, 'rb') if path else contextlib.nullcontext(sys.stdin.buffer)) as f:
            if member:
                tar = tarfile.open(fileobj=f, mode='r|*')  # streaming: stops reading at the member
                found = next((m for m in tar if os.path.normpath(m.name) == os.path.normpath(member)), None)
                f = tar.extractfile(found) if found else sys.exit(f'error: {path} has no member {member}')
            for i, raw in enumerate(gzip.GzipFile(fileobj=f) if name.endswith('.gz') else f, 1):
                try:
                    text = raw.decode('utf-8-sig')  # a byte-order mark (Windows editors write one) is no text
                except UnicodeDecodeError as e:
                    if errors != 'replace':
                        sys.exit(f'error: {where} line {i}: invalid UTF-8 ({e.reason} at byte {e.start})')
                    print(f'warning: {where}: line {i}: invalid UTF-8 at byte {e.start}, replaced by U+FFFD',
                          file=sys.stderr)
                    text = raw.decode('utf-8-sig', errors='replace')
                # Split on '\n' only, so that a line is one for every later reader (str.splitlines() too).
                line = LINE_BREAKS.sub(' ', text.rstrip('\n').rstrip('\r'))
                seg = sgm and re.match(r'\s*<seg[^>]*>(.*)</seg>', line)
                if seg or not sgm:
                    yield ' '.join(seg[1].split()) if seg else line
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        sys.exit(f'error: cannot read {where}: {e}')

def read_pairs(files, expect=None):
    """Yield (src, tgt) lines from a list of (src file, tgt file); files of different lengths are an error."""
    for s_file, t_file in files:
        s_it, t_it, n = read_lines(*s_file), read_lines(*t_file), 0
        for n, (s, t) in enumerate(itertools.zip_longest(s_it, t_it), 1):
            if s is None or t is None:
                ns, nt = (n - 1 + (x is not None) + sum(1 for _ in it) for x, it in ((s, s_it), (t, t_it)))
                sys.exit(f'error: line counts differ: {label(s_file)} has {ns}, {label(t_file)} has {nt}')
            yield s, t
        if (want := (expect or {}).pop((s_file[1] or '').rsplit('.', 1)[0], n)) != n:  # popped: said once
            print(f'warning: {label(s_file)} has {n:,} lines, not the {want:,} published', file=sys.stderr)

def train_tokenizer(texts, vocab_size, name):
    """Byte-level BPE of vocab_size tokens (the 256 bytes included) on strings -> tokenizer.json's dict."""
    import rustbpe  # here, not at the top: translating and training need only tiktoken
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts, vocab_size, pattern=PATTERN)
    ranks = sorted(((bytes(b), r) for b, r in tok.get_mergeable_ranks()), key=lambda br: br[1])
    return {'name': name, 'pattern': tok.get_pattern(),
            'ranks': [[base64.b64encode(b).decode('ascii'), r] for b, r in ranks],
            'special_tokens': {s: len(ranks) + i for i, s in enumerate(SPECIALS)}}

def given_tokenizer(source):
    """--tokenizer: that of a tokenizer.json, a data folder or a checkpoint (to fine-tune it, on its ids)."""
    try:
        tok = (dataset.read_tokenizer(source) if os.path.isdir(source) or source.endswith('.json') else
               checkpoint.checkpoint_tokenizer(source, checkpoint.read_checkpoint(source, ('tokenizer',))))
        dataset.load_tokenizer(tok)
        return tok
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f'error: --tokenizer {source}: not a tokenizer of data_prep.py ({type(e).__name__}: {e})')


def clean_mask(ls, lt, max_len, max_ratio):
    """Moses' clean-corpus-n on token counts, as there with no exception for short pairs (1:2 is a ratio of 2)
    -> (keep, counts of 'empty', 'too_long', 'ratio', each pair under its first rule). 0 disables a rule."""
    empty = (ls == 0) | (lt == 0)
    too_long = ~empty & ((ls > max_len) | (lt > max_len)) if max_len > 0 else np.zeros_like(empty)
    ratio = (~empty & ~too_long & (np.maximum(ls, lt) > max_ratio * np.minimum(ls, lt)) if max_ratio > 0
             else np.zeros_like(empty))
    return ~(empty | too_long | ratio), {'empty': int(empty.sum()), 'too_long': int(too_long.sum()),
                                         'ratio': int(ratio.sum())}

def encode_lines(enc, lines, workers):
    """-> (token ids of all lines, one after the other, as uint32; number of tokens of each line). A thread
    encodes lines joined by '</s>', which tiktoken splits at before its regex: ids as of each line alone."""
    if not lines:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    eos, step = enc.encode_single_token('</s>'), -(-len(lines) // workers)
    texts = ['</s>'.join(lines[i:i + step]) + '</s>' for i in range(0, len(lines), step)]
    with ThreadPoolExecutor(workers) as pool:  # tiktoken releases the GIL while encoding
        ids = np.concatenate(list(pool.map(
            lambda t: enc.encode_to_numpy(t, allowed_special={'</s>'}, disallowed_special=()), texts)))
    ends = np.flatnonzero(ids == eos)
    if len(ends) != len(lines):  # some line holds the text '</s>' itself: encode line by line
        per_line = [enc.encode_ordinary(line) for line in lines]
        return np.fromiter(itertools.chain(*per_line), np.uint32), np.array([len(x) for x in per_line])
    return ids[ids != eos], np.diff(ends, prepend=-1) - 1

def write_split(out, split, files, enc, langs, workers, max_len=0, max_ratio=0, expect=None, chunk=50_000):
    """Encode a split's (src, tgt) files into {split}.{lang}.bin, .idx (and .txt, the text as read, but for
    train), renamed into place when complete; only the training pairs are cleaned. -> counts."""
    train, dtype = split == 'train', np.uint16 if enc.n_vocab <= 2 ** 16 else np.uint32
    raw, dropped = 0, dict.fromkeys(('empty', 'too_long', 'ratio'), 0)
    lengths, t0, pairs = [[np.zeros(0, np.int32)] for _ in langs], time.time(), read_pairs(files, expect)
    with contextlib.ExitStack() as stack:
        out_files = {f'{lang}.{ext}': stack.enter_context(checkpoint.atomic(os.path.join(out, f'{split}.{lang}.{ext}')))
                     for lang in langs for ext in ('bin', 'idx', 'txt')[:3 - train]}
        while batch := list(itertools.islice(pairs, chunk)):
            sides = list(zip(*batch))
            for lang, lines in zip(langs, [] if train else sides):  # the text, for BLEU against references
                out_files[f'{lang}.txt'].write(''.join(line + '\n' for line in lines).encode('utf-8'))
            ids, lens = zip(*(encode_lines(enc, [line.strip() for line in side], workers) for side in sides))
            keep, counts = clean_mask(*lens, max_len, max_ratio) if train else (np.ones(len(batch), bool), {})
            dropped = {k: v + counts.get(k, 0) for k, v in dropped.items()}
            for i, lang in enumerate(langs):
                out_files[f'{lang}.bin'].write(ids[i][np.repeat(keep, lens[i])].astype(dtype).tobytes())
                lengths[i].append(lens[i][keep].astype(np.int32))
            raw += len(batch)
            if raw // 1_000_000 > (raw - len(batch)) // 1_000_000:
                print(f'{split}: {raw:,} pairs encoded, {time.time() - t0:.0f}s', flush=True)
        lengths = [np.concatenate(n) for n in lengths]
        for lang, n in zip(langs, lengths):
            out_files[f'{lang}.idx'].write(np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).tobytes())
    kept, tokens = len(lengths[0]), [int(n.sum()) for n in lengths]
    print(f'{split}: {raw} pairs read, encoded and written in {time.time() - t0:.1f}s; kept {kept}, '
          f'{tokens[0]} + {tokens[1]} tokens' + (f'; dropped {dropped}' if train else ''))
    if kept == 0:
        sys.exit(f'error: the {split} split has no sentence pairs ({raw} read, dropped: {dropped}): '
                 + ', '.join(f'{label(s)} / {label(t)}' for s, t in files))
    return {'raw': raw, 'pairs': kept, 'tokens': tokens, 'dropped': dropped}


# --- checkpoints: what train.py writes and translate.py, export_ct2.py and plot.py read ----------


def source_files(args, key):
    """-> {split: [((path, member), (path, member)), ...]} with every remote file fetched first."""
    if args.corpus == 'custom':
        def locate(prefix, lang):
            for path in (f'{prefix}.{lang}', f'{prefix}.{lang}.gz'):
                if os.path.exists(path):
                    return path, None
            sys.exit(f'error: neither {prefix}.{lang} nor {prefix}.{lang}.gz exists')
        prefixes = {'train': args.train, 'valid': [args.valid], 'test': [args.test]}
        return {split: [(locate(p, args.src), locate(p, args.tgt)) for p in ps]
                for split, ps in prefixes.items()}
    mirror = args.mirror
    if mirror is None and args.corpus == 'multi30k' and os.path.isdir(LOCAL_MULTI30K):
        mirror = os.path.normpath(LOCAL_MULTI30K)  # machines here have no internet
        print(f'no --mirror given: reading Multi30k from the local copy {mirror}')
    sides = ((args.src, 'src'), (args.tgt, 'ref'))
    return {split: [tuple((fetch(url.format(lang=lang, role=role), mirror, args.download_dir),
                           member and member.format(lang=lang, role=role)) for lang, role in sides)
                    for url, member in entries] for split, entries in CORPORA[key].items()}

def prepare(args, key):
    given = given_tokenizer(args.tokenizer) if args.tokenizer else None
    vocab_size, out = len(given['ranks']) if given else args.vocab_size or DEFAULT_VOCAB[key], args.out
    checkpoint.make_writable(out, '--out')  # before any download or BPE: an --out that is a file fails at once
    files = source_files(args, key)
    paths = sorted({p for fs in files.values() for pair in fs for p, _ in pair})
    settings = {'corpus': args.corpus, 'src': args.src, 'tgt': args.tgt, 'vocab_size': vocab_size,
                'max_len': args.max_len, 'max_ratio': args.max_ratio,
                'files': {split: [[label(s), label(t)] for s, t in fs] for split, fs in files.items()},
                # A file rewritten under its old name is another corpus: its size and time say so.
                'stamps': [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]}
    if given:  # by content: another tokenizer of the same size is another encoding
        merges = json.dumps({k: v for k, v in given.items() if k != 'name'}, sort_keys=True)
        settings['tokenizer'] = hashlib.sha256(merges.encode()).hexdigest()
    with checkpoint.locked(out, 'writing'):  # from the check of meta.json to writing it: one run at a time
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no meta.json, or a damaged one
            if (meta := dataset.load_meta(out)).get('settings') == settings and not args.force:
                print(f'{out} is already prepared with these settings (--force to redo it)')
                return meta
        for f in os.listdir(out):  # meta.json marks a finished folder; a killed run's leftovers go too
            if re.fullmatch(r'meta\.json|((train|valid|test)\.[^.]+\.(bin|idx|txt)|\w+\.json)\.\w+\.tmp', f):
                os.remove(os.path.join(out, f))
        os.environ.setdefault('RAYON_NUM_THREADS', str(args.workers))  # rustbpe's thread pool
        expect = dict(LINES)  # WMT14's published counts: a member of another is named before the BPE
        list(read_pairs(files['valid'] + files['test'], expect))  # so is a missing or short one
        t0 = time.time()

        def texts():  # what BPE learns from; rustbpe itself says nothing while it reads and merges
            for i, pair in enumerate(read_pairs(files['train'], expect), 1):
                if i % 1_000_000 == 0:
                    print(f'BPE: {i:,} training pairs read, {time.time() - t0:.0f}s', flush=True)
                yield from (text for text in map(str.strip, pair) if text)
            print(f'BPE: read in {time.time() - t0:.0f}s; learning {vocab_size - 256} merges', flush=True)
        tok = given or train_tokenizer(texts(), vocab_size, f'{args.corpus}_{args.src}_{args.tgt}')
        checkpoint.write_json(os.path.join(out, 'tokenizer.json'), tok)
        enc, bpe_seconds, specials = dataset.load_tokenizer(tok), time.time() - t0, tok['special_tokens']
        print(f'BPE: {len(tok["ranks"])} tokens of {vocab_size} asked (+ {len(SPECIALS)} specials), '
              + (f'of --tokenizer {args.tokenizer}' if given else f'learned in {bpe_seconds:.1f}s'))
        st = {split: write_split(out, split, files[split], enc, (args.src, args.tgt), args.workers,
                                 args.max_len, args.max_ratio, expect) for split in files}
        meta = {'name': os.path.basename(os.path.normpath(out)), 'src': args.src, 'tgt': args.tgt,
                'vocab_size': enc.n_vocab, 'pad_id': specials['<pad>'], 'bos_id': specials['<s>'],
                'eos_id': specials['</s>'], 'dtype': 'uint16' if enc.n_vocab <= 2 ** 16 else 'uint32',
                'splits': {k: dict(pairs=s['pairs'], src_tokens=s['tokens'][0], tgt_tokens=s['tokens'][1])
                           for k, s in st.items()},
                'raw_pairs': {k: s['raw'] for k, s in st.items()}, 'dropped': st['train']['dropped'],
                'max_len': args.max_len, 'max_ratio': args.max_ratio, 'bpe_seconds': round(bpe_seconds, 2),
                'seconds': round(time.time() - t0, 2), 'settings': settings}
        checkpoint.write_json(os.path.join(out, 'meta.json'), meta)  # last: its presence says the folder is complete
        print(f'wrote {out} in {meta["seconds"]:.1f}s: vocab {enc.n_vocab}, {st["train"]["pairs"]} pairs')
        return meta

def main(argv=None):
    p = argparse.ArgumentParser(description='Prepare a parallel corpus (see the docstring of data_prep.py).')
    p.add_argument('corpus', choices=['multi30k', 'wmt14', 'custom'])
    p.add_argument('--src', required=True, help='source language code, e.g. en')
    p.add_argument('--tgt', required=True, help='target language code, e.g. de')
    p.add_argument('--train', nargs='+', action='extend', metavar='PREFIX', help='custom: training prefixes')
    p.add_argument('--valid', metavar='PREFIX', help='custom: validation files prefix')
    p.add_argument('--test', metavar='PREFIX', help='custom: test files prefix')
    p.add_argument('--mirror', metavar='DIR_OR_URL', help='read the same file names from this folder or URL')
    p.add_argument('--vocab-size', type=int, default=0, help='BPE tokens with the 256 bytes (0: 8000, WMT14 '
                   'en-de 37000, en-fr 32000)')
    p.add_argument('--tokenizer', metavar='PATH', help="a checkpoint's or data folder's BPE, to fine-tune on")
    p.add_argument('--out', help='output folder (default data/CORPUS_SRC_TGT)')
    p.add_argument('--max-len', type=int, default=250, help='drop training pairs with a side over this many '
                   'tokens (0: no limit)')
    p.add_argument('--max-ratio', type=float, help='drop training pairs with one side over this many times '
                   'the tokens of the other (0: no limit; default 1.5 as fairseq, for Multi30k 0)')
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    p.add_argument('--workers', type=int, default=cores, help='threads for BPE and encoding (all cores)')
    p.add_argument('--download-dir', default=os.path.join('data', 'downloads'), help='where downloads stay')
    p.add_argument('--force', action='store_true', help='redo even if OUT is prepared with these settings')
    args = p.parse_args(argv)  # Multi30k's captions: every pair kept (docs/experiments.md)
    args.max_ratio = (0 if args.corpus == 'multi30k' else 1.5) if args.max_ratio is None else args.max_ratio
    pair, custom = '-'.join(sorted((args.src, args.tgt))), (args.train, args.valid, args.test)
    key = args.corpus if args.corpus in ('multi30k', 'custom') else f'{args.corpus} {pair}'
    for wrong, message in [
            (args.src == args.tgt, f'--src and --tgt are both {args.src!r}'),  # they would write one file
            (key not in CORPORA and key != 'custom', f'no {args.corpus} files for {pair}'),
            (args.corpus == 'custom' and not all(custom), 'custom needs --train, --valid and --test'),
            (args.corpus != 'custom' and any(custom), f'--train, --valid, --test are for custom, not {key}'),
            (args.tokenizer and args.vocab_size, '--vocab-size comes with the BPE, not with --tokenizer'),
            (args.vocab_size and args.vocab_size < 256, '--vocab-size counts the 256 bytes: at least 256'),
            (args.max_len < 0 or not 0 <= args.max_ratio < float('inf'), '--max-len, --max-ratio: >= 0')]:
        if wrong:
            p.error(message)
    args.workers = max(1, args.workers)
    args.out = args.out or os.path.join('data', f'{args.corpus}_{args.src}_{args.tgt}')
    try:
        return prepare(args, key)
    except OSError as e:  # a full disk, most likely; checkpoint.atomic() has removed its temporary files
        sys.exit(f'error: writing {args.out}: {e.strerror or e}')

if __name__ == '__main__':
    main()
