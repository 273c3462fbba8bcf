"""
Prepare a parallel corpus for train.py: fetch the files, read them, clean the training pairs, learn a joint
byte-level BPE (rustbpe), encode everything with tiktoken and write flat token files (format: README, Formats).

    python data_prep.py multi30k --src en --tgt de      # -> data/multi30k_en_de  (also --tgt fr)
    python data_prep.py wmt14 --src en --tgt de         # -> data/wmt14_en_de     (also --tgt fr)
    python data_prep.py custom --train PREFIX --valid PREFIX --test PREFIX --src xx --tgt yy --out data/mine
    python data_prep.py custom ... --tokenizer out/multi30k_en_de/ckpt.pt   # a checkpoint's BPE, to fine-tune it

Cleaning touches the training pairs only (valid and test are never filtered). It is Moses' clean-corpus-n.perl
applied to the BPE tokens, as fairseq's WMT14 recipe does (clean-corpus-n.perl -ratio 1.5 ... 1 250 on the BPE'd
text): a pair is dropped if a side is empty, if a side has more than --max-len tokens (so --max-len bounds what
the model sees), or if the longer side has more than --max-ratio times the tokens of the shorter one. Like Moses
there is no exception for short pairs: 1 token against 2 is a ratio of 2 and is dropped. On Multi30k the ratio
rule drops 773 of 29000 en-de pairs (2.7%) and 663 en-fr (2.3%); --max-ratio 0 keeps them.
Lines are split on '\\n' only; characters that Python's str.splitlines() would also break on (\\r, \\x85,
\\u2028, ...) are replaced by a space inside a line, so every later reader sees the same pairs.
"""
import argparse
import base64
import contextlib
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import sys
import tarfile
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import tiktoken
import urllib3

# -----------------------------------------------------------------------------------------------
# Where each corpus comes from. Per split, a list of (URL, member inside the archive or None for the file itself);
# '{lang}' is the language of the side being read, '{role}' is 'src' for the source side and 'ref' for the target.
# --mirror replaces everything before the file name. Keys: 'corpus' or 'corpus l1-l2' (sorted language codes).
MULTI30K = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/'
STATMT = 'http://statmt.org/'  # the URLs of fairseq's prepare-wmt14en2{de,fr}.sh
CORPORA = {
    'multi30k': {
        'train': [(MULTI30K + 'train.{lang}.gz', None)],
        'valid': [(MULTI30K + 'val.{lang}.gz', None)],
        'test': [(MULTI30K + 'test_2016_flickr.{lang}.gz', None)],
    },
    'wmt14 de-en': {  # the paper's en-de data: about 4.5M training pairs
        'train': [(STATMT + 'wmt13/training-parallel-europarl-v7.tgz', 'training/europarl-v7.de-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-commoncrawl.tgz', 'commoncrawl.de-en.{lang}'),
                  (STATMT + 'wmt14/training-parallel-nc-v9.tgz', 'training/news-commentary-v9.de-en.{lang}')],
        'valid': [(STATMT + 'wmt14/dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(STATMT + 'wmt14/test-full.tgz', 'test-full/newstest2014-deen-{role}.{lang}.sgm')],
    },
    'wmt14 en-fr': {  # the paper reports 36M sentence pairs
        'train': [(STATMT + 'wmt13/training-parallel-europarl-v7.tgz', 'training/europarl-v7.fr-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-commoncrawl.tgz', 'commoncrawl.fr-en.{lang}'),
                  (STATMT + 'wmt13/training-parallel-un.tgz', 'un/undoc.2000.fr-en.{lang}'),
                  (STATMT + 'wmt14/training-parallel-nc-v9.tgz', 'training/news-commentary-v9.fr-en.{lang}'),
                  (STATMT + 'wmt10/training-giga-fren.tar', 'giga-fren.release2.fixed.{lang}.gz')],
        'valid': [(STATMT + 'wmt14/dev.tgz', 'dev/newstest2013.{lang}')],
        'test': [(STATMT + 'wmt14/test-full.tgz', 'test-full/newstest2014-fren-{role}.{lang}.sgm')],
    },
}
DEFAULT_VOCAB = {'multi30k': 8000, 'wmt14 de-en': 37000, 'wmt14 en-fr': 32000, 'custom': 8000}  # incl. 256 bytes
# Optional pins, file name -> (size in bytes, sha256), checked after a download and for files in a local mirror.
# The Multi30k ones were taken from the copy in ../shared/data/multi30k (gzip headers dated 2017, as upstream).
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
}
LOCAL_MULTI30K = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'shared', 'data', 'multi30k')
# GPT-4's pre-tokenisation (also rustbpe's default), written out so the tokenizer is fully described here.
PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIALS = ('<pad>', '<s>', '</s>')
RETRY_WAIT = 2.0  # seconds before the first retry of a download, doubled each time
LINE_BREAKS = re.compile('[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')  # what str.splitlines() breaks on

# -----------------------------------------------------------------------------------------------
# download


def human(n):
    return f'{n / 1e6:.1f} MB'


