"""Tests of data_prep.py and dataset.py; no internet: a throwaway HTTP server on 127.0.0.1 plays
statmt.org / GitHub.
    python -m pytest -q test_data_prep.py"""
import errno
import gzip
import hashlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import checkpoint
import data_prep
import dataset
from test_translate import reading

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the root: the scripts
M30K_EN_DE = ['multi30k', '--src', 'en', '--tgt', 'de']
WMT14_EN_DE = ['wmt14', '--src', 'en', '--tgt', 'de']

# -----------------------------------------------------------------------------------------------
# helpers: a Range-capable HTTP server, toy corpora, archives laid out like the real ones


class Handler(BaseHTTPRequestHandler):
    """Serves server.files[path], honouring 'Range: bytes=N-' (unless server.no_range).
    server.cut[path] = K sends K bytes of the next response to path, then drops the connection
    (server.always_cut: every one); server.pause[path] = Event sends half of the next response,
    then waits for the event."""

    def do_GET(self):
        srv = self.server
        path = self.path.lstrip('/')
        rng = self.headers.get('Range')
        srv.log.append((path, rng))
        if path not in srv.files:
            self.send_error(404)
            return
        data = srv.files[path]
        ranged = rng and not srv.no_range
        start = 0
        if ranged:
            start = int(re.fullmatch(r'bytes=(\d+)-', rng)[1])
            if start >= len(data):
                self.send_response(416)
                self.send_header('Content-Range', f'bytes */{len(data)}')
                self.send_header('Content-Length', '0')
                self.end_headers()
                return
        self.send_response(206 if ranged else 200)
        if ranged:
            self.send_header('Content-Range', f'bytes {start}-{len(data) - 1}/{len(data)}')
        self.send_header('Content-Length', str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if path in srv.pause:
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            srv.pause.pop(path).wait()
            body = body[len(body) // 2:]
        cut = srv.cut.pop(path, srv.always_cut)
        if cut is not None:
            body = body[:cut]
        self.wfile.write(body)  # then HTTP/1.0 closes the connection

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv('NO_PROXY', '127.0.0.1')  # a CI proxy must not see these requests
    monkeypatch.setenv('no_proxy', '127.0.0.1')
    monkeypatch.setattr(data_prep, 'RETRY_WAIT', 0.0)
    srv = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    srv.files = {}
    srv.cut = {}
    srv.pause = {}
    srv.always_cut = None
    srv.no_range = False
    srv.log = []
    srv.url = f'http://127.0.0.1:{srv.server_port}/'
    threading.Thread(target=srv.serve_forever, args=(0.01,), daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


EN = ('a the dog cat man woman girl boy runs sits jumps on in under with red blue big small '
      'street park ball').split()
DE = ('ein der Hund Katze Mann Frau Mädchen Junge läuft sitzt springt auf in unter mit rote blaue '
      'große kleine Straße Park Ball').split()


def toy_pairs(n, seed):
    """Word-for-word 'translations' with umlauts, 2-14 words."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        ids = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 14))]
        en = ' '.join(EN[i] for i in ids).capitalize() + '.'
        de = ' '.join(DE[i] for i in ids) + '.'
        pairs.append((en, de))
    return pairs


def text(lines):
    return ''.join(line + '\n' for line in lines).encode('utf-8')


def side(pairs, i):
    """The file of side i (0: source, 1: target) of pairs."""
    return text(p[i] for p in pairs)


def tgz(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w:gz') as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sgm(lines):
    segs = ''.join(f'<seg id="{i}"> {line} </seg>\n' for i, line in enumerate(lines, 1))
    doc = f'<srcset setid="newstest2014">\n<doc docid="d1">\n<p>\n{segs}</p>\n</doc>\n</srcset>\n'
    return doc.encode()


def wmt14_de_en_archives():
    """The five en-de archives with the real names and member layout (and decoy members before
    ours) -> (files, training pairs, valid pairs, test pairs)."""
    train = [toy_pairs(60, 1), toy_pairs(50, 2), toy_pairs(40, 3)]
    valid = toy_pairs(30, 4)
    test = toy_pairs(25, 5)
    europarl = {
        'training/europarl-v7.cs-en.cs': b'decoy\n',
        'training/europarl-v7.de-en.de': side(train[0], 1),
        'training/europarl-v7.de-en.en': side(train[0], 0),
    }
    commoncrawl = {
        'commoncrawl.de-en.en': side(train[1], 0),
        'commoncrawl.de-en.de': side(train[1], 1),
    }
    news_commentary = {
        'training/news-commentary-v9.de-en.de': side(train[2], 1),
        'training/news-commentary-v9.de-en.en': side(train[2], 0),
    }
    dev = {
        'dev/newstest2012.en': b'decoy\n',
        'dev/newstest2013.en': side(valid, 0),
        'dev/newstest2013.de': side(valid, 1),
    }
    test_full = {}
    for role in ('src', 'ref'):
        for i, lang in enumerate(('en', 'de')):
            test_full[f'test-full/newstest2014-deen-{role}.{lang}.sgm'] = sgm(p[i] for p in test)
    files = {
        'training-parallel-europarl-v7.tgz': tgz(europarl),
        'training-parallel-commoncrawl.tgz': tgz(commoncrawl),
        'training-parallel-nc-v9.tgz': tgz(news_commentary),
        'dev.tgz': tgz(dev),
        'test-full.tgz': tgz(test_full),
    }
    return files, sum(train, []), valid, test


TOY_LINES = {  # those of wmt14_de_en_archives()
    'training/europarl-v7.de-en': 60,
    'commoncrawl.de-en': 50,
    'dev/newstest2013': 30,
    'training/news-commentary-v9.de-en': 40,
}


def as_published(monkeypatch, files, lines=TOY_LINES):
    """The toy archives taken for the real ones: test-full.tgz's md5 and the en-de members' line
    counts."""
    md5 = hashlib.md5(files['test-full.tgz']).hexdigest()
    monkeypatch.setitem(data_prep.CHECKSUMS, 'test-full.tgz', (None, md5))
    monkeypatch.setattr(data_prep, 'LINES', lines)


def write_mirror(folder, files):
    """files ({name: bytes}) written into a new mirror folder."""
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)


def write_custom(root, splits, src='xx', tgt='yy'):
    """splits: {name: [(src, tgt), ...]} -> files root/name.xx, root/name.yy."""
    for name, pairs in splits.items():
        (root / f'{name}.{src}').write_bytes(side(pairs, 0))
        (root / f'{name}.{tgt}').write_bytes(side(pairs, 1))


def custom_args(root, out, *extra, vocab_size='300'):
    """data_prep.py's arguments for the custom corpus of write_custom (vocab_size None: its
    default)."""
    args = ['custom', '--train', str(root / 'train'), '--valid', str(root / 'valid'),
            '--test', str(root / 'test'), '--src', 'xx', '--tgt', 'yy', '--out', str(out)]
    if vocab_size is not None:
        args += ['--vocab-size', vocab_size]
    return args + ['--workers', '2', *extra]


@pytest.fixture
def corpus(tmp_path):
    """A small custom corpus in tmp_path: train (50 pairs), valid, test."""
    splits = {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)}
    write_custom(tmp_path, splits)
    return tmp_path


def test_sigterm_stops_data_prep_as_ctrl_c_does_in_one_line(corpus, tmp_path):
    # kill or timeout while data_prep.py reads its training text (a FIFO nobody writes)
    os.remove(corpus / 'train.xx')
    os.mkfifo(corpus / 'train.xx')
    command = [sys.executable, os.path.join(HERE, 'data_prep.py'),
               *custom_args(corpus, tmp_path / 'out')]
    proc = subprocess.Popen(command, cwd=HERE, stderr=subprocess.PIPE, text=True)
    writer = reading(corpus / 'train.xx', proc)
    proc.send_signal(signal.SIGTERM)
    os.close(writer)  # a worker thread reading it ends, and the process with it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip() == 'data_prep.py: interrupted; run the same command again'
    assert not (tmp_path / 'out' / 'meta.json').exists()


def read_split(out, split, lang):
    """Decoded sentences of a prepared split, via meta.json's dtype and the .idx offsets."""
    meta = json.load(open(out / 'meta.json'))
    enc = dataset.load_tokenizer(str(out))
    ids = np.fromfile(out / f'{split}.{lang}.bin', dtype=meta['dtype'])
    idx = np.fromfile(out / f'{split}.{lang}.idx', dtype=np.int64)
    return [enc.decode(ids[idx[i]:idx[i + 1]].tolist()) for i in range(len(idx) - 1)]


def read_pairs(out, split, src, tgt):
    """The decoded (src, tgt) pairs of a prepared split."""
    return list(zip(read_split(out, split, src), read_split(out, split, tgt)))


def expected_kept(enc, pairs, max_len=250, max_ratio=1.5):
    """Moses' rules re-implemented independently, on per-line encode_ordinary counts."""
    kept = []
    for s, t in pairs:
        a = len(enc.encode_ordinary(s.strip()))
        b = len(enc.encode_ordinary(t.strip()))
        short_enough = max(a, b) <= max_len
        even_enough = not max_ratio or max(a, b) <= max_ratio * min(a, b)
        if a and b and short_enough and even_enough:
            kept.append((s.strip(), t.strip()))
    return kept


def contents(folder):
    """Every file of a prepared folder but meta.json (which holds timings), by name."""
    return {n: (folder / n).read_bytes() for n in os.listdir(folder) if n != 'meta.json'}

# -----------------------------------------------------------------------------------------------
# download


def test_a_cut_transfer_is_resumed_with_a_range_request_and_gives_the_exact_bytes(server, tmp_path):
    data = os.urandom(200_000)
    server.files['blob.bin'] = data
    server.cut['blob.bin'] = 70_000
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data and os.listdir(tmp_path) == ['blob.bin']
    assert [rng for _, rng in server.log] == ['bytes=0-', 'bytes=70000-']


def test_a_part_file_left_by_a_killed_run_is_resumed_or_renamed_when_whole(server, tmp_path):
    data = os.urandom(100_000)
    server.files['blob.bin'] = data
    blob = tmp_path / 'blob.bin'
    (tmp_path / 'blob.bin.part').write_bytes(data[:40_000])
    data_prep.download(server.url + 'blob.bin', str(blob))
    assert blob.read_bytes() == data and server.log == [('blob.bin', 'bytes=40000-')]
    blob.rename(tmp_path / 'blob.bin.part')  # killed between the last byte and the rename
    data_prep.download(server.url + 'blob.bin', str(blob))
    assert blob.read_bytes() == data and server.log[-1] == ('blob.bin', 'bytes=100000-')


def test_a_server_that_ignores_range_gets_the_part_file_rewritten(server, tmp_path):
    data = os.urandom(50_000)
    server.files['blob.bin'] = data
    server.no_range = True
    (tmp_path / 'blob.bin.part').write_bytes(b'x' * 20_000)
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data


def test_a_download_that_never_completes_fails_after_its_retries_and_keeps_the_part(server,
                                                                                     tmp_path):
    server.files['blob.bin'] = os.urandom(50_000)
    server.always_cut = 1000
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'), retries=2)
    assert '3000 of 50000 bytes' in str(e.value) and os.listdir(tmp_path) == ['blob.bin.part']


def test_a_download_that_never_connects_says_to_retry_and_names_no_part(tmp_path, monkeypatch):
    monkeypatch.setenv('NO_PROXY', '127.0.0.1')
    monkeypatch.setenv('no_proxy', '127.0.0.1')
    monkeypatch.setattr(data_prep, 'RETRY_WAIT', 0.0)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        data_prep.download(f'http://127.0.0.1:{port}/a.gz', str(tmp_path / 'a.gz'), retries=1)
    assert str(e.value).endswith('run again to retry')
    assert os.listdir(tmp_path) == []


def test_a_missing_file_on_the_server_fails_at_once(server, tmp_path):
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'nope.tgz', str(tmp_path / 'nope.tgz'))
    assert '404' in str(e.value) and len(server.log) == 1


@pytest.mark.parametrize('size, problem', [(12_345, '10000 bytes, expected 12345'),
                                           (10_000, 'sha256')])
def test_a_download_not_matching_checksums_is_an_error_and_removed(server, tmp_path, monkeypatch,
                                                                   size, problem):
    server.files['blob.bin'] = os.urandom(10_000)
    monkeypatch.setitem(data_prep.CHECKSUMS, 'blob.bin', (size, 'a' * 64))
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert problem in str(e.value) and os.listdir(tmp_path) == []


def test_a_file_another_run_is_downloading_is_waited_for_not_fetched_again(server, tmp_path):
    data = os.urandom(3_000_000)
    resume = threading.Event()
    paths = []
    server.files['blob.tgz'] = data
    server.pause['blob.tgz'] = resume

    def fetch():
        paths.append(data_prep.fetch(server.url + 'blob.tgz', None, str(tmp_path)))

    runs = [threading.Thread(target=fetch) for _ in range(2)]
    runs[0].start()
    part = tmp_path / 'blob.tgz.part'
    while not (part.exists() and part.stat().st_size):
        runs[0].join(timeout=0.01)  # until the first run has bytes in its .part
    runs[1].start()
    runs[1].join(timeout=0.5)  # a second run into the same download folder, e.g. en-de and en-fr
    resume.set()
    for run in runs:
        run.join()
    assert len(server.log) == 1 and paths == [str(tmp_path / 'blob.tgz')] * 2
    assert (tmp_path / 'blob.tgz').read_bytes() == data


def test_files_not_matching_checksums_are_refused_in_a_mirror_or_the_download_dir(server,
                                                                                  tmp_path):
    fake = gzip.compress(b'copied in by hand, not the real Multi30k\n')
    (tmp_path / 'train.en.gz').write_bytes(fake)
    for mirror, where in ((str(tmp_path), 'mirror'), (server.url, 'download dir')):
        args = ['--mirror', mirror, '--out', str(tmp_path / 'o'), '--download-dir', str(tmp_path)]
        with pytest.raises(SystemExit) as e:
            data_prep.main(M30K_EN_DE + args)
        assert str(tmp_path / 'train.en.gz') in str(e.value), where
        assert 'expected 568929' in str(e.value), where
    assert server.log == []


def test_a_download_dir_that_is_a_file_is_an_error_before_any_request(server, tmp_path):
    (tmp_path / 'taken').write_text('a file, not a folder\n')
    args = ['--mirror', server.url, '--out', str(tmp_path / 'o'),
            '--download-dir', str(tmp_path / 'taken')]
    with pytest.raises(SystemExit) as e:
        data_prep.main(M30K_EN_DE + args)
    assert '--download-dir' in str(e.value) and server.log == []


def test_test_full_tgz_is_checked_against_sacrebleus_md5(server, tmp_path, monkeypatch):
    data = tgz({'test-full/newstest2014-deen-src.en.sgm': sgm(['a b'])})
    server.files['test-full.tgz'] = data
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'test-full.tgz', str(tmp_path / 'test-full.tgz'))
    assert 'md5' in str(e.value)
    assert 'expected a8cd784e006feb32ac6f3d9ec7eb389a' in str(e.value)
    assert os.listdir(tmp_path) == []
    md5 = hashlib.md5(data).hexdigest()
    monkeypatch.setitem(data_prep.CHECKSUMS, 'test-full.tgz', (None, md5))
    path = data_prep.download(server.url + 'test-full.tgz', str(tmp_path / 'test-full.tgz'))
    assert open(path, 'rb').read() == data  # the same bytes, their md5 taken for sacrebleu's

