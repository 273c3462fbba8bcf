"""
Prepare a parallel corpus for train.py: download it (or take it from a mirror or local files), read
its archives, learn a joint byte-level BPE (rustbpe), encode the text with tiktoken, clean the
training pairs (Moses' clean-corpus-n) and write the token files that dataset.py reads
(docs/formats.md).

    python data_prep.py multi30k --src en --tgt de      # -> data/multi30k_en_de  (also --tgt fr)
    python data_prep.py wmt14 --src en --tgt de         # -> data/wmt14_en_de     (also --tgt fr)
    python data_prep.py custom --train PREFIX --valid PREFIX --test PREFIX --src xx --tgt yy \\
        --out data/mine
    python data_prep.py custom ... --tokenizer out/multi30k_en_de/ckpt.pt  # its BPE, to fine-tune
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
import shutil
import sys
import tarfile
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import urllib3

import checkpoint
import dataset

# Per split, a list of (URL, member of the archive or None);
# {lang}: the side's language, {role}: src or ref (the test sets' two SGM files).
MULTI30K = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/'
# WMT14's own files, as tensor2tensor's (fairseq's en-de has news-commentary v12 unless --icml17).
STATMT = 'http://statmt.org/'
WMT10 = STATMT + 'wmt10/'
WMT13 = STATMT + 'wmt13/'
WMT14 = STATMT + 'wmt14/'
CORPORA = {
    'multi30k': {
        'train': [(MULTI30K + 'train.{lang}.gz', None)],
        'valid': [(MULTI30K + 'val.{lang}.gz', None)],
        'test': [(MULTI30K + 'test_2016_flickr.{lang}.gz', None)],
    },
    'wmt14 de-en': {  # the paper's en-de data: about 4.5M training pairs
        'train': [
            (WMT13 + 'training-parallel-europarl-v7.tgz', 'training/europarl-v7.de-en.{lang}'),
            (WMT13 + 'training-parallel-commoncrawl.tgz', 'commoncrawl.de-en.{lang}'),
            (WMT14 + 'training-parallel-nc-v9.tgz', 'training/news-commentary-v9.de-en.{lang}'),
        ],
        'valid': [(WMT14 + 'dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(WMT14 + 'test-full.tgz', 'test-full/newstest2014-deen-{role}.{lang}.sgm')],
    },
    'wmt14 en-fr': {  # the paper reports 36M sentence pairs
        'train': [
            (WMT13 + 'training-parallel-europarl-v7.tgz', 'training/europarl-v7.fr-en.{lang}'),
            (WMT13 + 'training-parallel-commoncrawl.tgz', 'commoncrawl.fr-en.{lang}'),
            (WMT13 + 'training-parallel-un.tgz', 'un/undoc.2000.fr-en.{lang}'),
            (WMT14 + 'training-parallel-nc-v9.tgz', 'training/news-commentary-v9.fr-en.{lang}'),
            (WMT10 + 'training-giga-fren.tar', 'giga-fren.release2.fixed.{lang}.gz'),
        ],
        'valid': [(WMT14 + 'dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(WMT14 + 'test-full.tgz', 'test-full/newstest2014-fren-{role}.{lang}.sgm')],
    },
}
# BPE tokens, the 256 bytes included, when --vocab-size is not given
DEFAULT_VOCAB = {'multi30k': 8000, 'wmt14 de-en': 37000, 'wmt14 en-fr': 32000, 'custom': 8000}
# name -> (bytes or None, sha256 or md5) of downloads and mirror files
# (Multi30k's are those of the copy in ../shared/data/multi30k)
CHECKSUMS = {
    'train.en.gz': (568929, 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f'),
    'train.de.gz': (637044, '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6'),
    'train.fr.gz': (604242, '622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c'),
    'val.en.gz': (21650, '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28'),
    'val.de.gz': (24681, 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a'),
    'val.fr.gz': (23001, 'ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9'),
    'test_2016_flickr.en.gz':
        (21077, '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9'),
    'test_2016_flickr.de.gz':
        (22890, '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8'),
    'test_2016_flickr.fr.gz':
        (22310, '6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90'),
    # sacrebleu's md5 of newstest2014 in full
    'test-full.tgz': (None, 'a8cd784e006feb32ac6f3d9ec7eb389a'),
}
# The line counts of WMT14 en-de's members as published; a member of another count is warned of.
LINES = {
    'training/europarl-v7.de-en': 1920209,
    'commoncrawl.de-en': 2399123,
    'dev/newstest2013': 3000,
    'training/news-commentary-v9.de-en': 201288,
}
HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_MULTI30K = os.path.join(HERE, '..', 'shared', 'data', 'multi30k')
# GPT-4's pre-tokenisation (also rustbpe's default), written out so that the tokenizer is fully
# described here.
PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}"""
           r"""| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
SPECIALS = ('<pad>', '<s>', '</s>')
RETRY_WAIT = 2.0  # seconds before the first retry of a download, doubled each time
# What str.splitlines() breaks a line at
LINE_BREAKS = re.compile('[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')
SEG = re.compile(r'\s*<seg[^>]*>(.*)</seg>')  # a sentence of an SGM file
SPLIT_FILE = re.compile(r'(train|valid|test)\.[^.]+\.(bin|idx|txt)')  # a split's token file
# What a killed run leaves in --out: its folder of new files, or (before it had one) temporaries.
LEFTOVERS = re.compile(r'\.preparing\.\w+|(' + SPLIT_FILE.pattern + r'|\w+\.json)\.\w+\.tmp')

# -----------------------------------------------------------------------------------------------
# download


def locked(folder, doing):
    """Keep other data_prep.py runs, which would delete or rename our temporary files, out."""
    stack = contextlib.ExitStack()
    busy = f'another data_prep.py is {doing} {folder}: waiting for it'
    stack.callback(os.close, checkpoint.lock_folder(folder, busy))
    return stack


def file_problem(path, name):
    """What differs between a file and its CHECKSUMS entry: None if nothing does, or it has none."""
    if name not in CHECKSUMS:
        return None
    size, digest = CHECKSUMS[name]
    if size is not None and os.path.getsize(path) != size:
        return f'size {os.path.getsize(path)} bytes, expected {size}'
    h = hashlib.new('md5' if len(digest) == 32 else 'sha256')
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    if h.hexdigest() == digest:
        return None
    return f'{h.name} {h.hexdigest()}, expected {digest}'


def download_rest(url, part, name):
    """One try at appending to part what url has after part's bytes (HTTP Range).
    -> (bytes in part, the file's size or None, the error or None)."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    total = None
    headers = {'Accept-Encoding': 'identity', 'Range': f'bytes={have}-'}
    try:
        with requests.get(url, headers=headers, stream=True, timeout=60) as r:
            if r.status_code == 416:  # nothing after byte `have`: the .part is whole
                return have, total, None
            if 400 <= r.status_code < 500:  # retrying will not help
                sys.exit(f'error: downloading {url}: HTTP {r.status_code} {r.reason}')
            r.raise_for_status()
            if r.status_code != 206:  # the whole file came: the .part anew
                have = 0
            if 'Content-Length' in r.headers:
                total = have + int(r.headers['Content-Length'])
            size = f'{total / 1e6:.1f}' if total else '?'
            with open(part, 'ab' if have else 'wb') as f:
                # the bytes as sent (decode_content=False): a .gz stays compressed
                for chunk in r.raw.stream(1 << 20, decode_content=False):
                    f.write(chunk)
                    have += len(chunk)
                    next_100mb = have // 10 ** 8 > (have - len(chunk)) // 10 ** 8
                    if next_100mb or have == total:
                        print(f'{name}: {have / 1e6:.1f} of {size} MB', file=sys.stderr, flush=True)
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
        return have, total, e
    if total and have != total:
        return have, total, 'connection closed'
    return have, total, None


def download(url, path, retries=5):
    """Stream url into path + '.part', resumed (HTTP Range) after failures; renamed to path once
    checked."""
    name = os.path.basename(path)
    part = path + '.part'
    for attempt in range(retries + 1):
        have, total, error = download_rest(url, part, name)
        if not error:
            break
        if attempt < retries:
            wait = RETRY_WAIT * 2 ** attempt
            print(f'{name}: interrupted at {have} of {total or "?"} bytes ({error}); '
                  f'retry {attempt + 1} of {retries} in {wait:.0f}s', file=sys.stderr)
            time.sleep(wait)
    if error and not os.path.exists(part):  # not a byte came
        sys.exit(f'error: downloading {url} failed after {retries + 1} attempts ({error}): '
                 f'run again to retry')
    if error:
        sys.exit(f'error: downloading {url} failed after {retries + 1} attempts ({error}): '
                 f'{have} of {total or "?"} bytes in {part} (run again to resume)')
    problem = file_problem(part, name)
    if problem:
        os.remove(part)
        sys.exit(f'error: {url}: {problem}; removed the download, run again to fetch it anew')
    os.replace(part, path)
    return path


def fetch(url, mirror, download_dir):
    """Local path of the file named by url, read from mirror (a folder or a base URL) when given."""
    name = url.rsplit('/', 1)[1]
    local = bool(mirror) and not re.match(r'https?://', mirror)
    path = os.path.join(mirror if local else download_dir, name)
    # A download was checked when it came; a file put there by hand was not.
    if os.path.exists(path):
        problem = file_problem(path, name)
        if problem:
            hint = '' if local else '; remove it to download it anew'
            sys.exit(f'error: {path}: {problem}{hint}')
        return path
    if local:
        sys.exit(f'error: {name} is not in the mirror folder {mirror}')
    if mirror:
        url = mirror.rstrip('/') + '/' + name
    checkpoint.make_writable(download_dir, '--download-dir')
    # en-de and en-fr share files: one .part, one writer
    with locked(download_dir, 'downloading into'):
        if os.path.exists(path):  # another run got it meanwhile
            return path
        return download(url, path)

# -----------------------------------------------------------------------------------------------
# reading


def label(src):
    """A (path, member) source as messages name it."""
    path, member = src
    if member:
        return f'{path}:{member}'
    return path


def open_member(f, path, member):
    """The member of the tar archive f, read as a stream: the reading stops at the member."""
    tar = tarfile.open(fileobj=f, mode='r|*')
    for m in tar:
        if os.path.normpath(m.name) == os.path.normpath(member):
            return tar.extractfile(m)
    sys.exit(f'error: {path} has no member {member}')


def decode_line(raw, where, i, errors):
    """Line i's bytes -> its text, without line ending and with no other line break in it."""
    try:
        text = raw.decode('utf-8-sig')  # a byte-order mark (Windows editors write one) is no text
    except UnicodeDecodeError as e:
        if errors != 'replace':
            sys.exit(f'error: {where} line {i}: invalid UTF-8 ({e.reason} at byte {e.start})')
        print(f'warning: {where}: line {i}: invalid UTF-8 at byte {e.start}, replaced by U+FFFD',
              file=sys.stderr)
        text = raw.decode('utf-8-sig', errors='replace')
    # Split on '\n' only, so that a line is one for every later reader (str.splitlines() too).
    return LINE_BREAKS.sub(' ', text.rstrip('\n').rstrip('\r'))


def read_lines(path, member=None, errors='strict'):
    """Yield the lines of a plain or .gz file, a .tar/.tgz member or stdin (path None), without line
    ending. Invalid UTF-8 is an error, or with errors='replace' a warning (translate.py: a line out
    per line in)."""
    where = label((path, member)) if path else '<stdin>'
    name = member or path or ''
    sgm = name.endswith('.sgm')  # of which only the <seg> lines' text counts, as sacreBLEU reads it
    try:
        if path:
            source = open(path, 'rb')
        else:
            source = contextlib.nullcontext(sys.stdin.buffer)
        with source as f:
            if member:
                f = open_member(f, path, member)
            if name.endswith('.gz'):
                f = gzip.GzipFile(fileobj=f)
            for i, raw in enumerate(f, 1):
                # Windows' "Unicode" text: every line would be garbage, a warning for each.
                if i == 1 and raw.startswith((b'\xff\xfe', b'\xfe\xff')):
                    sys.exit(f"error: {where} is UTF-16 text: convert it to UTF-8 "
                             f"(iconv -f UTF-16 -t UTF-8)")
                line = decode_line(raw, where, i, errors)
                if not sgm:
                    yield line
                    continue
                seg = SEG.match(line)
                if seg:
                    yield ' '.join(seg[1].split())
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        sys.exit(f'error: cannot read {where}: {e}')


def read_pairs(files, expect=None):
    """Yield (src, tgt) lines from a list of (src file, tgt file); files of different lengths are an
    error. expect: {member without its language: published line count}, each warned of once."""
    for s_file, t_file in files:
        s_lines = read_lines(*s_file)
        t_lines = read_lines(*t_file)
        n = 0
        for n, (s, t) in enumerate(itertools.zip_longest(s_lines, t_lines), 1):
            if s is None or t is None:
                ns = n - 1 + (s is not None) + sum(1 for _ in s_lines)
                nt = n - 1 + (t is not None) + sum(1 for _ in t_lines)
                counts = f'{label(s_file)} has {ns}, {label(t_file)} has {nt}'
                sys.exit(f'error: line counts differ: {counts}')
            yield s, t
        if expect is None:
            continue
        stem = (s_file[1] or '').rsplit('.', 1)[0]
        want = expect.pop(stem, n)  # popped: said once
        if want != n:
            print(f'warning: {label(s_file)} has {n:,} lines, not the {want:,} published',
                  file=sys.stderr)

# -----------------------------------------------------------------------------------------------
# tokenizer, cleaning, encoding


def train_tokenizer(texts, vocab_size, name):
    """Byte-level BPE of vocab_size tokens (the 256 bytes included) on strings -> tokenizer.json's
    dict."""
    import rustbpe  # here, not at the top: translating and training need only tiktoken
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts, vocab_size, pattern=PATTERN)
    ranks = [(bytes(b), r) for b, r in tok.get_mergeable_ranks()]
    ranks.sort(key=lambda br: br[1])
    return {
        'name': name,
        'pattern': tok.get_pattern(),
        'ranks': [[base64.b64encode(b).decode('ascii'), r] for b, r in ranks],
        'special_tokens': {s: len(ranks) + i for i, s in enumerate(SPECIALS)},
    }