def file_problem(path, name):
    """Compare a file with its CHECKSUMS entry, if any: -> None or what is wrong."""
    if name not in CHECKSUMS:
        return None
    size, sha = CHECKSUMS[name]
    if os.path.getsize(path) != size:
        return f'size {os.path.getsize(path)} bytes, expected {size}'
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return None if h.hexdigest() == sha else f'sha256 {h.hexdigest()}, expected {sha}'


def download(url, path, retries=5):
    """Stream url into path + '.part', resuming with an HTTP Range request after an interruption and retrying
    with backoff; the file gets its final name only when it has every byte announced (and matches CHECKSUMS).
    A resumed request carries If-Range with the validator (ETag or Last-Modified) of the response the .part
    began with, so a file changed on the server since is sent whole instead of appended to the old bytes."""
    if os.path.exists(path):  # only ever renamed into place complete and verified
        return path
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    name, part, tag = os.path.basename(path), path + '.part', path + '.part.validator'

    def drop():  # the .part and its validator go together
        for f in (part, tag):
            if os.path.exists(f):
                os.remove(f)
    total = CHECKSUMS.get(name, (None,))[0]
    for attempt in range(retries + 1):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if total is not None and have == total:
            break
        error, t0, shown, start = None, time.time(), 0.0, have
        headers = {'Accept-Encoding': 'identity', **({'Range': f'bytes={have}-'} if have else {})}
        if have and os.path.exists(tag):
            headers['If-Range'] = open(tag, encoding='utf-8').read()
        try:
            with requests.get(url, headers=headers, stream=True, timeout=60) as r:
                if r.status_code == 416:  # nothing from byte `have` on: complete, or not a prefix of this file
                    m = re.fullmatch(r'bytes \*/(\d+)', r.headers.get('Content-Range', ''))
                    if m and int(m[1]) == have:
                        total = have
                        break
                    drop()
                    continue
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):  # retrying will not help
                    sys.exit(f'error: downloading {url}: HTTP {r.status_code} {r.reason}')
                r.raise_for_status()
                m = re.match(r'bytes (\d+)-\d+/(\d+)', r.headers.get('Content-Range', ''))
                if r.status_code != 206 or not m or int(m[1]) != have:
                    have = 0  # the server sent the whole file: rewrite the .part from the start
                length = r.headers.get('Content-Length')
                announced = int(m[2]) if have else (int(length) if length else None)
                if total is not None and announced is not None and announced != total:  # CHECKSUMS or last try
                    drop()
                    sys.exit(f'error: {url} is now {announced} bytes, expected {total}; run again to start anew')
                total = announced if announced is not None else total
                if not have:  # a weak ETag may not be used in If-Range (RFC 9110)
                    validator = next((v for v in (r.headers.get('ETag'), r.headers.get('Last-Modified'))
                                      if v and not v.startswith('W/')), None)
                    drop()
                    if validator:
                        with open(tag, 'w', encoding='utf-8') as f:
                            f.write(validator)
                with open(part, 'ab' if have else 'wb') as f:
                    # raw bytes: a server's Content-Encoding must not be undone into a .gz
                    for chunk in r.raw.stream(1 << 20, decode_content=False):
                        f.write(chunk)
                        have += len(chunk)
                        if time.time() - shown > 0.5 or (total and have == total):
                            shown, rate = time.time(), (have - start) / max(time.time() - t0, 1e-6)
                            print(f'\r{name}: {human(have)} of {human(total) if total else "?"} '
                                  f'at {human(rate)}/s ', end='', file=sys.stderr, flush=True)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            error = e
        if shown:
            print(file=sys.stderr)  # end the progress line
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if total is not None and have > total:
            drop()
            sys.exit(f'error: {url}: got {have} bytes, more than the {total} announced; removed {part}')
        if error is None and total is None:  # no length announced: a cut transfer looks whole, but not to gzip or tar
            error = archive_cut_short(part, name)
        if error is None and (total is None or have == total):
            break
        print(f'{name}: transfer interrupted at {have} of {total or "?"} bytes ({error or "connection closed"})',
              file=sys.stderr)
        if attempt < retries:
            wait = RETRY_WAIT * 2 ** attempt
            print(f'{name}: retry {attempt + 1} of {retries} in {wait:.0f}s', file=sys.stderr)
            time.sleep(wait)
    else:
        sys.exit(f'error: downloading {url} failed after {retries + 1} attempts ({error or "incomplete"}): '
                 f'{have} of {total or "?"} bytes in {part} (run again to resume)')
    problem = file_problem(part, name)
    if problem:
        drop()
        sys.exit(f'error: {url}: {problem}; removed the download, run again to fetch it anew')
    os.replace(part, path)
    drop()  # the validator
    return path


def archive_cut_short(path, name):
    """What shows that the .gz, .tgz or .tar at path ends before its last byte, or None."""
    try:
        if name.endswith(('.gz', '.tgz')):
            with gzip.open(path) as f:  # its end holds a length and CRC of all before
                while f.read(1 << 24):
                    pass
        elif name.endswith('.tar'):
            with tarfile.open(path, 'r:') as tar:  # each member's header says how long its data is
                for _ in tar:
                    pass
    except (OSError, EOFError, zlib.error, tarfile.TarError) as e:
        return f'the archive ends early: {e}'
    return None