# -----------------------------------------------------------------------------------------------
# end to end


def test_wmt14_layout_end_to_end_through_a_mirror_url(server, tmp_path, monkeypatch, capsys):
    files, train, valid, test = wmt14_de_en_archives()
    as_published(monkeypatch, files)
    for name, data in files.items():
        server.files['mirror/' + name] = data
    out = tmp_path / 'wmt'
    args = ['--mirror', server.url + 'mirror/', '--vocab-size', '300', '--out', str(out),
            '--download-dir', str(tmp_path / 'dl')]
    meta = data_prep.main(WMT14_EN_DE + args)
    assert meta['raw_pairs'] == {'train': len(train), 'valid': len(valid), 'test': len(test)}
    assert sorted(os.listdir(tmp_path / 'dl')) == sorted(files)
    assert len(server.log) == len(files)  # each fetched once
    enc = dataset.load_tokenizer(str(out))
    kept = expected_kept(enc, train)
    assert read_pairs(out, 'train', 'en', 'de') == kept
    dropped = sum(meta['dropped'].values())
    assert meta['splits']['train']['pairs'] == len(kept) == len(train) - dropped
    for split, pairs in (('valid', valid), ('test', test)):  # plain lines for valid, SGM for test
        for i, lang in enumerate(('en', 'de')):
            lines = (out / f'{split}.{lang}.txt').read_text('utf-8').splitlines()
            assert lines == [p[i] for p in pairs]
            assert read_split(out, split, lang) == [p[i] for p in pairs]
    assert meta['vocab_size'] == enc.n_vocab and meta['dtype'] == 'uint16'
    specials = (meta['pad_id'], meta['bos_id'], meta['eos_id'])
    assert specials == tuple(enc.n_vocab - 3 + i for i in range(3))
    assert 'warning' not in capsys.readouterr().err  # every member as long as published