def given_tokenizer(source):
    """--tokenizer: that of a tokenizer.json, a data folder or a checkpoint, to fine-tune on its
    ids."""
    try:
        if os.path.isdir(source) or source.endswith('.json'):
            tok = dataset.read_tokenizer(source)
        else:
            ckpt = checkpoint.read_checkpoint(source, ('tokenizer',))
            tok = checkpoint.checkpoint_tokenizer(source, ckpt)
        dataset.load_tokenizer(tok)  # raises if it is not a tokenizer
        return tok
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f'{type(e).__name__}: {e}'
        sys.exit(f'error: --tokenizer {source}: not a tokenizer of data_prep.py ({why})')


def clean_mask(ls, lt, max_len, max_ratio):
    """Moses' clean-corpus-n on token counts, as there with no exception for short pairs (1:2 is a
    ratio of 2) -> (keep, counts of 'empty', 'too_long', 'ratio', each pair under its first rule).
    0 disables a rule."""
    empty = (ls == 0) | (lt == 0)
    too_long = np.zeros_like(empty)
    if max_len > 0:
        too_long = ~empty & ((ls > max_len) | (lt > max_len))
    ratio = np.zeros_like(empty)
    if max_ratio > 0:
        uneven = np.maximum(ls, lt) > max_ratio * np.minimum(ls, lt)
        ratio = ~empty & ~too_long & uneven
    keep = ~(empty | too_long | ratio)
    counts = {'empty': int(empty.sum()), 'too_long': int(too_long.sum()), 'ratio': int(ratio.sum())}
    return keep, counts