def fetch(url, mirror, download_dir):
    """Local path of the file named by url, read from mirror (a folder or a base URL) when given."""
    name = url.rsplit('/', 1)[1]
    if mirror and not re.match(r'https?://', mirror):
        path = os.path.join(mirror, name)
        if not os.path.exists(path):
            sys.exit(f'error: {name} is not in the mirror folder {mirror}')
        problem = file_problem(path, name)
        if problem:
            sys.exit(f'error: {path}: {problem}')
        return path
    if mirror:
        url = mirror.rstrip('/') + '/' + name
    path = os.path.join(download_dir, name)
    if os.path.exists(path):  # ours were checked when downloaded; one put there by hand was not
        problem = file_problem(path, name)
        if problem:
            sys.exit(f'error: {path}: {problem}; remove it to download it anew')
    else:  # a folder of finished downloads may be read-only
        make_writable(download_dir, '--download-dir')  # not 6 failed attempts to open the .part
    with locked(download_dir, 'downloading into'):  # two runs would append to one .part (en-de and en-fr share files)
        return download(url, path)


def make_writable(folder, option):
    """Create folder if need be and check that it takes files: else a one-line error naming the option."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # a name of its own: two runs may check one folder at once
    except OSError as e:
        sys.exit(f'error: {option} {folder} cannot be created or written: {e.strerror}')

# -----------------------------------------------------------------------------------------------
# reading


def label(src):
    path, member = src
    return f'{path}:{member}' if member else path


def read_lines(path, member=None, errors='strict'):
    """Yield the lines of a plain, .gz or .sgm file, of a member of a .tar/.tgz (itself maybe .gz), or of
    stdin (path None), as str without the line ending; of an SGM file only the text of the <seg ...> lines,
    as sacreBLEU reads them. Each line as soon as it is read. Invalid UTF-8 is an error naming file and line,
    or with errors='replace' a warning and U+FFFD (translate.py: one line in must give one line out)."""
    where = label((path, member)) if path else '<stdin>'
    try:
        with (open(path, 'rb') if path else contextlib.nullcontext(sys.stdin.buffer)) as f:
            if member:
                tar = tarfile.open(fileobj=f, mode='r|*')  # streaming: stops reading at the member
                names = []
                for m in tar:
                    names.append(m.name)
                    if os.path.normpath(m.name) == os.path.normpath(member):
                        f = tar.extractfile(m)
                        break
                else:
                    sys.exit(f'error: {path} has no member {member} (it has: {", ".join(names[:20])})')
            name = member or path or ''
            sgm = name.endswith('.sgm')
            if name.endswith('.gz'):
                f = io.BufferedReader(gzip.GzipFile(fileobj=f), 1 << 20)  # C readline, not gzip's
            for i, raw in enumerate(f, 1):
                if i == 1 and raw.startswith(b'\xef\xbb\xbf'):
                    raw = raw[3:]  # a UTF-8 byte-order mark marks the encoding; it is not text
                try:
                    text = raw.decode('utf-8')
                except UnicodeDecodeError as e:
                    if errors != 'replace':
                        sys.exit(f'error: {where} line {i}: invalid UTF-8 ({e.reason} at byte {e.start})')
                    print(f'warning: {where}: line {i}: invalid UTF-8 at byte {e.start}, replaced with U+FFFD',
                          file=sys.stderr)
                    text = raw.decode('utf-8', errors='replace')
                line = LINE_BREAKS.sub(' ', text.rstrip('\n').rstrip('\r'))
                if sgm:
                    m = re.match(r'\s*<seg[^>]*>(.*)</seg>', line)
                    if not m and '<seg' not in line.lower():
                        continue
                    if not m or '<seg' in m[1].lower():  # read otherwise, a test sentence is lost or two are one
                        sys.exit(f'error: {where} line {i}: a <seg> that is not alone on its line, opened and closed')
                    line = ' '.join(m[1].split())
                yield line
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        sys.exit(f'error: cannot read {where}: {e}')


def read_pairs(files):
    """Yield (src, tgt) lines from a list of (src file, tgt file); files of different lengths are an error."""
    for s_file, t_file in files:
        s_it, t_it = read_lines(*s_file), read_lines(*t_file)
        n = 0
        for s, t in itertools.zip_longest(s_it, t_it):
            if s is None or t is None:
                ns = n + (s is not None) + sum(1 for _ in s_it)
                nt = n + (t is not None) + sum(1 for _ in t_it)
                sys.exit(f'error: line counts differ: {label(s_file)} has {ns} lines, {label(t_file)} has {nt}')
            n += 1
            yield s, t

# -----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts, vocab_size, name):
    """Joint byte-level BPE on an iterator of strings -> the JSON-able dict of tokenizer.json.
    vocab_size counts the 256 byte tokens; the specials come right after the merges."""
    import rustbpe  # here, not at the top: translating and training need only tiktoken
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts, vocab_size, pattern=PATTERN)
    ranks = sorted(((bytes(b), r) for b, r in tok.get_mergeable_ranks()), key=lambda br: br[1])
    assert [r for _, r in ranks] == list(range(len(ranks))), 'rustbpe ranks are not 0..n-1'
    return {'name': name, 'pattern': tok.get_pattern(),
            'ranks': [[base64.b64encode(b).decode('ascii'), r] for b, r in ranks],
            'special_tokens': {s: len(ranks) + i for i, s in enumerate(SPECIALS)}}


def given_tokenizer(source):
    """--tokenizer: the tokenizer dict of a tokenizer.json, a prepared data folder or a train.py checkpoint,
    instead of a BPE learned anew: data to fine-tune a checkpoint on must be encoded with its own ids."""
    if os.path.isdir(source) and not os.path.exists(os.path.join(source, 'tokenizer.json')):
        run = os.path.exists(os.path.join(source, 'ckpt.pt'))  # a train.py run's folder, not a data folder
        sys.exit(f"error: --tokenizer {source}: a folder without tokenizer.json{'; give its ckpt.pt' if run else ''}")
    try:
        if os.path.isdir(source) or source.endswith('.json'):
            tok = read_tokenizer(source)
        else:
            import translate  # torch, for a checkpoint only
            tok = translate.checkpoint_tokenizer(source, translate.read_checkpoint(source, keys=('tokenizer',)))
        load_tokenizer(tok)
        if not set(SPECIALS) <= set(tok['special_tokens']):
            raise ValueError(f"no {', '.join(SPECIALS)} among its special tokens")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f'error: --tokenizer {source}: not a tokenizer of data_prep.py ({type(e).__name__}: {e})')
    return tok


def same_tokenizer(a, b):
    # The name is a label (the data folder's); the pattern, merges and special tokens are the tokenizer.
    return {k: v for k, v in a.items() if k != 'name'} == {k: v for k, v in b.items() if k != 'name'}


def tokenizer_dict(data_dir):
    """The tokenizer of a prepared directory as a JSON-able dict (train.py embeds it in checkpoints)."""
    return read_json(os.path.join(data_dir, 'tokenizer.json'))


def read_json(path):
    with open(path, encoding='utf-8') as f:
        try:
            return json.load(f)
        except ValueError as e:  # which file, not only where in it
            raise ValueError(f"{path}: {e}") from None


def read_tokenizer(source):
    """The JSON-able dict of a tokenizer given as one, as a tokenizer.json, or as a prepared data directory."""
    if isinstance(source, dict):
        return source
    return tokenizer_dict(source) if os.path.isdir(source) else read_json(source)


def load_tokenizer(path_or_dict):
    """tiktoken.Encoding from a tokenizer dict, a tokenizer.json, or a prepared data directory."""
    d = read_tokenizer(path_or_dict)
    ranks, specials = {base64.b64decode(b): r for b, r in d['ranks']}, dict(d['special_tokens'])
    # tiktoken panics (an error no `except Exception` catches) or encodes wrongly on these, so say which.
    ids = list(ranks.values()) + list(specials.values())
    if len(ranks) != len(d['ranks']) or len(set(ids)) != len(ids):
        raise ValueError('a token or an id appears twice among its ranks and special tokens')
    if any(bytes([i]) not in ranks for i in range(256)):
        raise ValueError('not every one of the 256 bytes is a token, so some text cannot be encoded')
    return tiktoken.Encoding(name=d.get('name', 'data_prep'), pat_str=d['pattern'],
                             mergeable_ranks=ranks, special_tokens=specials)

# -----------------------------------------------------------------------------------------------
# cleaning and writing


def load_meta(data_dir):
    """A prepared directory's meta.json: languages, vocabulary size, special ids, token dtype, split sizes."""
    meta = read_json(os.path.join(data_dir, 'meta.json'))
    if not isinstance(meta, dict):
        raise ValueError(f"{os.path.join(data_dir, 'meta.json')}: not a JSON object")
    return meta