def test_wmt14_members_of_another_line_count_than_published_are_named_before_the_bpe(
        tmp_path, monkeypatch, capsys):
    files, *_ = wmt14_de_en_archives()
    as_published(monkeypatch, files, dict(data_prep.LINES))  # the real counts: the toys fall short
    write_mirror(tmp_path / 'mirror', files)
    bpe = data_prep.train_tokenizer
    warned = []

    def read_then_learn(texts, *args):  # as rustbpe: all texts read before the first merge
        texts = list(texts)
        warned.append(capsys.readouterr().err)
        return bpe(iter(texts), *args)

    monkeypatch.setattr(data_prep, 'train_tokenizer', read_then_learn)
    args = ['--mirror', str(tmp_path / 'mirror'), '--vocab-size', '300',
            '--out', str(tmp_path / 'wmt')]
    data_prep.main(WMT14_EN_DE + args)
    warnings = [line for line in warned[0].splitlines() if line.startswith('warning')]
    assert len(warnings) == 4  # the 3 training members, dev
    published = 'commoncrawl.tgz:commoncrawl.de-en.en has 50 lines, not the 2,399,123 published'
    assert published in warned[0]
    assert 'warning' not in capsys.readouterr().err  # each said once, not again per split


def test_a_test_set_missing_from_its_archive_is_found_before_the_bpe(tmp_path, monkeypatch):
    files, *_ = wmt14_de_en_archives()
    only_en = {'test-full/newstest2014-deen-src.en.sgm': sgm(['a b'])}  # no German side
    files['test-full.tgz'] = tgz(only_en)
    as_published(monkeypatch, files)
    write_mirror(tmp_path / 'mirror', files)
    with pytest.raises(SystemExit) as e:
        data_prep.main(WMT14_EN_DE + ['--mirror', str(tmp_path / 'mirror'),
                                      '--out', str(tmp_path / 'wmt')])
    assert 'has no member test-full/newstest2014-deen-ref.de.sgm' in str(e.value)
    assert os.listdir(tmp_path / 'wmt') == []  # no BPE learned, nothing encoded: on WMT14, hours