def encode_lines(enc, lines, workers):
    """-> (token ids of all lines, one after the other, as uint32; number of tokens of each line).
    A thread encodes lines joined by '</s>', which tiktoken splits at before its regex: the ids are
    those of each line alone."""
    if not lines:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    eos = enc.encode_single_token('</s>')
    step = -(-len(lines) // workers)  # lines per thread, rounded up
    texts = ['</s>'.join(lines[i:i + step]) + '</s>' for i in range(0, len(lines), step)]

    def encode(text):
        return enc.encode_to_numpy(text, allowed_special={'</s>'}, disallowed_special=())

    with ThreadPoolExecutor(workers) as pool:  # tiktoken releases the GIL while encoding
        ids = np.concatenate(list(pool.map(encode, texts)))
    ends = np.flatnonzero(ids == eos)
    if len(ends) != len(lines):  # some line holds the text '</s>' itself: encode line by line
        per_line = [enc.encode_ordinary(line) for line in lines]
        ids = np.fromiter(itertools.chain(*per_line), np.uint32)
        return ids, np.array([len(x) for x in per_line])
    return ids[ids != eos], np.diff(ends, prepend=-1) - 1

# -----------------------------------------------------------------------------------------------
# token files


def write_split(out, split, files, enc, langs, workers, max_len=0, max_ratio=0, expect=None,
                chunk=50_000):
    """Encode a split's (src, tgt) files into {split}.{lang}.bin, .idx (and .txt, the text as read,
    but for train), renamed into place when complete; only the training pairs are cleaned.
    -> counts."""
    train = split == 'train'
    dtype = np.uint16 if enc.n_vocab <= 2 ** 16 else np.uint32
    exts = ('bin', 'idx') if train else ('bin', 'idx', 'txt')
    raw = 0
    dropped = {'empty': 0, 'too_long': 0, 'ratio': 0}
    kept_lengths = [[np.zeros(0, np.int32)] for _ in langs]  # per side, the kept sentences' tokens
    t0 = time.time()
    pairs = read_pairs(files, expect)
    with contextlib.ExitStack() as stack:
        out_files = {}
        for lang in langs:
            for ext in exts:
                path = os.path.join(out, f'{split}.{lang}.{ext}')
                out_files[f'{lang}.{ext}'] = stack.enter_context(checkpoint.atomic(path))
        while batch := list(itertools.islice(pairs, chunk)):
            sides = list(zip(*batch))
            if not train:  # the text, for BLEU against references
                for lang, lines in zip(langs, sides):
                    text = ''.join(line + '\n' for line in lines)
                    out_files[f'{lang}.txt'].write(text.encode('utf-8'))
            ids, lens = [], []
            for side in sides:
                side_ids, side_lens = encode_lines(enc, [line.strip() for line in side], workers)
                ids.append(side_ids)
                lens.append(side_lens)
            if train:
                keep, counts = clean_mask(lens[0], lens[1], max_len, max_ratio)
                for rule in dropped:
                    dropped[rule] += counts[rule]
            else:
                keep = np.ones(len(batch), bool)
            for i, lang in enumerate(langs):
                kept_ids = ids[i][np.repeat(keep, lens[i])]
                out_files[f'{lang}.bin'].write(kept_ids.astype(dtype).tobytes())
                kept_lengths[i].append(lens[i][keep].astype(np.int32))
            raw += len(batch)
            if raw // 1_000_000 > (raw - len(batch)) // 1_000_000:
                print(f'{split}: {raw:,} pairs encoded, {time.time() - t0:.0f}s', flush=True)
        lengths = [np.concatenate(parts) for parts in kept_lengths]
        for lang, n in zip(langs, lengths):
            offsets = np.concatenate([[0], np.cumsum(n, dtype=np.int64)])
            out_files[f'{lang}.idx'].write(offsets.tobytes())
    kept = len(lengths[0])
    tokens = [int(n.sum()) for n in lengths]
    summary = (f'{split}: {raw} pairs read, encoded and written in {time.time() - t0:.1f}s; '
               f'kept {kept}, {tokens[0]} + {tokens[1]} tokens')
    if train:
        summary += f'; dropped {dropped}'
    print(summary)
    if kept == 0:
        names = ', '.join(f'{label(s)} / {label(t)}' for s, t in files)
        sys.exit(f'error: the {split} split has no sentence pairs '
                 f'({raw} read, dropped: {dropped}): {names}')
    return {'raw': raw, 'pairs': kept, 'tokens': tokens, 'dropped': dropped}

# -----------------------------------------------------------------------------------------------
# a prepared folder


def custom_file(prefix, lang):
    """custom: one side's file, PREFIX.LANG or PREFIX.LANG.gz, as a (path, member) source."""
    for path in (f'{prefix}.{lang}', f'{prefix}.{lang}.gz'):
        if os.path.exists(path):
            return path, None
    sys.exit(f'error: neither {prefix}.{lang} nor {prefix}.{lang}.gz exists')


def source_files(args, key):
    """-> {split: [((path, member), (path, member)), ...]} with every remote file fetched first."""
    files = {}
    if args.corpus == 'custom':
        prefixes = {'train': args.train, 'valid': [args.valid], 'test': [args.test]}
        for split, split_prefixes in prefixes.items():
            files[split] = []
            for prefix in split_prefixes:
                pair = (custom_file(prefix, args.src), custom_file(prefix, args.tgt))
                files[split].append(pair)
        return files
    mirror = args.mirror
    if mirror is None and args.corpus == 'multi30k' and os.path.isdir(LOCAL_MULTI30K):
        mirror = os.path.normpath(LOCAL_MULTI30K)  # the copy beside the project: no download
        print(f'no --mirror given: reading Multi30k from the local copy {mirror}')
    for split, entries in CORPORA[key].items():
        files[split] = []
        for url, member in entries:
            pair = []
            for lang, role in ((args.src, 'src'), (args.tgt, 'ref')):
                path = fetch(url.format(lang=lang, role=role), mirror, args.download_dir)
                side_member = member.format(lang=lang, role=role) if member else None
                pair.append((path, side_member))
            files[split].append(tuple(pair))
    return files


def settings_of(args, files, vocab_size, given):
    """What a folder is prepared from: a rerun with the same settings has nothing to do."""
    sources = [side for pairs in files.values() for pair in pairs for side in pair]
    paths = sorted({path for path, _ in sources})
    files_read = {split: [[label(s), label(t)] for s, t in pairs] for split, pairs in files.items()}
    settings = {
        'corpus': args.corpus,
        'src': args.src,
        'tgt': args.tgt,
        'vocab_size': vocab_size,
        'max_len': args.max_len,
        'max_ratio': args.max_ratio,
        'files': files_read,
        # A file rewritten under its old name is another corpus: its size and time say so.
        'stamps': [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths],
    }
    if given:  # by content: another tokenizer of the same size is another encoding
        merges = json.dumps({k: v for k, v in given.items() if k != 'name'}, sort_keys=True)
        settings['tokenizer'] = hashlib.sha256(merges.encode()).hexdigest()
    return settings


def prepared_meta(out, settings):
    """out's meta.json if out is prepared with these settings, else None."""
    try:
        meta = dataset.load_meta(out)
        same = meta.get('settings') == settings
    except (OSError, ValueError, AttributeError):  # no meta.json, or a damaged one
        return None
    if same:
        return meta
    return None


def bpe_texts(files, expect, vocab_size, t0):
    """The non-empty sides of the training pairs, stripped: what BPE learns from. Progress is
    printed here, as rustbpe itself says nothing while it reads and merges."""
    for i, pair in enumerate(read_pairs(files, expect), 1):
        if i % 1_000_000 == 0:
            print(f'BPE: {i:,} training pairs read, {time.time() - t0:.0f}s', flush=True)
        for text in pair:
            text = text.strip()
            if text:
                yield text
    print(f'BPE: read in {time.time() - t0:.0f}s; learning {vocab_size - 256} merges', flush=True)


def remove_leftovers(out):
    """What a killed run left in out (gigabytes for WMT14), also when out is found prepared."""
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if LEFTOVERS.fullmatch(name) and os.path.isdir(path):
            shutil.rmtree(path)
        elif LEFTOVERS.fullmatch(name):
            os.remove(path)


def write_folder(args, files, settings, given, vocab_size):
    """Learn (or take) the BPE and write out's tokenizer, token files and meta.json -> meta. They
    are written into a folder of their own in out and moved into place once all are: a run that
    fails or is stopped before the renames leaves out's old data as it was."""
    new = tempfile.mkdtemp(prefix='.preparing.', dir=args.out)
    try:
        meta = write_files(args, new, files, settings, given, vocab_size)
        # meta.json marks a finished folder: the old one goes first, the new one comes last
        old_meta = os.path.join(args.out, 'meta.json')
        if os.path.exists(old_meta):
            os.remove(old_meta)
        written = sorted(os.listdir(new), key=lambda name: name == 'meta.json')
        for name in written:
            os.replace(os.path.join(new, name), os.path.join(args.out, name))
        # out prepared before for another language pair: its token files go too
        for name in os.listdir(args.out):
            if SPLIT_FILE.fullmatch(name) and name not in written:
                os.remove(os.path.join(args.out, name))
    finally:
        shutil.rmtree(new, ignore_errors=True)
    pairs = meta['splits']['train']['pairs']
    print(f'wrote {args.out} in {meta["seconds"]:.1f}s: vocab {meta["vocab_size"]}, {pairs} pairs')
    return meta


def write_files(args, out, files, settings, given, vocab_size):
    """write_folder's files, into out -> meta."""
    os.environ.setdefault('RAYON_NUM_THREADS', str(args.workers))  # rustbpe's thread pool
    expect = dict(LINES)  # WMT14's published counts: a member of another is named before the BPE
    list(read_pairs(files['valid'] + files['test'], expect))  # so is a missing or short one
    t0 = time.time()
    if given:
        tok = given
    else:
        texts = bpe_texts(files['train'], expect, vocab_size, t0)
        tok = train_tokenizer(texts, vocab_size, f'{args.corpus}_{args.src}_{args.tgt}')
    checkpoint.write_json(os.path.join(out, 'tokenizer.json'), tok)
    enc = dataset.load_tokenizer(tok)
    bpe_seconds = time.time() - t0
    if given:
        origin = f'of --tokenizer {args.tokenizer}'
    else:
        origin = f'learned in {bpe_seconds:.1f}s'
    print(f'BPE: {len(tok["ranks"])} tokens of {vocab_size} asked (+ {len(SPECIALS)} specials), '
          + origin)
    langs = (args.src, args.tgt)
    stats = {}
    for split in files:
        stats[split] = write_split(out, split, files[split], enc, langs, args.workers,
                                   args.max_len, args.max_ratio, expect)
    splits = {}
    for split, s in stats.items():
        splits[split] = {'pairs': s['pairs'], 'src_tokens': s['tokens'][0],
                         'tgt_tokens': s['tokens'][1]}
    specials = tok['special_tokens']
    meta = {
        'name': os.path.basename(os.path.normpath(args.out)),
        'src': args.src,
        'tgt': args.tgt,
        'vocab_size': enc.n_vocab,
        'pad_id': specials['<pad>'],
        'bos_id': specials['<s>'],
        'eos_id': specials['</s>'],
        'dtype': 'uint16' if enc.n_vocab <= 2 ** 16 else 'uint32',
        'splits': splits,
        'raw_pairs': {split: s['raw'] for split, s in stats.items()},
        'dropped': stats['train']['dropped'],
        'max_len': args.max_len,
        'max_ratio': args.max_ratio,
        'bpe_seconds': round(bpe_seconds, 2),
        'seconds': round(time.time() - t0, 2),
        'settings': settings,
    }
    checkpoint.write_json(os.path.join(out, 'meta.json'), meta)
    return meta


def prepare(args, key):
    """Prepare args.out from the corpus `key`, unless it is prepared with these settings -> meta."""
    given = None
    vocab_size = args.vocab_size or DEFAULT_VOCAB[key]
    if args.tokenizer:
        given = given_tokenizer(args.tokenizer)
        vocab_size = len(given['ranks'])
    # before any download or BPE: an --out that is a file fails at once
    checkpoint.make_writable(args.out, '--out')
    files = source_files(args, key)
    settings = settings_of(args, files, vocab_size, given)
    # from the check of meta.json to writing it: one run at a time
    with locked(args.out, 'writing'):
        remove_leftovers(args.out)
        if not args.force:
            meta = prepared_meta(args.out, settings)
            if meta is not None:
                print(f'{args.out} is already prepared with these settings (--force to redo it)')
                return meta
        return write_folder(args, files, settings, given, vocab_size)

# -----------------------------------------------------------------------------------------------
# command line


def parse_args(argv):
    """-> (args, the key of CORPORA, or 'custom'); a wrong combination is a usage error."""
    description = 'Prepare a parallel corpus (see the docstring of data_prep.py).'
    p = argparse.ArgumentParser(description=description)
    p.add_argument('corpus', choices=['multi30k', 'wmt14', 'custom'])
    p.add_argument('--src', required=True, help='source language code, e.g. en')
    p.add_argument('--tgt', required=True, help='target language code, e.g. de')
    p.add_argument('--train', nargs='+', action='extend', metavar='PREFIX',
                   help='custom: training prefixes')
    p.add_argument('--valid', metavar='PREFIX', help='custom: validation files prefix')
    p.add_argument('--test', metavar='PREFIX', help='custom: test files prefix')
    p.add_argument('--mirror', metavar='DIR_OR_URL',
                   help='read the same file names from this folder or URL')
    p.add_argument('--vocab-size', type=int, default=0,
                   help='BPE tokens with the 256 bytes (0: 8000, WMT14 en-de 37000, en-fr 32000)')
    p.add_argument('--tokenizer', metavar='PATH',
                   help="a checkpoint's or data folder's BPE, to fine-tune on")
    p.add_argument('--out', help='output folder (default data/CORPUS_SRC_TGT)')
    p.add_argument('--max-len', type=int, default=250,
                   help='drop training pairs with a side over this many tokens (0: no limit)')
    p.add_argument('--max-ratio', type=float,
                   help='drop training pairs with one side over this many times the tokens of the '
                        'other (0: no limit; default 1.5 as fairseq, for Multi30k 0)')
    cores = os.cpu_count()
    if hasattr(os, 'sched_getaffinity'):  # the cores this process may run on
        cores = len(os.sched_getaffinity(0))
    p.add_argument('--workers', type=int, default=cores,
                   help='threads for BPE and encoding (all cores)')
    p.add_argument('--download-dir', default=os.path.join('data', 'downloads'),
                   help='where downloads stay')
    p.add_argument('--force', action='store_true',
                   help='redo even if OUT is prepared with these settings')
    args = p.parse_args(argv)
    if args.max_ratio is None:  # Multi30k's captions: every pair kept (docs/results.md)
        args.max_ratio = 0 if args.corpus == 'multi30k' else 1.5
    pair = '-'.join(sorted((args.src, args.tgt)))
    key = args.corpus if args.corpus in ('multi30k', 'custom') else f'{args.corpus} {pair}'
    custom = (args.train, args.valid, args.test)
    if args.src == args.tgt:  # they would write one file
        p.error(f'--src and --tgt are both {args.src!r}')
    if key not in CORPORA and key != 'custom':
        p.error(f'no {args.corpus} files for {pair}')
    if args.corpus == 'custom' and not all(custom):
        p.error('custom needs --train, --valid and --test')
    if args.corpus != 'custom' and any(custom):
        p.error(f'--train, --valid, --test are for custom, not {key}')
    if args.tokenizer and args.vocab_size:
        p.error('--vocab-size comes with the BPE, not with --tokenizer')
    if args.vocab_size and args.vocab_size < 256:
        p.error('--vocab-size counts the 256 bytes: at least 256')
    if args.max_len < 0 or not 0 <= args.max_ratio < float('inf'):
        p.error('--max-len, --max-ratio: >= 0')
    args.workers = max(1, args.workers)
    if not args.out:
        args.out = os.path.join('data', f'{args.corpus}_{args.src}_{args.tgt}')
    return args, key


def main(argv=None):
    args, key = parse_args(argv)
    try:
        return prepare(args, key)
    except OSError as e:  # a full disk, most likely; checkpoint.atomic() removed its temporaries
        sys.exit(f'error: writing {args.out}: {e.strerror or e}')


if __name__ == '__main__':
    checkpoint.stop_on_signals()
    try:
        main()
    except KeyboardInterrupt:  # each file is whole or absent; meta.json, written last, says done
        sys.exit("data_prep.py: interrupted; run the same command again")