def load_split(data_dir, split):
    """A prepared split -> (src tokens, src offsets, tgt tokens, tgt offsets): sentence i of a side is
    tokens[offsets[i]:offsets[i + 1]], memory-mapped, without BOS/EOS."""
    try:
        meta = load_meta(data_dir)
        sides = []
        for lang in (meta['src'], meta['tgt']):
            path = os.path.join(data_dir, f'{split}.{lang}.bin')  # no bytes: a side of empty lines, not an error
            sides.append(np.memmap(path, dtype=meta['dtype'], mode='r') if os.path.getsize(path) else
                         np.zeros(0, meta['dtype']))
            sides.append(np.fromfile(os.path.join(data_dir, f'{split}.{lang}.idx'), dtype=np.int64))
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a dtype numpy does not know
        sys.exit(f'error: {data_dir} is incomplete or damaged ({split}: {e}): prepare it again with data_prep.py')
    # A truncated .bin would otherwise load, and batches would read past its end (collate clamps).
    for lang, tokens, offsets in ((meta['src'], *sides[:2]), (meta['tgt'], *sides[2:])):
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any():
            sys.exit(f'error: {data_dir} is incomplete or damaged ({split}.{lang}.idx does not match the '
                     f'{len(tokens)} tokens of {split}.{lang}.bin): prepare it again with data_prep.py')
    if len(sides[1]) != len(sides[3]):
        sys.exit(f'error: {data_dir} is incomplete or damaged ({split}: {len(sides[1]) - 1} {meta["src"]} and '
                 f'{len(sides[3]) - 1} {meta["tgt"]} sentences): prepare it again with data_prep.py')
    return tuple(sides)