def test_multi30k_from_a_mirror_folder_with_the_sides_swapped(tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, 'CHECKSUMS', {})  # these are not the real files
    splits = {'train': toy_pairs(80, 6), 'val': toy_pairs(12, 7),
              'test_2016_flickr': toy_pairs(11, 8)}
    files = {}
    for name, pairs in splits.items():
        for i, lang in enumerate(('en', 'de')):
            files[f'{name}.{lang}.gz'] = gzip.compress(side(pairs, i))
    write_mirror(tmp_path / 'mirror', files)
    args = ['multi30k', '--src', 'de', '--tgt', 'en', '--mirror', str(tmp_path / 'mirror'),
            '--vocab-size', '300', '--max-ratio', '1.5', '--out', str(tmp_path / 'out')]
    meta = data_prep.main(args)
    assert meta['raw_pairs'] == {'train': 80, 'valid': 12, 'test': 11} and meta['max_ratio'] == 1.5
    assert read_split(tmp_path / 'out', 'valid', 'de') == [p[1] for p in splits['val']]


def test_real_multi30k_en_de_keeps_every_pair_unless_a_ratio_is_asked(multi30k_en_de):
    out, meta = multi30k_en_de
    assert meta['raw_pairs'] == {'train': 29000, 'valid': 1014, 'test': 1000}
    assert meta['vocab_size'] == 8003
    assert meta['dropped'] == {'empty': 0, 'too_long': 0, 'ratio': 0}
    assert meta['splits']['train']['pairs'] == 29000
    data = dataset.load_split(out, 'train')
    lengths = (np.diff(data[1]), np.diff(data[3]))  # what --max-ratio 1.5 reads
    # fairseq's WMT rule would drop 773 pairs: captions differ in length
    dropped = data_prep.clean_mask(*lengths, 250, 1.5)[1]
    assert dropped == {'empty': 0, 'too_long': 0, 'ratio': 773}
    path = os.path.join(data_prep.LOCAL_MULTI30K, 'test_2016_flickr.de.gz')
    ref = gzip.decompress(open(path, 'rb').read()).decode('utf-8')
    assert (out / 'test.de.txt').read_text('utf-8') == ref
    assert read_split(out, 'test', 'de') == [line.strip() for line in ref.splitlines()]

# -----------------------------------------------------------------------------------------------
# cleaning


def test_clean_mask_follows_moses_order_and_has_no_short_sentence_exception():
    ls = np.array([0, 3, 300, 300, 1, 2, 10, 2, 4])
    lt = np.array([5, 0, 10, 0, 2, 3, 15, 1, 7])
    keep, dropped = data_prep.clean_mask(ls, lt, max_len=250, max_ratio=1.5)
    # empty, empty, too long, empty (first rule wins), 1:2 ratio 2, 2:3 = 1.5 kept, 10:15 kept,
    # 2:1, 4:7
    assert keep.tolist() == [False, False, False, False, False, True, True, False, False]
    assert dropped == {'empty': 3, 'too_long': 1, 'ratio': 3}
    keep, dropped = data_prep.clean_mask(ls, lt, max_len=0, max_ratio=0)  # 0 disables both
    assert dropped == {'empty': 3, 'too_long': 0, 'ratio': 0} and keep.sum() == 6


def test_cleaning_drops_training_pairs_only_and_counts_each_rule(tmp_path):
    bad = [('', 'leer'), ('empty target', '  '), ('the dog ' * 40, 'der Hund ' * 40),
           ('a', 'ein großer roter Hund läuft im Park'), ('Yes.', 'Ja.')]
    train = toy_pairs(100, 16) + bad
    valid = toy_pairs(6, 17) + bad
    write_custom(tmp_path, {'train': train, 'valid': valid, 'test': bad})
    out = tmp_path / 'out'
    meta = data_prep.main(custom_args(tmp_path, out, '--max-len', '30'))
    kept = expected_kept(dataset.load_tokenizer(str(out)), train, max_len=30)
    assert read_pairs(out, 'train', 'xx', 'yy') == kept
    dropped = meta['dropped']
    assert dropped['empty'] == 2 and dropped['too_long'] >= 1 and dropped['ratio'] >= 1
    assert sum(dropped.values()) == len(train) - len(kept) == 105 - meta['splits']['train']['pairs']
    for split, pairs in (('valid', valid), ('test', bad)):  # never filtered, the text kept as read
        assert meta['splits'][split]['pairs'] == meta['raw_pairs'][split] == len(pairs)
        lines = (out / f'{split}.yy.txt').read_text('utf-8').split('\n')[:-1]
        assert lines == [p[1] for p in pairs]


def test_a_split_left_empty_by_reading_or_cleaning_is_an_error_naming_its_files(tmp_path):
    all_dropped = [('one two three four five six', 'eins')] * 5
    for name, train in [('empty', []), ('all_dropped', all_dropped)]:
        root = tmp_path / name
        root.mkdir()
        write_custom(root, {'train': train, 'valid': toy_pairs(3, 27), 'test': toy_pairs(3, 28)})
        with pytest.raises(SystemExit) as e:
            data_prep.main(custom_args(root, root / 'out'))
        assert 'train split has no sentence pairs' in str(e.value)
        assert str(root / 'train.xx') in str(e.value)
        assert not (root / 'out' / 'meta.json').exists()

# -----------------------------------------------------------------------------------------------
# reading


def test_reads_plain_gz_tar_members_and_sgm_without_shifting_lines(tmp_path):
    raw = 'plain\ncrlf ending\r\nlone\rcarriage return\nline\u2028separator\nnext\x85line\nÄÖÜ\n'
    raw = raw.encode()
    want = ['plain', 'crlf ending', 'lone carriage return', 'line separator', 'next line', 'ÄÖÜ']
    (tmp_path / 'f.txt').write_bytes(raw)
    (tmp_path / 'f.txt.gz').write_bytes(gzip.compress(raw))
    members = {'x/f.txt': raw, 'x/f.gz': gzip.compress(raw), 'x/t.sgm': sgm(want[:2])}
    archive = str(tmp_path / 'a.tgz')
    (tmp_path / 'a.tgz').write_bytes(tgz(members))
    for source in [('f.txt', None), ('f.txt.gz', None), ('a.tgz', 'x/f.txt'), ('a.tgz', 'x/f.gz')]:
        assert list(data_prep.read_lines(str(tmp_path / source[0]), source[1])) == want, source
    assert list(data_prep.read_lines(archive, 'x/t.sgm')) == want[:2]
    with pytest.raises(SystemExit, match='has no member x/missing'):
        list(data_prep.read_lines(archive, 'x/missing'))


def test_a_byte_order_mark_is_not_read_as_text(tmp_path):
    # Common Windows editors start a UTF-8 file with one; `cat` of two such files puts one on a
    # later line.
    (tmp_path / 'f.txt').write_bytes('\ufeffa man\nb\n\ufeffc\n'.encode())
    assert list(data_prep.read_lines(str(tmp_path / 'f.txt'))) == ['a man', 'b', 'c']


def test_utf16_text_is_one_error_naming_the_file_even_where_bad_bytes_are_replaced(tmp_path):
    path = tmp_path / 'windows.txt'
    path.write_bytes('a man\nb\n'.encode('utf-16'))
    for errors in ('strict', 'replace'):
        with pytest.raises(SystemExit) as e:
            list(data_prep.read_lines(str(path), errors=errors))
        assert f'{path} is UTF-16 text' in str(e.value)


def test_invalid_utf8_is_an_error_naming_file_and_line_or_replaced_with_a_warning(tmp_path, capsys):
    archive = str(tmp_path / 'a.tgz')
    (tmp_path / 'a.tgz').write_bytes(tgz({'dir/f.de': b'ok\n\xc3(\n'}))
    with pytest.raises(SystemExit) as e:
        list(data_prep.read_lines(archive, 'dir/f.de'))
    assert f'{archive}:dir/f.de line 2: invalid UTF-8' in str(e.value)
    assert list(data_prep.read_lines(archive, 'dir/f.de', 'replace')) == ['ok', '\ufffd(']
    assert 'line 2' in capsys.readouterr().err


def test_files_of_different_line_counts_are_an_error_naming_both_counts(tmp_path):
    (tmp_path / 'train.xx').write_text('a\nb\nc\nd\ne\nf\ng\n')
    (tmp_path / 'train.yy').write_text('a\nb\nc\nd\ne\n')
    write_custom(tmp_path, {'valid': toy_pairs(3, 18), 'test': toy_pairs(3, 19)})
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    assert f"{tmp_path / 'train.xx'} has 7" in str(e.value)
    assert f"{tmp_path / 'train.yy'} has 5" in str(e.value)


def test_train_given_twice_reads_both_prefixes(corpus):
    write_custom(corpus, {'more': toy_pairs(30, 12)})
    meta = data_prep.main(custom_args(corpus, corpus / 'out', '--train', str(corpus / 'more')))
    assert meta['raw_pairs']['train'] == 80  # as '--train train more', not the last one only

# -----------------------------------------------------------------------------------------------
# tokenizer and encoding

TRICKY = ['Grüße aus Köln: Äpfel, Öl und Übermut — ß!', 'Emoji 👍🏽 🇩🇪 and 日本語 text',
          'windows\r\nline\r\n', '  leading and trailing spaces  ', '\ttabs\tand  double  spaces',
          'zero\u200bwidth', '<s> </s> <pad>', '', 'x' * 500, 'a\u2028b\x85c']


def test_tokenizer_round_trips_tricky_text_from_dict_json_and_folder(corpus):
    out = corpus / 'out'
    data_prep.main(custom_args(corpus, out, '--vocab-size', '400'))
    tok = json.loads(json.dumps(dataset.tokenizer_dict(str(out))))  # as embedded in a checkpoint
    encs = [dataset.load_tokenizer(x) for x in (tok, str(out / 'tokenizer.json'), str(out))]
    for s in TRICKY:
        assert encs[0].decode(encs[0].encode_ordinary(s)) == s
        ids = [enc.encode_ordinary(s) for enc in encs]
        assert ids[0] == ids[1] == ids[2]
    enc = encs[0]
    assert enc.n_vocab == len(tok['ranks']) + 3 <= 403
    specials = [enc.encode_single_token(s) for s in data_prep.SPECIALS]
    assert specials == [enc.n_vocab - 3 + i for i in range(3)]
    assert enc.n_vocab - 1 not in enc.encode_ordinary('</s>')  # text that looks special is text
    assert len(enc.encode_ordinary('Straße')) < len('Straße'.encode())  # merges learned and used