def token_batches(sizes, order, max_tokens):
    """fairseq's token-based batching: consecutive runs of `order` (indices into sizes, which the caller
    sorts by length so that a batch holds similar lengths and little padding), each as long as its count
    times its largest size, the padded tokens it holds, stays within max_tokens. An item over max_tokens
    on its own is a batch by itself (train.py leaves those out beforehand)."""
    order = np.asarray(order, dtype=np.int64)
    batches, start, biggest = [], 0, 0
    for i, size in enumerate(np.asarray(sizes)[order].tolist()):
        if i > start and (i + 1 - start) * max(biggest, size) > max_tokens:
            batches.append(order[start:i])
            start, biggest = i, 0
        biggest = max(biggest, size)
    if len(order):
        batches.append(order[start:])
    return batches


def pair_sizes(data):
    """The padded tokens a pair of a split from load_split takes per side: its longer side + EOS (or BOS)."""
    _, src_idx, _, tgt_idx = data
    return np.maximum(np.diff(src_idx), np.diff(tgt_idx)) + 1


def batch_plan(data, max_tokens, seed, epoch, shuffle=True):
    """train.py's batches of one epoch, as fairseq builds them: sentences shuffled, then stably sorted by
    length (so batches hold similar lengths and little padding), filled up to max_tokens padded tokens,
    and the batches shuffled. The same seed and epoch give the same plan on every rank."""
    size = pair_sizes(data)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(size)) if shuffle else np.arange(len(size))
    order = order[np.argsort(size[order], kind='stable')]
    order = order[size[order] <= max_tokens]  # longer pairs fit no batch (train.py reports them at start)
    batches = token_batches(size, order, max_tokens)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def collate(data, ids, pad_id, bos_id, eos_id):
    """Pairs ids of a split from load_split -> int64 arrays src (+ EOS), tgt_in (BOS +) and tgt_out (+ EOS),
    each padded to its longest row. One gather per side, no loop over rows: at 25k tokens per batch a
    GPU step takes ~25 ms, and a per-row loop took 8 ms of it (README, Scale)."""
    src_tok, src_idx, tgt_tok, tgt_idx = data
    ids, rows = np.asarray(ids, dtype=np.int64), np.arange(len(ids))

    def side(tok, idx):  # each row's tokens, padded to the longest + 1; and the lengths
        start, n = idx[ids], idx[ids + 1] - idx[ids]
        cols = np.arange(n.max() + 1)
        at = np.minimum(start[:, None] + cols, max(len(tok) - 1, 0))
        return np.where(cols < n[:, None], tok[at] if len(tok) else 0, pad_id).astype(np.int64), n

    (src, n_src), (tgt, n_tgt) = side(src_tok, src_idx), side(tgt_tok, tgt_idx)
    tgt_in = np.full_like(tgt, pad_id)
    tgt_in[:, 0], tgt_in[:, 1:] = bos_id, tgt[:, :-1]
    src[rows, n_src] = eos_id
    tgt[rows, n_tgt] = eos_id
    return src, tgt_in, tgt


def clean_mask(ls, lt, max_len, max_ratio):
    """Moses' clean-corpus-n rules on token counts, checked in its order (each pair counted for its first
    failed rule): -> (keep mask, {'empty', 'too_long', 'ratio'} counts). max_len or max_ratio 0 disables a rule."""
    empty = (ls == 0) | (lt == 0)
    too_long = ~empty & ((ls > max_len) | (lt > max_len)) if max_len > 0 else np.zeros_like(empty)
    ratio = (~empty & ~too_long & (np.maximum(ls, lt) > max_ratio * np.minimum(ls, lt)) if max_ratio > 0
             else np.zeros_like(empty))
    return ~(empty | too_long | ratio), {'empty': int(empty.sum()), 'too_long': int(too_long.sum()),
                                         'ratio': int(ratio.sum())}


def encode_lines(enc, lines, workers):
    """-> (token ids of all lines, one after the other, as uint32; number of tokens of each line).
    Each thread encodes one long string of lines joined by '</s>': tiktoken splits at special tokens before its
    regex, so the ids are exactly those of encoding each line alone, and it runs ~10x faster on sentences than
    encode_ordinary_batch(lines), whose per-line hand-off to a thread pool costs more than the encoding itself."""
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
        return np.fromiter(itertools.chain.from_iterable(per_line), np.uint32), np.array([len(x) for x in per_line])
    return ids[ids != eos], np.diff(ends, prepend=-1) - 1


def finish(files, out):
    """Close temporary files and give them their final names: only now can a reader mistake them for done."""
    for name, f in files.items():
        f.flush()
        os.fsync(f.fileno())
        f.close()
    for name in files:
        os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name))


def write_split(out, split, pairs, enc, langs, workers, max_len=0, max_ratio=0, chunk=50_000):
    """Encode a split chunk by chunk on all workers into {split}.{lang}.bin / .idx (and the raw .txt for
    valid/test) under temporary names, renamed when the split is complete; cleans train. -> counts."""
    train, dtype = split == 'train', np.uint16 if enc.n_vocab <= 2 ** 16 else np.uint32
    exts = ('bin', 'idx') if train else ('bin', 'idx', 'txt')
    names = [f'{split}.{lang}.{ext}' for lang in langs for ext in exts]
    files = {name: open(os.path.join(out, name + '.tmp'), 'wb') for name in names}
    stats = {'raw': 0, 'pairs': 0, 'tokens': [0, 0], 'dropped': {'empty': 0, 'too_long': 0, 'ratio': 0}}
    lengths, t0 = [[], []], time.time()
    try:
        it = iter(pairs)
        while batch := list(itertools.islice(it, chunk)):
            ids, lens = [], []
            for lang, lines in zip(langs, zip(*batch)):
                if not train:  # the untouched text, for BLEU against references
                    files[f'{split}.{lang}.txt'].write(''.join(line + '\n' for line in lines).encode('utf-8'))
                x, n = encode_lines(enc, [line.strip() for line in lines], workers)
                ids.append(x)
                lens.append(n)
            keep = np.ones(len(batch), dtype=bool)
            if train:
                keep, dropped = clean_mask(lens[0], lens[1], max_len, max_ratio)
                for k, v in dropped.items():
                    stats['dropped'][k] += v
            for i, lang in enumerate(langs):
                n = lens[i][keep]
                files[f'{split}.{lang}.bin'].write(ids[i][np.repeat(keep, lens[i])].astype(dtype).tobytes())
                lengths[i].append(n.astype(np.int32))
                stats['tokens'][i] += int(n.sum())
            stats['raw'] += len(batch)
            stats['pairs'] += int(keep.sum())
            if stats['raw'] // 1_000_000 > (stats['raw'] - len(batch)) // 1_000_000:
                print(f'{split}: {stats["raw"]:,} pairs encoded, {time.time() - t0:.0f}s', flush=True)
        for i, lang in enumerate(langs):
            n = np.concatenate(lengths[i]) if lengths[i] else np.zeros(0, np.int32)
            idx = np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).astype(np.int64)
            files[f'{split}.{lang}.idx'].write(idx.tobytes())
        finish(files, out)
    except OSError as e:  # a full disk, most likely: free what this split took, and say so in one line
        for name, f in files.items():
            with contextlib.suppress(OSError):  # its flush fails again; the descriptor is closed all the same
                f.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name + '.tmp'))
        sys.exit(f'error: writing {out}: {e.strerror or e}')
    except BaseException:  # interrupted: the next run removes the .tmp files
        for f in files.values():
            f.close()
        raise
    dt = time.time() - t0
    print(f'{split}: {stats["raw"]} pairs ({2 * stats["raw"]} lines) read, encoded and written in {dt:.1f}s: '
          f'{2 * stats["raw"] / max(dt, 1e-9):,.0f} lines/s; kept {stats["pairs"]}, '
          f'{stats["tokens"][0]} + {stats["tokens"][1]} tokens')
    return stats


def lock_folder(folder, busy=None):
    """An exclusive flock on folder, held until the returned descriptor is closed or the process ends (the
    kernel releases it then, so a killed run leaves no stale lock). Held by another process: print busy and
    wait for it, or with busy=None raise BlockingIOError. None where there is no flock (Windows; Lustre
    mounted noflock: ENOSYS): runs into folder are then not kept apart, and a warning says so."""
    if os.name != 'posix':
        return None
    import fcntl
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if busy is None:
            os.close(fd)
            raise
        print(busy, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        os.close(fd)
        print(f'warning: {folder} cannot be locked ({e.strerror}): a second run into it is not kept out')
        return None
    return fd


@contextlib.contextmanager
def locked(folder, doing):
    """Keep other data_prep.py runs out of folder until the block ends: a second run into the same folder
    would delete this one's temporary files and rename its own half-written ones into place. It waits here
    instead."""
    fd = lock_folder(folder, f'another data_prep.py is {doing} {folder}: waiting for it to finish')
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def write_json(path, obj):
    try:
        with open(path + '.tmp', 'w', encoding='utf-8') as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + '.tmp', path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + '.tmp')
        sys.exit(f'error: writing {path}: {e.strerror or e}')

# -----------------------------------------------------------------------------------------------
# main


def source_files(args, key):
    """-> {split: [((path, member), (path, member)), ...]} with every remote file fetched first."""
    if args.corpus == 'custom':
        def locate(prefix, lang):
            for path in (f'{prefix}.{lang}', f'{prefix}.{lang}.gz'):
                if os.path.exists(path):
                    return path, None
            sys.exit(f'error: neither {prefix}.{lang} nor {prefix}.{lang}.gz exists')
        prefixes = {'train': args.train, 'valid': [args.valid], 'test': [args.test]}
        return {split: [(locate(p, args.src), locate(p, args.tgt)) for p in ps] for split, ps in prefixes.items()}
    mirror = args.mirror
    if mirror is None and args.corpus == 'multi30k' and os.path.isdir(LOCAL_MULTI30K):
        mirror = os.path.normpath(LOCAL_MULTI30K)  # machines here have no internet
        print(f'no --mirror given: reading Multi30k from the local copy {mirror}')
    return {split: [tuple((fetch(url.format(lang=lang, role=role), mirror, args.download_dir),
                           member and member.format(lang=lang, role=role))
                          for lang, role in ((args.src, 'src'), (args.tgt, 'ref'))) for url, member in entries]
            for split, entries in CORPORA[key].items()}