def test_batched_encoding_equals_encoding_each_line_alone():
    enc = dataset.load_tokenizer(data_prep.train_tokenizer(iter(TRICKY * 3), 300, 'toy'))
    for lines in (TRICKY, [s for s in TRICKY if '</s>' not in s], ['a'], []):
        for workers in (1, 3):
            ids, lens = data_prep.encode_lines(enc, lines, workers)
            per_line = [enc.encode_ordinary(s) for s in lines]
            assert lens.tolist() == [len(x) for x in per_line]
            assert ids.tolist() == [t for x in per_line for t in x]


def test_a_given_tokenizer_encodes_new_data_with_its_own_ids(corpus, capsys):
    import torch
    data_prep.main(custom_args(corpus, corpus / 'a'))
    tok = dataset.tokenizer_dict(str(corpus / 'a'))
    torch.save({'tokenizer': tok}, corpus / 'ckpt.pt')
    # new data, on which its own BPE would differ
    write_custom(corpus, {'train': toy_pairs(40, 16), 'valid': toy_pairs(5, 17)})
    args = custom_args(corpus, corpus / 'b', vocab_size=None)
    for source in (corpus / 'ckpt.pt', corpus / 'a', corpus / 'a' / 'tokenizer.json'):
        meta = data_prep.main(args + ['--tokenizer', str(source), '--force'])
        assert dataset.same_tokenizer(dataset.tokenizer_dict(str(corpus / 'b')), tok)
        assert meta['vocab_size'] == dataset.load_meta(str(corpus / 'a'))['vocab_size']
        assert read_split(corpus / 'b', 'valid', 'xx') == [p[0] for p in toy_pairs(5, 17)]
    capsys.readouterr()
    data_prep.main(args + ['--tokenizer', str(corpus / 'a')])
    assert 'already prepared' in capsys.readouterr().out
    data_prep.main(args)  # its own BPE again: not the given one's output kept
    assert 'already prepared' not in capsys.readouterr().out
    assert not dataset.same_tokenizer(dataset.tokenizer_dict(str(corpus / 'b')), tok)


def test_a_given_tokenizer_that_is_none_is_an_error_naming_it(corpus):
    (corpus / 'other.json').write_text('{"a": 1}')
    args = custom_args(corpus, corpus / 'b', vocab_size=None)
    for source in (corpus / 'missing.json', corpus / 'other.json', corpus / 'train.xx'):
        with pytest.raises(SystemExit) as e:
            data_prep.main(args + ['--tokenizer', str(source)])
        assert str(source) in str(e.value) and e.value.code != 0
    assert not (corpus / 'b').exists()

# -----------------------------------------------------------------------------------------------
# prepared folders: reruns, interruptions, errors


def test_a_rerun_is_skipped_with_the_same_settings_and_files_and_redone_otherwise(corpus, capsys):
    out = corpus / 'out'

    def stamps():
        return {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}

    data_prep.main(custom_args(corpus, out))
    before = stamps()
    data_prep.main(custom_args(corpus, out))
    assert 'already prepared' in capsys.readouterr().out
    assert stamps() == before
    assert data_prep.main(custom_args(corpus, out, '--max-ratio', '0'))['dropped']['ratio'] == 0
    write_custom(corpus, {'train': toy_pairs(30, 12)})  # same names, other text
    meta = data_prep.main(custom_args(corpus, out, '--max-ratio', '0'))
    assert meta['raw_pairs']['train'] == 30
    (out / 'meta.json').write_text('[]')  # a damaged meta.json: prepared again, not a traceback
    capsys.readouterr()
    meta = data_prep.main(custom_args(corpus, out, '--max-ratio', '0'))
    assert meta['raw_pairs']['train'] == 30
    assert 'already prepared' not in capsys.readouterr().out


def test_a_folder_prepared_again_for_another_pair_keeps_no_file_of_the_old_pair(corpus):
    out = corpus / 'out'
    out.mkdir()
    (out / 'notes.txt').write_text('mine')
    data_prep.main(custom_args(corpus, out))
    write_custom(corpus, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10),
                          'test': toy_pairs(5, 11)}, tgt='zz')
    args = custom_args(corpus, out)
    args[args.index('yy')] = 'zz'
    data_prep.main(args)
    names = sorted(os.listdir(out))
    assert not [name for name in names if '.yy.' in name]
    assert 'train.zz.bin' in names and 'test.zz.txt' in names and 'notes.txt' in names


def test_a_killed_run_leaves_nothing_finished_looking_and_reruns_to_the_same_bytes(corpus,
                                                                                   monkeypatch):
    real = data_prep.encode_lines
    calls = []

    def dying(*args):
        calls.append(1)
        if len(calls) == 4:  # train xx, train yy, valid xx, then killed while encoding valid yy
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(data_prep, 'encode_lines', dying)
    with pytest.raises(KeyboardInterrupt):
        data_prep.main(custom_args(corpus, corpus / 'out'))
    left = os.listdir(corpus / 'out')
    finished_looking = ('meta.json', 'valid.', 'test.')
    assert not [n for n in left if n.startswith(finished_looking) or n.endswith('.tmp')]
    monkeypatch.setattr(data_prep, 'encode_lines', real)
    data_prep.main(custom_args(corpus, corpus / 'out'))
    # uninterrupted, on one thread
    data_prep.main(custom_args(corpus, corpus / 'fresh', '--workers', '1'))
    assert contents(corpus / 'out') == contents(corpus / 'fresh')


def test_a_failed_or_stopped_preparation_leaves_the_old_folder_as_it_was(corpus, monkeypatch):
    # Else a folder runs were trained on is neither the old data nor the new.
    out = corpus / 'out'
    data_prep.main(custom_args(corpus, out))
    before = contents(out)
    meta = (out / 'meta.json').read_bytes()
    real = data_prep.encode_lines
    calls = []

    def dying(*args):  # the other settings' train, then stopped while encoding valid
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(data_prep, 'encode_lines', dying)
    with pytest.raises(KeyboardInterrupt):
        data_prep.main(custom_args(corpus, out, '--max-len', '9'))
    assert contents(out) == before
    assert (out / 'meta.json').read_bytes() == meta


def test_a_full_disk_is_a_one_line_error_that_leaves_no_temporary_files(corpus, monkeypatch):
    real = os.fsync
    calls = []

    def full(fd):  # the 1st is tokenizer.json's, the 2nd one of the training split's files
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(corpus, corpus / 'o'))
    assert str(e.value) == f"error: writing {corpus / 'o'}: {os.strerror(errno.ENOSPC)}"
    assert os.listdir(corpus / 'o') == []