def prepare(args):
    key = args.corpus
    if key not in ('multi30k', 'custom'):
        key = f'{key} {"-".join(sorted((args.src, args.tgt)))}'
    if key not in CORPORA and key != 'custom':
        sys.exit(f'error: no {args.corpus} files for {args.src}-{args.tgt}; known: {", ".join(CORPORA)}')
    if args.corpus == 'custom' and not (args.train and args.valid and args.test):
        sys.exit('error: custom needs --train, --valid and --test prefixes')
    given = given_tokenizer(args.tokenizer) if args.tokenizer else None
    vocab_size = (len(given['ranks']) if given else DEFAULT_VOCAB[key] if args.vocab_size is None else
                  args.vocab_size)
    if not 256 <= vocab_size <= 2 ** 32 - len(SPECIALS):  # token ids are written as uint32 at most
        sys.exit(f'error: --vocab-size counts the 256 byte tokens, so it must be at least 256 (and at most '
                 f'{2 ** 32 - len(SPECIALS)})')
    if args.max_len < 0 or not args.max_ratio >= 0 or args.max_ratio == float('inf'):
        sys.exit('error: --max-len and --max-ratio must be at least 0 (0: no limit) and finite')
    args.workers = max(1, args.workers)
    name = f'{args.corpus}_{args.src}_{args.tgt}'
    out = args.out or os.path.join('data', name)
    make_writable(out, '--out')  # before any download or BPE: an --out that is a file fails at once
    files = source_files(args, key)
    settings = {'corpus': args.corpus, 'src': args.src, 'tgt': args.tgt, 'vocab_size': vocab_size,
                'max_len': args.max_len, 'max_ratio': args.max_ratio,
                'files': {split: [[label(s), label(t)] for s, t in fs] for split, fs in files.items()},
                # A file rewritten under its old name is another corpus: its size and time say so.
                'stamps': [list(x) for x in sorted({(p, os.stat(p).st_size, os.stat(p).st_mtime_ns)
                                                    for fs in files.values() for pair in fs for p, _ in pair})]}
    if given:  # by content: another tokenizer of the same size is another encoding
        merges = json.dumps({k: v for k, v in given.items() if k != 'name'}, sort_keys=True)
        settings['tokenizer'] = hashlib.sha256(merges.encode()).hexdigest()
    meta_path = os.path.join(out, 'meta.json')
    with locked(out, 'writing'):  # from the check of meta.json to writing it: one run at a time
        if os.path.isfile(meta_path) and not args.force:
            try:
                meta = load_meta(out)
            except (OSError, ValueError) as e:
                print(f'{e}: preparing {out} again')
                meta = {}
            names = ['tokenizer.json'] + [f'{split}.{lang}.{ext}' for split in ('train', 'valid', 'test')
                                          for lang in (args.src, args.tgt) for ext in ('bin', 'idx', 'txt')
                                          if split != 'train' or ext != 'txt']
            gone = [n for n in names if not os.path.isfile(os.path.join(out, n))]
            if meta.get('settings') == settings and gone:  # else "already prepared" beside a broken folder
                print(f'{out} lacks {", ".join(gone[:3])}: preparing it again')
            elif meta.get('settings') == settings:
                print(f'{out} is already prepared with these settings (--force to redo it)')
                return meta
        os.makedirs(out, exist_ok=True)
        if os.path.isdir(meta_path):
            sys.exit(f'error: {meta_path} is a folder; remove it to prepare {out} here')
        if os.path.exists(meta_path):
            os.remove(meta_path)  # meta.json marks a finished directory: from here on this one is not
        for f in os.listdir(out):
            # leftovers of a killed run, by the names write_split and write_json give: not others' .tmp files
            if re.fullmatch(r'(train|valid|test)\..+\.(bin|idx|txt)\.tmp|(tokenizer|meta)\.json\.tmp', f):
                os.remove(os.path.join(out, f))
        os.environ.setdefault('RAYON_NUM_THREADS', str(args.workers))  # rustbpe's thread pool

        for split in ('valid', 'test'):  # small files: one missing is found now, not after hours of BPE and encoding
            for pair in files[split]:
                for source in pair:
                    next(read_lines(*source), None)
        t0 = time.time()
        def texts():  # what BPE learns from, with a progress line per million pairs read
            i = 0
            for i, pair in enumerate(read_pairs(files['train']), 1):
                if i % 1_000_000 == 0:
                    print(f'BPE: {i:,} training pairs read, {time.time() - t0:.0f}s', flush=True)
                yield from (text for text in map(str.strip, pair) if text)
            # rustbpe reports nothing while it merges, minutes on WMT14: say what it is doing
            print(f'BPE: {i:,} training pairs read in {time.time() - t0:.0f}s; learning {vocab_size - 256} merges',
                  flush=True)
        tok = given or train_tokenizer(texts(), vocab_size, name)
        write_json(os.path.join(out, 'tokenizer.json'), tok)
        enc = load_tokenizer(tok)
        bpe_seconds = time.time() - t0
        print(f'BPE: {len(tok["ranks"])} tokens (+ {len(SPECIALS)} specials) '
              + (f'of --tokenizer {args.tokenizer}' if given else f'learned in {bpe_seconds:.1f}s'))
        if len(tok['ranks']) < vocab_size:
            print(f'warning: the training text holds no more merges: {len(tok["ranks"])} tokens of the {vocab_size} '
                  'asked')

        langs, splits, raw, dropped = (args.src, args.tgt), {}, {}, {}
        for split in ('train', 'valid', 'test'):
            clean = {'max_len': args.max_len, 'max_ratio': args.max_ratio} if split == 'train' else {}
            st = write_split(out, split, read_pairs(files[split]), enc, langs, args.workers, **clean)
            if st['pairs'] == 0:
                names = ', '.join(f'{label(s)} / {label(t)}' for s, t in files[split])
                why = f" ({st['raw']} read, all dropped: {st['dropped']})" if st['raw'] else ''
                sys.exit(f'error: the {split} split has no sentence pairs{why}: {names}')
            splits[split] = {'pairs': st['pairs'], 'src_tokens': st['tokens'][0], 'tgt_tokens': st['tokens'][1]}
            raw[split] = st['raw']
            if split == 'train':
                dropped = st['dropped']
                print(f'train: dropped {dropped["empty"]} empty pairs, {dropped["too_long"]} over {args.max_len} '
                      f'tokens, {dropped["ratio"]} with a length ratio over {args.max_ratio}')
        specials = tok['special_tokens']
        meta = {'name': os.path.basename(os.path.normpath(out)), 'src': args.src, 'tgt': args.tgt,
                'vocab_size': enc.n_vocab, 'pad_id': specials['<pad>'], 'bos_id': specials['<s>'],
                'eos_id': specials['</s>'], 'dtype': 'uint16' if enc.n_vocab <= 2 ** 16 else 'uint32',
                'splits': splits, 'raw_pairs': raw, 'dropped': dropped, 'max_len': args.max_len,
                'max_ratio': args.max_ratio, 'bpe_seconds': round(bpe_seconds, 2),
                'seconds': round(time.time() - t0, 2), 'settings': settings}
        write_json(meta_path, meta)  # last: its presence says the directory is complete
        print(f'wrote {out} in {time.time() - t0:.1f}s: vocab {enc.n_vocab}, {splits["train"]["pairs"]} training pairs')
        return meta