def test_two_runs_into_one_out_never_mix(corpus, monkeypatch):
    real = data_prep.encode_lines
    paused = threading.Event()
    resume = threading.Event()
    errors = []

    def slow(*args):  # the first run stops half-way through writing train
        if threading.current_thread().name == 'first':
            paused.set()
            resume.wait()
        return real(*args)

    def run(*extra):
        try:
            data_prep.main(custom_args(corpus, corpus / 'out', *extra))
        except BaseException as e:
            errors.append(e)

    monkeypatch.setattr(data_prep, 'encode_lines', slow)
    first = threading.Thread(target=run, name='first')
    second = threading.Thread(target=run, args=('--max-len', '9'))
    first.start()
    assert paused.wait(timeout=60), errors
    second.start()
    second.join(timeout=0.5)  # it must not delete or rename the first run's files meanwhile
    resume.set()
    first.join()
    second.join()
    meta = dataset.load_meta(str(corpus / 'out'))
    assert errors == [] and meta['max_len'] == 9
    assert len(read_split(corpus / 'out', 'train', 'xx')) == meta['splits']['train']['pairs']


def test_only_our_own_leftovers_are_removed_from_out(corpus):
    out = corpus / 'out'
    out.mkdir()
    # killed runs' temporary files, and that of translate.py writing its output there
    for name in ('train.zz.bin.a1b2c3d4.tmp', 'meta.json.a1b2c3d4.tmp', 'hyp.de.a1b2c3d4.tmp'):
        (out / name).write_text('x')
    data_prep.main(custom_args(corpus, out))
    assert [name for name in os.listdir(out) if name.endswith('.tmp')] == ['hyp.de.a1b2c3d4.tmp']
    # A killed run's folder of new files goes when the folder is found prepared too.
    (out / '.preparing.k1ll3d').mkdir()
    (out / '.preparing.k1ll3d' / 'train.xx.bin').write_text('x')
    data_prep.main(custom_args(corpus, out))
    assert not [name for name in os.listdir(out) if name.startswith('.preparing')]


def test_a_split_side_of_empty_lines_loads_as_empty_sentences(tmp_path):
    valid = [(p[0], '') for p in toy_pairs(3, 10)]
    write_custom(tmp_path, {'train': toy_pairs(30, 9), 'valid': valid, 'test': toy_pairs(5, 11)})
    # valid.yy.bin has no bytes: not a damaged folder
    data_prep.main(custom_args(tmp_path, tmp_path / 'o'))
    src, src_idx, tgt, tgt_idx = dataset.load_split(str(tmp_path / 'o'), 'valid')
    assert len(src_idx) == len(tgt_idx) == 4 and len(src) > 0 and len(tgt) == 0


def test_a_truncated_token_file_is_refused_by_load_split(corpus):
    data_prep.main(custom_args(corpus, corpus / 'o'))
    with open(corpus / 'o' / 'train.yy.bin', 'r+b') as f:
        f.truncate(10)
    with pytest.raises(SystemExit) as e:
        dataset.load_split(str(corpus / 'o'), 'train')
    assert 'train.yy.idx does not match train.xx.idx or the' in str(e.value)
    # the source side: not "train.xx.idx does not match train.xx.idx"
    data_prep.main(custom_args(corpus, corpus / 'o', '--force'))
    with open(corpus / 'o' / 'train.xx.bin', 'r+b') as f:
        f.truncate(10)
    with pytest.raises(SystemExit) as e:
        dataset.load_split(str(corpus / 'o'), 'train')
    assert 'train.xx.idx does not match the 5 tokens of train.xx.bin' in str(e.value)


def test_ids_past_the_vocabulary_or_meta_without_its_keys_are_refused_on_loading(corpus):
    # Else a traceback at the first step or the first save, after --overwrite removed a run.
    out = corpus / 'o'
    data_prep.main(custom_args(corpus, out))
    meta = json.loads((out / 'meta.json').read_text())
    tokens = np.fromfile(out / 'train.yy.bin', dtype=meta['dtype'])
    tokens[::50] = meta['vocab_size']
    tokens.tofile(out / 'train.yy.bin')
    with pytest.raises(SystemExit) as e:
        dataset.load_split(str(out), 'train')
    assert f"train.yy.bin holds ids past vocab_size {meta['vocab_size']}" in str(e.value)
    no_splits = {key: value for key, value in meta.items() if key != 'splits'}
    for damaged in (no_splits, {**meta, 'vocab_size': '2003'}):
        (out / 'meta.json').write_text(json.dumps(damaged))
        with pytest.raises(SystemExit) as e:
            dataset.open_prepared(str(out))
        assert f'{out} is incomplete or damaged' in str(e.value)