def main(argv=None):
    p = argparse.ArgumentParser(description='Prepare a parallel corpus (see the docstring of data_prep.py).')
    p.add_argument('corpus', choices=['multi30k', 'wmt14', 'custom'])
    p.add_argument('--src', required=True, help='source language code, e.g. en')
    p.add_argument('--tgt', required=True, help='target language code, e.g. de')
    p.add_argument('--train', nargs='+', action='extend', metavar='PREFIX',  # --train a --train b: both
                   help='custom: PREFIX.src / PREFIX.tgt (or .gz), 1 or more')
    p.add_argument('--valid', metavar='PREFIX', help='custom: validation files prefix')
    p.add_argument('--test', metavar='PREFIX', help='custom: test files prefix')
    p.add_argument('--mirror', metavar='DIR_OR_URL', help='read the same file names from this folder or base URL')
    p.add_argument('--vocab-size', type=int, help='BPE vocabulary incl. the 256 bytes, excl. the 3 specials '
                   '(default 8000 Multi30k and custom, 37000 WMT14 en-de, 32000 en-fr)')
    p.add_argument('--tokenizer', metavar='PATH', help="encode with this BPE instead of learning one: a checkpoint's "
                   '(to fine-tune it), a prepared data folder or its tokenizer.json')
    p.add_argument('--out', help='output directory (default data/CORPUS_SRC_TGT)')
    p.add_argument('--max-len', type=int, default=250, help='drop training pairs with a side over this many BPE '
                   'tokens, 0: no limit (default 250, as fairseq\'s WMT14 recipe)')
    p.add_argument('--max-ratio', type=float, default=1.5, help='drop training pairs whose longer side has more '
                   'than this times the tokens of the shorter (Moses -ratio 1.5), 0: keep all')
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    p.add_argument('--workers', type=int, default=cores, help='threads for BPE training and encoding (all cores)')
    p.add_argument('--download-dir', default=os.path.join('data', 'downloads'), help='where downloads are kept')
    p.add_argument('--force', action='store_true', help='redo even if OUT is already prepared with these settings')
    args = p.parse_args(argv)
    for option, code in (('--src', args.src), ('--tgt', args.tgt)):  # part of file names: train.{code}.bin
        if not code or os.sep in code or (os.altsep and os.altsep in code) or code in ('.', '..'):
            p.error(f'{option} {code!r} is not a language code')
    if args.src == args.tgt:  # the two sides would be written into one file
        p.error(f'--src and --tgt are both {args.src!r}')
    if args.tokenizer and args.vocab_size is not None:
        p.error('--vocab-size is learned with the BPE, not given with --tokenizer (which has its own)')
    if args.corpus != 'custom' and (args.train or args.valid or args.test):  # not quietly the named corpus instead
        p.error(f'--train, --valid and --test are for custom, not {args.corpus}')
    return prepare(args)


if __name__ == '__main__':
    main()