def test_validation_references_of_another_length_are_refused_on_loading(corpus):
    # Else validation BLEU pairs the wrong lines and picks ckpt_best.pt by it.
    out = corpus / 'o'
    data_prep.main(custom_args(corpus, out))
    dataset.open_prepared(str(out))
    refs = out / 'valid.yy.txt'
    refs.write_text(''.join(refs.read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(SystemExit) as e:
        dataset.open_prepared(str(out))
    assert 'valid.yy.txt has 2 lines' in str(e.value)


@pytest.mark.parametrize('args, flag', [
    (['custom', '--src', 'x', '--tgt', 'x', '--train', 'a', '--valid', 'b', '--test', 'c'],
     '--src and'),
    (['custom', '--src', 'xx', '--tgt', 'yy', '--train', 'a'], '--valid'),
    (M30K_EN_DE + ['--train', 'a'], '--train'),
    (['wmt14', '--src', 'en', '--tgt', 'es'], 'en-es'),
    (M30K_EN_DE + ['--vocab-size', '100'], '--vocab-size'),
    (M30K_EN_DE + ['--vocab-size', '300', '--tokenizer', 'x'], '--vocab-size'),
    (M30K_EN_DE + ['--max-len', '-1'], '--max-len'),
    (M30K_EN_DE + ['--max-ratio', 'nan'], '--max-ratio')])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, args, flag):
    with pytest.raises(SystemExit) as e:
        data_prep.main(args + ['--out', str(tmp_path / 'o')])
    assert e.value.code == 2 and flag in capsys.readouterr().err and not (tmp_path / 'o').exists()


def test_an_out_that_is_a_file_is_an_error_before_any_work(tmp_path):
    (tmp_path / 'taken').write_text('a file, not a folder\n')
    with pytest.raises(SystemExit) as e:  # no corpus files either: those are looked for later
        data_prep.main(custom_args(tmp_path, tmp_path / 'taken'))
    message = f"error: --out {tmp_path / 'taken'} cannot be created or written"
    assert str(e.value).startswith(message)


def test_importing_has_no_side_effects_and_needs_no_rustbpe(tmp_path):
    code = (f"import sys; sys.modules['rustbpe'] = None; sys.path[0] = {HERE!r}; "
            "import data_prep, translate")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == r.stderr == '' and os.listdir(tmp_path) == []


def test_atomic_writes_leave_the_old_file_when_interrupted(tmp_path):
    (tmp_path / 'f.json').write_text('old')
    with pytest.raises(KeyboardInterrupt), checkpoint.atomic(str(tmp_path / 'f.json')) as f:
        f.write(b'half')
        raise KeyboardInterrupt
    checkpoint.write_json(str(tmp_path / 'g.json'), {'a': 1})
    assert (tmp_path / 'f.json').read_text() == 'old'
    assert sorted(os.listdir(tmp_path)) == ['f.json', 'g.json']

@pytest.mark.parametrize('error', [OSError(28, 'No space left on device'),
                                   RuntimeError('[enforce fail at inline_container.cc:672] . '
                                                'unexpected pos 64 vs 0')])
def test_a_checkpoint_save_that_fails_midway_is_one_line_and_keeps_the_old_file(
        tmp_path, monkeypatch, error):
    # A full disk: torch's writer raises either, by how far the write got.
    def save(obj, f):
        f.write(b'half')
        raise error

    (tmp_path / 'ckpt.pt').write_text('old')
    monkeypatch.setattr(checkpoint.torch, 'save', save)
    with pytest.raises(SystemExit) as e:
        checkpoint.save_atomic({}, str(tmp_path / 'ckpt.pt'))
    assert f"cannot write {tmp_path / 'ckpt.pt'}" in str(e.value)
    assert '\n' not in str(e.value)
    assert os.listdir(tmp_path) == ['ckpt.pt']
    assert (tmp_path / 'ckpt.pt').read_text() == 'old'


def test_a_checkpoint_save_that_fails_for_another_reason_keeps_its_traceback(tmp_path,
                                                                              monkeypatch):
    def save(obj, f):
        raise RuntimeError('cannot pickle a lambda')

    monkeypatch.setattr(checkpoint.torch, 'save', save)
    with pytest.raises(RuntimeError, match='cannot pickle'):
        checkpoint.save_atomic({}, str(tmp_path / 'ckpt.pt'))
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------------------------
# batching


def token_data(rng, lengths):
    """A split as load_split gives it, of random tokens: per side, the tokens and the offsets."""
    data = []
    for n in lengths:
        tokens = rng.integers(3, 100, int(n.sum())).astype(np.uint16)
        data += [tokens, np.concatenate([[0], np.cumsum(n)])]
    return tuple(data)


def test_collate_puts_bos_eos_and_padding_where_the_model_expects_them():
    data = (np.array([5, 6, 7, 8], np.uint16), np.array([0, 3, 4]),
            np.array([9, 10, 11], np.uint16), np.array([0, 1, 3]))
    src, tgt_in, rows, targets = dataset.collate(data, [1, 0], pad_id=0, bos_id=1, eos_id=2)
    assert src.tolist() == [[8, 2, 0, 0], [5, 6, 7, 2]]
    assert tgt_in.tolist() == [[1, 10, 11], [1, 9, 0]]
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert targets.tolist() == [10, 11, 2, 9, 2]  # pads are no rows
    assert {x.dtype for x in (src, tgt_in, rows, targets)} == {np.dtype(np.int64)}
    rng = np.random.default_rng(0)
    # valid and test are not cleaned: empty sides
    data = token_data(rng, (rng.integers(0, 9, 50), rng.integers(0, 9, 50)))
    ids = rng.permutation(50)[:17]
    src, tgt_in, rows, targets = dataset.collate(data, ids, 0, 1, 2)
    tgt_out = np.zeros(tgt_in.size, np.int64)
    tgt_out[rows] = targets
    tgt_out = tgt_out.reshape(tgt_in.shape)
    for row, i in enumerate(ids):  # as building each row alone
        s = data[0][data[1][i]:data[1][i + 1]].tolist()
        t = data[2][data[3][i]:data[3][i + 1]].tolist()
        assert src[row].tolist() == s + [2] + [0] * (src.shape[1] - len(s) - 1)
        assert tgt_in[row].tolist() == [1] + t + [0] * (tgt_in.shape[1] - len(t) - 1)
        assert tgt_out[row].tolist() == t + [2] + [0] * (tgt_out.shape[1] - len(t) - 1)


def test_batch_plan_fills_max_tokens_covers_each_fitting_pair_once_and_is_seeded():
    rng = np.random.default_rng(1)
    data = []
    for _ in range(2):
        n = rng.integers(1, 40, 500)
        data += [np.zeros(int(n.sum()), np.uint16), np.concatenate([[0], np.cumsum(n)])]
    size = dataset.pair_sizes(data)
    plan = dataset.batch_plan(data, 100, seed=3, epoch=0)
    assert sorted(np.concatenate(plan).tolist()) == np.flatnonzero(size <= 100).tolist()
    assert all(len(b) * size[b].max() <= 100 for b in plan)

    def as_lists(epoch):
        return [b.tolist() for b in dataset.batch_plan(data, 100, seed=3, epoch=epoch)]

    # the same on every rank, new each epoch
    assert as_lists(0) == [b.tolist() for b in plan] != as_lists(1)
