"""Tests of data_prep.py; no internet: a throwaway HTTP server on 127.0.0.1 plays statmt.org / GitHub.
    python -m pytest -q test_data_prep.py"""
import gzip
import io
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import data_prep

HERE = os.path.dirname(os.path.abspath(__file__))
MULTI30K = os.path.join(HERE, '..', 'shared', 'data', 'multi30k')

# -----------------------------------------------------------------------------------------------
# helpers: a Range-capable HTTP server, toy corpora, archives laid out like the real ones


class Handler(BaseHTTPRequestHandler):
    """Serves server.files[path] with the ETag server.etags[path], if any; honours 'Range: bytes=N-' (unless
    server.no_range) and If-Range; server.cut[path] = K sends only K bytes of the next response to path and drops
    the connection (server.always_cut: every response); server.pause[path] = Event sends half of the next response
    to path, then waits for the event before the rest (a transfer in progress)."""

    def do_GET(self):
        srv, path, rng = self.server, self.path.lstrip('/'), self.headers.get('Range')
        srv.log.append((path, rng) + ((self.headers['If-Range'],) if 'If-Range' in self.headers else ()))
        if path not in srv.files:
            return self.send_error(404)
        if srv.busy.get(path):  # 429 Too Many Requests, that many times
            srv.busy[path] -= 1
            return self.send_error(429)
        data, start, etag = srv.files[path], 0, srv.etags.get(path)
        if self.headers.get('If-Range', etag) != etag:  # changed since: the whole file, as RFC 9110 says
            rng = None
        if rng and not srv.no_range:
            start = int(re.fullmatch(r'bytes=(\d+)-', rng)[1])
            if start >= len(data):
                self.send_response(416)
                self.send_header('Content-Range', f'bytes */{len(data)}')
                self.send_header('Content-Length', '0')
                return self.end_headers()
        body = data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header('Content-Range', f'bytes {start}-{len(data) - 1}/{len(data)}')
        if etag:
            self.send_header('ETag', etag)
        if path not in srv.no_length:  # else the body ends where the connection does (HTTP/1.0)
            self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if path in srv.pause:
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            srv.pause.pop(path).wait()
            body = body[len(body) // 2:]
        cut = srv.cut.pop(path, srv.always_cut)
        self.wfile.write(body if cut is None else body[:cut])  # then HTTP/1.0 closes the connection

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv('NO_PROXY', '127.0.0.1')  # a CI proxy must not see these requests
    monkeypatch.setenv('no_proxy', '127.0.0.1')
    monkeypatch.setattr(data_prep, 'RETRY_WAIT', 0.0)
    srv = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    srv.files, srv.etags, srv.cut, srv.pause, srv.always_cut, srv.no_range, srv.log = {}, {}, {}, {}, None, False, []
    srv.no_length, srv.busy = set(), {}
    srv.url = f'http://127.0.0.1:{srv.server_port}/'
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


EN = 'a the dog cat man woman girl boy runs sits jumps on in under with red blue big small street park ball'.split()
DE = 'ein der Hund Katze Mann Frau Mädchen Junge läuft sitzt springt auf in unter mit rote blaue große kleine ' \
     'Straße Park Ball'.split()


def toy_pairs(n, seed):
    """Word-for-word 'translations' with umlauts, 2-14 words."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        ids = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 14))]
        pairs.append((' '.join(EN[i] for i in ids).capitalize() + '.', ' '.join(DE[i] for i in ids) + '.'))
    return pairs


def text(lines):
    return ''.join(line + '\n' for line in lines).encode('utf-8')


def tgz(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w:gz') as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sgm(lines, setid='newstest2014'):
    segs = ''.join(f'<seg id="{i}"> {line} </seg>\n' for i, line in enumerate(lines, 1))
    return f'<srcset setid="{setid}" srclang="any">\n<doc docid="d1" genre="news">\n<p>\n{segs}</p>\n</doc>\n' \
           f'</srcset>\n'.encode('utf-8')


def wmt14_de_en_archives():
    """The five en-de archives with the real names and member layout (and decoy members before ours)."""
    train = [toy_pairs(60, 1), toy_pairs(50, 2), toy_pairs(40, 3)]
    valid, test = toy_pairs(30, 4), toy_pairs(25, 5)
    side = lambda pairs, i: text(p[i] for p in pairs)
    files = {
        'training-parallel-europarl-v7.tgz': tgz({'training/europarl-v7.cs-en.cs': b'decoy\n',
                                                  'training/europarl-v7.de-en.de': side(train[0], 1),
                                                  'training/europarl-v7.de-en.en': side(train[0], 0)}),
        'training-parallel-commoncrawl.tgz': tgz({'commoncrawl.de-en.en': side(train[1], 0),
                                                  'commoncrawl.de-en.de': side(train[1], 1),
                                                  'commoncrawl.fr-en.fr': b'decoy\n'}),
        'training-parallel-nc-v9.tgz': tgz({'training/news-commentary-v9.de-en.de': side(train[2], 1),
                                            'training/news-commentary-v9.de-en.en': side(train[2], 0)}),
        'dev.tgz': tgz({'dev/newstest2012.en': b'decoy\n', 'dev/newstest2013.en': side(valid, 0),
                        'dev/newstest2013.de': side(valid, 1)}),
        'test-full.tgz': tgz({'test-full/newstest2014-deen-src.de.sgm': sgm(p[1] for p in test),
                              'test-full/newstest2014-deen-src.en.sgm': sgm(p[0] for p in test),
                              'test-full/newstest2014-deen-ref.de.sgm': sgm(p[1] for p in test),
                              'test-full/newstest2014-deen-ref.en.sgm': sgm(p[0] for p in test)}),
    }
    return files, sum(train, []), valid, test


def write_custom(root, splits, src='xx', tgt='yy'):
    """splits: {name: [(src, tgt), ...]} -> files root/name.xx, root/name.yy."""
    for name, pairs in splits.items():
        (root / f'{name}.{src}').write_bytes(text(p[0] for p in pairs))
        (root / f'{name}.{tgt}').write_bytes(text(p[1] for p in pairs))
    return [str(root / name) for name in splits]


def custom_args(root, out, *extra, src='xx', tgt='yy'):
    return ['custom', '--train', str(root / 'train'), '--valid', str(root / 'valid'), '--test', str(root / 'test'),
            '--src', src, '--tgt', tgt, '--out', str(out), '--vocab-size', '300', '--workers', '2', *extra]


def read_split(out, split, lang):
    """Decoded sentences of a prepared split, via meta.json's dtype and the .idx offsets."""
    meta = json.load(open(out / 'meta.json'))
    enc = data_prep.load_tokenizer(str(out))
    ids = np.fromfile(out / f'{split}.{lang}.bin', dtype=meta['dtype'])
    idx = np.fromfile(out / f'{split}.{lang}.idx', dtype=np.int64)
    assert idx[0] == 0 and idx[-1] == len(ids) and np.all(np.diff(idx) >= 0)
    return [enc.decode(ids[idx[i]:idx[i + 1]].tolist()) for i in range(len(idx) - 1)]


def expected_kept(enc, pairs, max_len=250, max_ratio=1.5):
    """Moses' rules re-implemented independently, on per-line encode_ordinary counts."""
    kept = []
    for s, t in pairs:
        a, b = len(enc.encode_ordinary(s.strip())), len(enc.encode_ordinary(t.strip()))
        if a and b and a <= max_len and b <= max_len and (not max_ratio or max(a, b) <= max_ratio * min(a, b)):
            kept.append((s.strip(), t.strip()))
    return kept

# -----------------------------------------------------------------------------------------------
# download


def test_download_gets_the_exact_bytes_and_leaves_no_part_file(server, tmp_path):
    data = os.urandom(300_000)
    server.files['f/blob.bin'] = data
    path = data_prep.download(server.url + 'f/blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data
    assert not os.path.exists(path + '.part')
    n = len(server.log)
    data_prep.download(server.url + 'f/blob.bin', str(tmp_path / 'blob.bin'))
    assert len(server.log) == n  # a finished file is not fetched again


def test_download_resumes_a_dropped_transfer_with_a_range_request(server, tmp_path):
    data = os.urandom(200_000)
    server.files['blob.bin'] = data
    server.cut['blob.bin'] = 70_000  # the first response stops after 70 kB
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data
    assert server.log == [('blob.bin', None), ('blob.bin', 'bytes=70000-')]


def test_download_resumes_an_existing_part_file(server, tmp_path):
    data = os.urandom(100_000)
    server.files['blob.bin'] = data
    (tmp_path / 'blob.bin.part').write_bytes(data[:40_000])  # left by a killed run
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data
    assert server.log == [('blob.bin', 'bytes=40000-')]


def test_download_restarts_when_the_server_ignores_range(server, tmp_path):
    data = os.urandom(50_000)
    server.files['blob.bin'], server.no_range = data, True
    (tmp_path / 'blob.bin.part').write_bytes(b'x' * 20_000)
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data


def test_download_of_a_file_changed_since_its_part_began_starts_over(server, tmp_path):
    old, new = os.urandom(60_000), os.urandom(60_000)
    server.files['blob.bin'], server.etags['blob.bin'], server.always_cut = old, '"v1"', 25_000
    with pytest.raises(SystemExit):  # leaves 25 kB of the old file in blob.bin.part
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'), retries=0)
    server.files['blob.bin'], server.etags['blob.bin'], server.always_cut = new, '"v2"', None
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == new  # not 25 kB of the old file and the rest of the new
    assert server.log[-1] == ('blob.bin', 'bytes=25000-', '"v1"') and os.listdir(tmp_path) == ['blob.bin']


def test_download_with_a_complete_part_file_is_not_fetched_again(server, tmp_path):
    data = os.urandom(30_000)  # no CHECKSUMS entry: only the server can say the .part is whole
    server.files['blob.bin'] = data
    (tmp_path / 'blob.bin.part').write_bytes(data)  # a run killed between the last byte and the rename
    path = data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert open(path, 'rb').read() == data and server.log == [('blob.bin', 'bytes=30000-')]


def test_download_that_never_completes_is_an_error_not_a_truncated_file(server, tmp_path):
    server.files['blob.bin'], server.always_cut = os.urandom(50_000), 1000
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'), retries=2)
    assert 'blob.bin' in str(e.value) and '3000 of 50000 bytes' in str(e.value)
    assert not (tmp_path / 'blob.bin').exists()


def test_download_checksum_mismatch_is_a_clear_error(server, tmp_path, monkeypatch):
    data = os.urandom(10_000)
    server.files['blob.bin'] = data
    monkeypatch.setitem(data_prep.CHECKSUMS, 'blob.bin', (len(data), '0' * 64))
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert 'blob.bin' in str(e.value) and 'sha256' in str(e.value)
    assert os.listdir(tmp_path) == []  # neither a final file nor a .part to resume


def test_download_size_differing_from_the_table_is_a_clear_error(server, tmp_path, monkeypatch):
    server.files['blob.bin'] = os.urandom(10_000)
    monkeypatch.setitem(data_prep.CHECKSUMS, 'blob.bin', (12_345, 'a' * 64))
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin'))
    assert '10000 bytes' in str(e.value) and '12345' in str(e.value)
    assert not (tmp_path / 'blob.bin').exists()


def test_a_file_another_run_is_downloading_is_waited_for_not_fetched_again(server, tmp_path):
    data, resume, paths, errors = os.urandom(3_000_000), threading.Event(), [], []
    server.files['blob.tgz'], server.pause['blob.tgz'] = data, resume

    def run():
        try:
            paths.append(data_prep.fetch(server.url + 'blob.tgz', None, str(tmp_path)))
        except BaseException as e:
            errors.append(e)
    first, second = threading.Thread(target=run), threading.Thread(target=run)
    first.start()
    part = tmp_path / 'blob.tgz.part'
    while first.is_alive() and not (part.exists() and part.stat().st_size):
        first.join(timeout=0.01)  # until the first run has bytes in its .part
    second.start()
    second.join(timeout=1)  # a second run into the same download folder, e.g. en-de and en-fr at once
    resume.set()
    first.join()
    second.join()
    assert errors == [] and server.log == [('blob.tgz', None)]  # one transfer, not a second appended to it
    assert paths == [str(tmp_path / 'blob.tgz')] * 2 and (tmp_path / 'blob.tgz').read_bytes() == data


def test_download_dir_that_is_a_file_is_a_clear_error_before_any_request(server, tmp_path):
    (tmp_path / 'taken').write_text('a file, not a folder\n')
    with pytest.raises(SystemExit) as e:
        data_prep.main(['multi30k', '--src', 'en', '--tgt', 'de', '--mirror', server.url, '--out', str(tmp_path / 'o'),
                        '--download-dir', str(tmp_path / 'taken')])
    assert str(e.value).startswith(f"error: --download-dir {tmp_path / 'taken'} cannot be created or written")
    assert server.log == []


def test_a_file_already_in_the_download_dir_is_checked_against_the_table(server, tmp_path):
    (tmp_path / 'train.en.gz').write_bytes(gzip.compress(b'copied in by hand, not the real Multi30k\n'))
    with pytest.raises(SystemExit) as e:  # not read as the corpus because it has the name
        data_prep.main(['multi30k', '--src', 'en', '--tgt', 'de', '--mirror', server.url, '--out', str(tmp_path / 'o'),
                        '--download-dir', str(tmp_path)])
    assert str(tmp_path / 'train.en.gz') in str(e.value) and 'expected 568929' in str(e.value)
    assert server.log == []


def test_a_cut_transfer_without_a_length_is_resumed_not_taken_as_complete(server, tmp_path):
    data = gzip.compress(os.urandom(200_000))  # an archive's own end says whether all of it came
    server.files['blob.tgz'], server.cut['blob.tgz'] = data, 50_000
    server.no_length.add('blob.tgz')
    assert open(data_prep.download(server.url + 'blob.tgz', str(tmp_path / 'blob.tgz')), 'rb').read() == data
    assert [rng for _, rng in server.log] == [None, 'bytes=50000-']


def test_too_many_requests_is_retried(server, tmp_path):
    server.files['blob.bin'], server.busy['blob.bin'] = b'x' * 1000, 2
    assert open(data_prep.download(server.url + 'blob.bin', str(tmp_path / 'blob.bin')), 'rb').read() == b'x' * 1000


def test_download_missing_file_is_a_clear_error(server, tmp_path):
    with pytest.raises(SystemExit) as e:
        data_prep.download(server.url + 'nope.tgz', str(tmp_path / 'nope.tgz'))
    assert '404' in str(e.value) and 'nope.tgz' in str(e.value)

# -----------------------------------------------------------------------------------------------
# end to end


def test_wmt14_layout_end_to_end_through_a_mirror_url(server, tmp_path):
    files, train, valid, test = wmt14_de_en_archives()
    for name, data in files.items():
        server.files['mirror/' + name] = data
    out = tmp_path / 'wmt'
    meta = data_prep.main(['wmt14', '--src', 'en', '--tgt', 'de', '--mirror', server.url + 'mirror/',
                           '--vocab-size', '300', '--out', str(out), '--download-dir', str(tmp_path / 'dl'),
                           '--workers', '2'])
    assert meta['raw_pairs'] == {'train': len(train), 'valid': len(valid), 'test': len(test)}
    assert sorted(os.listdir(tmp_path / 'dl')) == sorted(files)  # each archive once, none left as .part
    assert sorted(p for p, _ in server.log) == sorted('mirror/' + name for name in files)
    enc = data_prep.load_tokenizer(str(out))
    kept = expected_kept(enc, train)
    assert list(zip(read_split(out, 'train', 'en'), read_split(out, 'train', 'de'))) == kept
    assert meta['splits']['train']['pairs'] == len(kept) == len(train) - sum(meta['dropped'].values())
    for split, pairs in (('valid', valid), ('test', test)):  # SGM segs for test, plain lines for valid
        for i, lang in enumerate(('en', 'de')):
            assert (out / f'{split}.{lang}.txt').read_text('utf-8').splitlines() == [p[i] for p in pairs]
            assert read_split(out, split, lang) == [p[i] for p in pairs]
    assert meta['vocab_size'] == enc.n_vocab and meta['dtype'] == 'uint16'
    assert (meta['pad_id'], meta['bos_id'], meta['eos_id']) == tuple(enc.n_vocab - 3 + i for i in range(3))


def test_a_test_set_missing_from_its_archive_is_found_before_the_bpe(tmp_path):
    files, *_ = wmt14_de_en_archives()
    files['test-full.tgz'] = tgz({'test-full/newstest2014-deen-src.en.sgm': sgm(['a b'])})  # no German side
    (tmp_path / 'mirror').mkdir()
    for name, data in files.items():
        (tmp_path / 'mirror' / name).write_bytes(data)
    with pytest.raises(SystemExit) as e:
        data_prep.main(['wmt14', '--src', 'en', '--tgt', 'de', '--mirror', str(tmp_path / 'mirror'), '--vocab-size',
                        '300', '--out', str(tmp_path / 'wmt')])
    assert 'has no member test-full/newstest2014-deen-ref.de.sgm' in str(e.value)
    assert os.listdir(tmp_path / 'wmt') == []  # no BPE learned, nothing encoded: on WMT14, hours


@pytest.mark.parametrize('lines', [['<seg id="1"> a b', 'c </seg>'], ['<seg id="1">a</seg><seg id="2">b</seg>'],
                                   ['<SEG id="1">a</SEG>']])
def test_a_seg_that_is_not_one_line_is_an_error_naming_it(tmp_path, lines):
    path = tmp_path / 'x.sgm'
    path.write_text('<doc>\n<seg id="0">fine</seg>\n' + '\n'.join(lines) + '\n</doc>\n')
    with pytest.raises(SystemExit) as e:  # it was dropped, or two read as one, without a word
        list(data_prep.read_lines(str(path)))
    assert f'{path} line 3' in str(e.value)


def test_multi30k_from_a_mirror_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, 'CHECKSUMS', {})  # these are not the real files
    mirror = tmp_path / 'mirror'
    mirror.mkdir()
    splits = {'train': toy_pairs(80, 6), 'val': toy_pairs(12, 7), 'test_2016_flickr': toy_pairs(11, 8)}
    for name, pairs in splits.items():
        for i, lang in enumerate(('en', 'de')):
            (mirror / f'{name}.{lang}.gz').write_bytes(gzip.compress(text(p[i] for p in pairs)))
    meta = data_prep.main(['multi30k', '--src', 'de', '--tgt', 'en', '--mirror', str(mirror), '--vocab-size', '300',
                           '--out', str(tmp_path / 'out'), '--workers', '2'])
    assert meta['raw_pairs'] == {'train': 80, 'valid': 12, 'test': 11}
    assert meta['src'] == 'de' and read_split(tmp_path / 'out', 'valid', 'de') == [p[1] for p in splits['val']]


def test_mirror_folder_file_not_matching_the_checksum_table_is_an_error(tmp_path):
    (tmp_path / 'train.en.gz').write_bytes(gzip.compress(b'not the real Multi30k\n'))
    with pytest.raises(SystemExit) as e:
        data_prep.main(['multi30k', '--src', 'en', '--tgt', 'de', '--mirror', str(tmp_path),
                        '--out', str(tmp_path / 'out')])
    assert 'train.en.gz' in str(e.value) and 'expected 568929' in str(e.value)


def test_same_language_on_both_sides_is_refused(tmp_path, capsys):
    (tmp_path / 'train.xx').write_text('a b\n')
    with pytest.raises(SystemExit):
        data_prep.main(['custom', '--train', str(tmp_path / 'train'), '--src', 'xx', '--tgt', 'xx',
                        '--out', str(tmp_path / 'out')])
    assert "--src and --tgt are both 'xx'" in capsys.readouterr().err and not (tmp_path / 'out').exists()


def test_train_given_twice_reads_both_prefixes(tmp_path):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'more': toy_pairs(30, 12), 'valid': toy_pairs(5, 10),
                            'test': toy_pairs(5, 11)})
    meta = data_prep.main(custom_args(tmp_path, tmp_path / 'out', '--train', str(tmp_path / 'more')))
    assert meta['raw_pairs']['train'] == 80  # as '--train train more', not the last one only


def test_custom_prefixes_with_a_named_corpus_are_refused_not_ignored(tmp_path, capsys):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    with pytest.raises(SystemExit):  # would prepare Multi30k, and say so only in its counts
        data_prep.main(['multi30k', '--src', 'xx', '--tgt', 'yy', '--train', str(tmp_path / 'train'),
                        '--mirror', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'out')])
    assert '--train, --valid and --test are for custom' in capsys.readouterr().err


def test_out_that_is_a_file_is_a_clear_error_before_any_work(tmp_path):
    (tmp_path / 'taken').write_text('a file, not a folder\n')
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(tmp_path, tmp_path / 'taken'))  # no corpus files either: checked first
    assert str(e.value).startswith(f"error: --out {tmp_path / 'taken'} cannot be created or written")


def test_rerun_with_same_settings_is_skipped_and_other_settings_redo(tmp_path, capsys):
    root = tmp_path
    write_custom(root, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    data_prep.main(custom_args(root, root / 'out'))
    stamps = {name: os.stat(root / 'out' / name).st_mtime_ns for name in os.listdir(root / 'out')}
    assert 'BPE: 50 training pairs read in' in (out := capsys.readouterr().out) and 'learning 44 merges' in out
    data_prep.main(custom_args(root, root / 'out'))
    assert 'already prepared' in capsys.readouterr().out
    assert stamps == {name: os.stat(root / 'out' / name).st_mtime_ns for name in os.listdir(root / 'out')}
    again = data_prep.main(custom_args(root, root / 'out', '--max-ratio', '0'))
    assert again['max_ratio'] == 0 and again['dropped']['ratio'] == 0
    for damage in ('{"src":', '[]'):  # a damaged meta.json: prepared again, not a traceback
        (root / 'out' / 'meta.json').write_text(damage)
        assert data_prep.main(custom_args(root, root / 'out', '--max-ratio', '0'))['max_ratio'] == 0
        assert 'meta.json' in capsys.readouterr().out

def test_rerun_of_a_prepared_folder_that_lost_a_file_prepares_it_again(tmp_path, capsys):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    os.remove(tmp_path / 'out' / 'valid.yy.idx')
    capsys.readouterr()
    data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    assert 'lacks valid.yy.idx' in capsys.readouterr().out
    assert read_split(tmp_path / 'out', 'valid', 'yy') == [p[1] for p in toy_pairs(5, 10)]


def test_rerun_after_the_corpus_files_changed_prepares_again(tmp_path, capsys):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    write_custom(tmp_path, {'train': toy_pairs(30, 12)})  # same names, other text
    capsys.readouterr()
    meta = data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    assert 'already prepared' not in capsys.readouterr().out and meta['raw_pairs']['train'] == 30

# -----------------------------------------------------------------------------------------------
# tokenizer

TRICKY = ['Grüße aus Köln: Äpfel, Öl und Übermut — ß!', 'Emoji 👍🏽 🇩🇪 and 日本語 text', 'windows\r\nline\r\n',
          '  leading and trailing spaces  ', '\ttabs\tand  double  spaces', 'zero\u200bwidth', '<s> </s> <pad>', '',
          'x' * 500, 'a\u2028b\x85c']


def test_tokenizer_round_trips_tricky_text_exactly():
    tok = data_prep.train_tokenizer(iter([p for pair in toy_pairs(300, 12) for p in pair]), 400, 'toy')
    enc = data_prep.load_tokenizer(tok)
    for s in TRICKY:
        assert enc.decode(enc.encode_ordinary(s)) == s
    assert enc.n_vocab == len(tok['ranks']) + 3 <= 403
    assert [enc.encode_single_token(s) for s in ('<pad>', '<s>', '</s>')] == [enc.n_vocab - 3, enc.n_vocab - 2,
                                                                             enc.n_vocab - 1]
    assert enc.n_vocab - 1 not in enc.encode_ordinary('</s>')  # text that looks special is just text
    assert len(enc.encode_ordinary('Straße')) < len('Straße'.encode())  # merges were learned and used


def test_tokenizer_loads_identically_from_dict_json_file_and_directory(tmp_path):
    root = tmp_path
    write_custom(root, {'train': toy_pairs(60, 13), 'valid': toy_pairs(5, 14), 'test': toy_pairs(5, 15)})
    data_prep.main(custom_args(root, root / 'out'))
    d = json.loads(json.dumps(data_prep.tokenizer_dict(str(root / 'out'))))  # as embedded in a checkpoint
    encs = [data_prep.load_tokenizer(x) for x in (d, str(root / 'out' / 'tokenizer.json'), str(root / 'out'))]
    for s in TRICKY:
        assert encs[0].encode_ordinary(s) == encs[1].encode_ordinary(s) == encs[2].encode_ordinary(s)


def test_a_given_tokenizer_encodes_new_data_with_its_own_ids(tmp_path, capsys):
    import torch
    write_custom(tmp_path, {'train': toy_pairs(60, 13), 'valid': toy_pairs(5, 14), 'test': toy_pairs(5, 15)})
    data_prep.main(custom_args(tmp_path, tmp_path / 'a'))
    tok = data_prep.tokenizer_dict(str(tmp_path / 'a'))
    torch.save({'tokenizer': tok, 'step': 2}, tmp_path / 'ckpt.pt')  # the key translate.read_checkpoint needs here
    mine = toy_pairs(40, 16)  # another corpus: its own BPE would differ
    write_custom(tmp_path, {'train': mine, 'valid': toy_pairs(5, 17), 'test': toy_pairs(5, 18)})
    args = [a for a in custom_args(tmp_path, tmp_path / 'b') if a not in ('--vocab-size', '300')]
    for source in (tmp_path / 'ckpt.pt', tmp_path / 'a', tmp_path / 'a' / 'tokenizer.json'):
        meta = data_prep.main(args + ['--tokenizer', str(source), '--force'])
        assert data_prep.same_tokenizer(data_prep.tokenizer_dict(str(tmp_path / 'b')), tok)
        assert meta['vocab_size'] == data_prep.load_meta(str(tmp_path / 'a'))['vocab_size']
        assert read_split(tmp_path / 'b', 'valid', 'xx') == [p[0] for p in toy_pairs(5, 17)]
    capsys.readouterr()
    data_prep.main(args + ['--tokenizer', str(tmp_path / 'a')])
    assert 'already prepared' in capsys.readouterr().out
    data_prep.main(args)  # its own BPE again: not the given one's output kept
    assert 'already prepared' not in capsys.readouterr().out
    assert not data_prep.same_tokenizer(data_prep.tokenizer_dict(str(tmp_path / 'b')), tok)


def test_a_given_tokenizer_that_is_none_is_a_one_line_error(tmp_path):
    write_custom(tmp_path, {'train': toy_pairs(20, 13), 'valid': toy_pairs(5, 14), 'test': toy_pairs(5, 15)})
    args = [a for a in custom_args(tmp_path, tmp_path / 'b') if a not in ('--vocab-size', '300')]
    (tmp_path / 'other.json').write_text('{"a": 1}')
    for source in ('missing.json', str(tmp_path / 'other.json'), str(tmp_path / 'train.xx')):
        res = subprocess.run([sys.executable, 'data_prep.py', *args, '--tokenizer', source], cwd=HERE,
                             capture_output=True, text=True)
        assert res.returncode == 1 and 'Traceback' not in res.stderr and source in res.stderr, res.stderr
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'ckpt.pt').write_bytes(b'')  # a train.py run's folder: its checkpoint holds the tokenizer
    with pytest.raises(SystemExit) as e:
        data_prep.main(args + ['--tokenizer', str(tmp_path / 'run')])
    assert 'give its ckpt.pt' in str(e.value)
    res = subprocess.run([sys.executable, 'data_prep.py', *custom_args(tmp_path, tmp_path / 'b'), '--tokenizer',
                          str(tmp_path / 'other.json')], cwd=HERE, capture_output=True, text=True)
    assert res.returncode == 2 and '--vocab-size is learned with the BPE' in res.stderr
    assert not (tmp_path / 'b' / 'meta.json').exists()


def test_a_tokenizer_that_cannot_encode_every_text_is_refused(tmp_path):
    write_custom(tmp_path, {'train': toy_pairs(40, 13), 'valid': toy_pairs(5, 14), 'test': toy_pairs(5, 15)})
    data_prep.main(custom_args(tmp_path, tmp_path / 'a'))
    tok = data_prep.tokenizer_dict(str(tmp_path / 'a'))
    n = len(tok['ranks'])
    broken = {'a rank given twice': {**tok, 'ranks': tok['ranks'][:-1] + [[tok['ranks'][-1][0], 0]]},
              'a byte missing': {**tok, 'ranks': [[b, r] for b, r in tok['ranks'] if r != 65]},
              'a special id that is a rank': {**tok, 'special_tokens': {'<pad>': 0, '<s>': n, '</s>': n + 1}},
              'two specials on one id': {**tok, 'special_tokens': {'<pad>': n, '<s>': n, '</s>': n + 1}}}
    args = [a for a in custom_args(tmp_path, tmp_path / 'b') if a not in ('--vocab-size', '300')]
    for what, d in broken.items():
        path = tmp_path / f"{what.replace(' ', '_')}.json"
        path.write_text(json.dumps(d))
        with pytest.raises(SystemExit) as e:  # tiktoken panics (not an Exception) or encodes wrongly otherwise
            data_prep.main(args + ['--tokenizer', str(path)])
        assert str(path) in str(e.value), what
    assert not (tmp_path / 'b' / 'meta.json').exists()


def test_batched_encoding_equals_encoding_each_line_alone():
    enc = data_prep.load_tokenizer(data_prep.train_tokenizer(iter(TRICKY * 3), 300, 'toy'))
    for lines in (TRICKY, [s for s in TRICKY if '</s>' not in s], ['a'], []):
        for workers in (1, 3):
            ids, lens = data_prep.encode_lines(enc, lines, workers)
            per_line = [enc.encode_ordinary(s) for s in lines]
            assert lens.tolist() == [len(x) for x in per_line]
            assert ids.tolist() == [t for x in per_line for t in x]

# -----------------------------------------------------------------------------------------------
# cleaning


def test_clean_rules_follow_moses_order_and_ratio_without_short_sentence_exception():
    ls = np.array([0, 3, 300, 300, 1, 2, 10, 2, 4])
    lt = np.array([5, 0, 10, 0, 2, 3, 15, 1, 7])
    keep, dropped = data_prep.clean_mask(ls, lt, max_len=250, max_ratio=1.5)
    # empty, empty, too long, empty (first rule wins), 1:2 ratio 2, 2:3 = 1.5 kept, 10:15 kept, 2:1, 4:7
    assert keep.tolist() == [False, False, False, False, False, True, True, False, False]
    assert dropped == {'empty': 3, 'too_long': 1, 'ratio': 3}
    keep, dropped = data_prep.clean_mask(ls, lt, max_len=0, max_ratio=0)  # 0 disables both
    assert dropped == {'empty': 3, 'too_long': 0, 'ratio': 0} and keep.sum() == 6


def test_cleaning_drops_training_pairs_only_and_counts_each_rule(tmp_path):
    bad = [('', 'leer'), ('empty target', '  '), ('the dog ' * 40, 'der Hund ' * 40),
           ('a', 'ein großer roter Hund läuft im Park'), ('Yes.', 'Ja.')]
    train, valid = toy_pairs(100, 16) + bad, toy_pairs(6, 17) + bad
    root = tmp_path
    write_custom(root, {'train': train, 'valid': valid, 'test': bad})
    meta = data_prep.main(custom_args(root, root / 'out', '--max-len', '30'))
    enc = data_prep.load_tokenizer(str(root / 'out'))
    kept = expected_kept(enc, train, max_len=30)
    assert list(zip(read_split(root / 'out', 'train', 'xx'), read_split(root / 'out', 'train', 'yy'))) == kept
    assert meta['dropped']['empty'] == 2 and meta['dropped']['too_long'] >= 1 and meta['dropped']['ratio'] >= 1
    assert sum(meta['dropped'].values()) == len(train) - len(kept) == meta['raw_pairs']['train'] - \
        meta['splits']['train']['pairs']
    for split, pairs in (('valid', valid), ('test', bad)):  # never filtered
        assert meta['splits'][split]['pairs'] == meta['raw_pairs'][split] == len(pairs)
        assert (root / 'out' / f'{split}.yy.txt').read_text('utf-8').split('\n')[:-1] == [p[1] for p in pairs]

# -----------------------------------------------------------------------------------------------
# reading and errors


def test_mismatched_line_counts_error_names_both_files_and_counts(tmp_path):
    (tmp_path / 'train.xx').write_text('a\nb\nc\nd\ne\nf\ng\n')
    (tmp_path / 'train.yy').write_text('a\nb\nc\nd\ne\n')
    write_custom(tmp_path, {'valid': toy_pairs(3, 18), 'test': toy_pairs(3, 19)})
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    msg = str(e.value)
    assert f'{tmp_path / "train.xx"} has 7 lines' in msg and f'{tmp_path / "train.yy"} has 5' in msg
    assert not (tmp_path / 'out' / 'meta.json').exists()


def test_invalid_utf8_error_names_file_and_line(tmp_path):
    (tmp_path / 'train.xx').write_bytes(b'fine\nalso fine\nbad \xff\xfe byte\n')
    (tmp_path / 'train.yy').write_bytes(b'gut\nauch gut\nschlecht\n')
    write_custom(tmp_path, {'valid': toy_pairs(3, 20), 'test': toy_pairs(3, 21)})
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    assert f'{tmp_path / "train.xx"} line 3: invalid UTF-8' in str(e.value)
    archive = tmp_path / 'a.tgz'  # inside an archive: archive and member
    archive.write_bytes(tgz({'dir/f.de': b'ok\n\xc3(\n'}))
    with pytest.raises(SystemExit) as e:
        list(data_prep.read_lines(str(archive), 'dir/f.de'))
    assert f'{archive}:dir/f.de line 2' in str(e.value)


def test_cli_errors_are_one_clean_message_not_a_traceback(tmp_path):
    (tmp_path / 'train.xx').write_text('a\nb\n')
    (tmp_path / 'train.yy').write_text('a\n')
    write_custom(tmp_path, {'valid': toy_pairs(3, 25), 'test': toy_pairs(3, 26)})
    r = subprocess.run([sys.executable, os.path.join(HERE, 'data_prep.py')] + custom_args(tmp_path, tmp_path / 'o'),
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and 'Traceback' not in r.stderr and 'line counts differ' in r.stderr


def test_out_of_range_settings_are_refused_not_quietly_replaced(tmp_path, capsys):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    for extra, message in [(['--vocab-size', '0'], 'at least 256'), (['--vocab-size', str(2 ** 32)], 'at most'),
                           (['--max-len', '-1'], '--max-len'),
                           (['--max-ratio', '-1'], '--max-ratio'), (['--max-ratio', 'nan'], '--max-ratio')]:
        with pytest.raises(SystemExit) as e:
            data_prep.main(custom_args(tmp_path, tmp_path / 'o', *extra))
        assert message in str(e.value) and not (tmp_path / 'o' / 'meta.json').exists()
    meta = data_prep.main(custom_args(tmp_path, tmp_path / 'o', '--vocab-size', '100000'))  # more than 50 pairs hold
    assert meta['vocab_size'] < 100000 and f"of the 100000 asked" in capsys.readouterr().out


def test_language_codes_that_are_not_file_name_parts_are_refused(tmp_path, capsys):
    write_custom(tmp_path, {'train': toy_pairs(20, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    for tgt in ('x/y', ''):  # a code names the files train.{code}.bin: not a path, not nothing
        with pytest.raises(SystemExit) as e:
            data_prep.main(custom_args(tmp_path, tmp_path / 'o', tgt=tgt))
        assert e.value.code == 2 and f'--tgt {tgt!r}' in capsys.readouterr().err
    assert not (tmp_path / 'o').exists()


@pytest.mark.parametrize('fails', ['write', 'fsync'])
def test_a_full_disk_is_a_one_line_error_that_leaves_no_temporary_files(tmp_path, monkeypatch, fails):
    import builtins
    import errno
    write_custom(tmp_path, {'train': toy_pairs(30, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    real_fsync, real_open, calls = os.fsync, builtins.open, []

    def full(fd):  # the 1st is tokenizer.json's; then the train split's files
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    def dev_full(path, *args, **kw):  # buffered bytes that no flush, and no close, can write
        return real_open('/dev/full' if str(path).endswith('valid.xx.txt.tmp') else path, *args, **kw)
    if fails == 'fsync':
        monkeypatch.setattr(os, 'fsync', full)
    elif os.path.exists('/dev/full'):
        monkeypatch.setattr(data_prep, 'open', dev_full, raising=False)
    else:
        pytest.skip('no /dev/full')
    with pytest.raises(SystemExit) as e:
        data_prep.main(custom_args(tmp_path, tmp_path / 'o'))
    assert str(e.value) == f"error: writing {tmp_path / 'o'}: {os.strerror(errno.ENOSPC)}"
    assert not [n for n in os.listdir(tmp_path / 'o') if n.endswith('.tmp') or n == 'meta.json']


def test_a_split_side_of_empty_lines_loads_as_empty_sentences(tmp_path):
    write_custom(tmp_path, {'train': toy_pairs(30, 9), 'valid': [(p[0], '') for p in toy_pairs(3, 10)],
                            'test': toy_pairs(5, 11)})
    data_prep.main(custom_args(tmp_path, tmp_path / 'o'))  # valid.yy.bin has no bytes: not a damaged folder
    src, src_idx, tgt, tgt_idx = data_prep.load_split(str(tmp_path / 'o'), 'valid')
    assert len(src_idx) == len(tgt_idx) == 4 and len(src) > 0 and len(tgt) == 0


def test_empty_training_split_after_reading_or_cleaning_is_an_error(tmp_path):
    for name, train in [('empty', []), ('all_dropped', [('one two three four five six', 'eins')] * 5)]:
        root = tmp_path / name
        root.mkdir()
        write_custom(root, {'train': train, 'valid': toy_pairs(3, 27), 'test': toy_pairs(3, 28)})
        with pytest.raises(SystemExit) as e:
            data_prep.main(custom_args(root, root / 'out'))
        assert 'the train split has no sentence pairs' in str(e.value) and str(root / 'train.xx') in str(e.value)
        assert not (root / 'out' / 'meta.json').exists()


def test_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    (tmp_path / 'f.txt').write_bytes('\ufeffHallo Welt\nzwei\n'.encode('utf-8'))
    (tmp_path / 'g.txt.gz').write_bytes(gzip.compress('\ufeffeins\n'.encode('utf-8')))
    assert list(data_prep.read_lines(str(tmp_path / 'f.txt'))) == ['Hallo Welt', 'zwei']
    assert list(data_prep.read_lines(str(tmp_path / 'g.txt.gz'))) == ['eins']


def test_translating_needs_no_rustbpe():
    # Only preparing data trains a BPE; a GPU box or a server with tiktoken alone must import the rest.
    code = "import sys; sys.modules['rustbpe'] = None; import data_prep, translate, model"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=HERE)
    assert r.returncode == 0, r.stderr


def test_reads_gz_tgz_sgm_and_odd_line_breaks_without_shifting_lines(tmp_path):
    lines = ['plain', 'crlf ending', 'lone\rcarriage return', 'line\u2028separator', 'next\x85line', 'ÄÖÜ']
    raw = b'plain\ncrlf ending\r\nlone\rcarriage return\n' + 'line\u2028separator\nnext\x85line\nÄÖÜ\n'.encode()
    want = [line.replace('\r', ' ').replace('\u2028', ' ').replace('\x85', ' ') for line in lines]
    (tmp_path / 'f.txt').write_bytes(raw)
    (tmp_path / 'f.txt.gz').write_bytes(gzip.compress(raw))
    (tmp_path / 'a.tgz').write_bytes(tgz({'x/f.txt': raw, 'x/f.gz': gzip.compress(raw), 'x/t.sgm': sgm(lines[:1])}))
    assert list(data_prep.read_lines(str(tmp_path / 'f.txt'))) == want
    assert list(data_prep.read_lines(str(tmp_path / 'f.txt.gz'))) == want
    assert list(data_prep.read_lines(str(tmp_path / 'a.tgz'), 'x/f.txt')) == want
    assert list(data_prep.read_lines(str(tmp_path / 'a.tgz'), 'x/f.gz')) == want
    assert list(data_prep.read_lines(str(tmp_path / 'a.tgz'), 'x/t.sgm')) == ['plain']
    with pytest.raises(SystemExit, match='has no member x/missing'):
        list(data_prep.read_lines(str(tmp_path / 'a.tgz'), 'x/missing'))
    for line in want:  # what train.py's .read().splitlines() sees: one line each
        assert len(line.splitlines()) == 1


def test_killed_run_leaves_nothing_that_looks_finished_and_rerun_completes(tmp_path, monkeypatch):
    root = tmp_path
    write_custom(root, {'train': toy_pairs(120, 22), 'valid': toy_pairs(20, 23), 'test': toy_pairs(20, 24)})
    real, calls = data_prep.encode_lines, []

    def dying(*args):
        calls.append(1)
        if len(calls) == 4:  # train en, train de, valid en, then killed while encoding valid de
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(data_prep, 'encode_lines', dying)
    with pytest.raises(KeyboardInterrupt):
        data_prep.main(custom_args(root, root / 'out'))
    left = set(os.listdir(root / 'out'))
    assert 'meta.json' not in left
    assert 'valid.xx.txt.tmp' in left  # it did die half-way through writing valid
    assert not any(name.startswith(('valid.', 'test.')) and not name.endswith('.tmp') for name in left)
    monkeypatch.setattr(data_prep, 'encode_lines', real)
    meta = data_prep.main(custom_args(root, root / 'out'))
    assert not any(name.endswith('.tmp') for name in os.listdir(root / 'out'))
    data_prep.main(custom_args(root, root / 'fresh'))  # the same bytes as an uninterrupted run
    for name in os.listdir(root / 'fresh'):
        if name != 'meta.json':
            assert (root / 'out' / name).read_bytes() == (root / 'fresh' / name).read_bytes(), name
    assert meta['raw_pairs'] == {'train': 120, 'valid': 20, 'test': 20}


def test_two_runs_into_one_out_never_mix(tmp_path, monkeypatch):
    write_custom(tmp_path, {'train': toy_pairs(120, 22), 'valid': toy_pairs(20, 23), 'test': toy_pairs(20, 24)})
    real, paused, resume, errors = data_prep.encode_lines, threading.Event(), threading.Event(), []

    def slow(*args):  # the first run stops half-way through writing train
        if threading.current_thread().name == 'first':
            paused.set()
            resume.wait()
        return real(*args)

    def run(*extra):
        try:
            data_prep.main(custom_args(tmp_path, tmp_path / 'out', *extra))
        except BaseException as e:
            errors.append(e)
    monkeypatch.setattr(data_prep, 'encode_lines', slow)
    first = threading.Thread(target=run, name='first')
    first.start()
    assert paused.wait(timeout=60), errors
    second = threading.Thread(target=run, args=('--vocab-size', '350'))
    second.start()
    second.join(timeout=2)  # it must not delete or rename the first run's files meanwhile
    resume.set()
    first.join()
    second.join()
    meta = data_prep.load_meta(str(tmp_path / 'out'))
    assert errors == [] and meta['settings']['vocab_size'] == 350
    assert meta['vocab_size'] == data_prep.load_tokenizer(str(tmp_path / 'out')).n_vocab
    assert len(read_split(tmp_path / 'out', 'train', 'xx')) == meta['splits']['train']['pairs']


def test_a_folder_that_cannot_be_locked_is_prepared_with_a_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(fcntl, 'flock', no_flock)  # as on Lustre mounted without flock
    write_custom(tmp_path, {'train': toy_pairs(30, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    assert data_prep.main(custom_args(tmp_path, tmp_path / 'out'))['splits']['train']['pairs'] > 0
    assert 'cannot be locked' in capsys.readouterr().out


def test_only_our_own_leftovers_are_removed_from_out(tmp_path):
    write_custom(tmp_path, {'train': toy_pairs(50, 9), 'valid': toy_pairs(5, 10), 'test': toy_pairs(5, 11)})
    (tmp_path / 'out').mkdir()
    for name in ('train.zz.bin.tmp', 'meta.json.tmp', 'hyp.de.a1b2c3d4.tmp'):  # killed runs', and translate.py's
        (tmp_path / 'out' / name).write_text('x')
    data_prep.main(custom_args(tmp_path, tmp_path / 'out'))
    assert [name for name in os.listdir(tmp_path / 'out') if name.endswith('.tmp')] == ['hyp.de.a1b2c3d4.tmp']


def test_import_has_no_side_effects(tmp_path):
    r = subprocess.run([sys.executable, '-c', f'import sys; sys.path.insert(0, {HERE!r}); import data_prep'],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == r.stderr == '' and os.listdir(tmp_path) == []

# -----------------------------------------------------------------------------------------------
# the real Multi30k


@pytest.mark.skipif(not os.path.isdir(MULTI30K), reason='no ../shared/data/multi30k beside the repo')
def test_multi30k_en_de_full_preparation(tmp_path):
    out = tmp_path / 'm30k'
    meta = data_prep.main(['multi30k', '--src', 'en', '--tgt', 'de', '--out', str(out), '--workers', '2'])
    assert meta['raw_pairs'] == {'train': 29000, 'valid': 1014, 'test': 1000}
    assert meta['splits']['valid']['pairs'] == 1014 and meta['splits']['test']['pairs'] == 1000
    assert meta['splits']['train']['pairs'] + sum(meta['dropped'].values()) == 29000
    assert meta['dropped']['ratio'] < 0.05 * 29000
    ref = gzip.open(os.path.join(MULTI30K, 'test_2016_flickr.de.gz'), 'rt', encoding='utf-8').read()
    assert (out / 'test.de.txt').read_text('utf-8') == ref
    assert read_split(out, 'test', 'de') == [line.strip() for line in ref.splitlines()]


def test_collate_puts_bos_eos_and_padding_where_the_model_expects_them():
    data = (np.array([5, 6, 7, 8], np.uint16), np.array([0, 3, 4]), np.array([9, 10, 11], np.uint16), np.array([0, 1, 3]))
    src, tgt_in, tgt_out = data_prep.collate(data, [1, 0], pad_id=0, bos_id=1, eos_id=2)
    assert src.tolist() == [[8, 2, 0, 0], [5, 6, 7, 2]]
    assert tgt_in.tolist() == [[1, 10, 11], [1, 9, 0]]
    assert tgt_out.tolist() == [[10, 11, 2], [9, 2, 0]]
    assert {x.dtype for x in (src, tgt_in, tgt_out)} == {np.dtype(np.int64)}


def test_collate_equals_building_each_row_alone():
    rng = np.random.default_rng(0)
    lens = [rng.integers(0, 9, 50) for _ in range(2)]  # valid and test are not cleaned: empty sides occur
    data = []
    for n in lens:
        data += [rng.integers(3, 100, int(n.sum())).astype(np.uint16), np.concatenate([[0], np.cumsum(n)])]
    ids = rng.permutation(50)[:17]
    src, tgt_in, tgt_out = data_prep.collate(tuple(data), ids, 0, 1, 2)
    for row, i in enumerate(ids):
        s = data[0][data[1][i]:data[1][i + 1]].tolist()
        t = data[2][data[3][i]:data[3][i + 1]].tolist()
        assert src[row].tolist() == s + [2] + [0] * (src.shape[1] - len(s) - 1)
        assert tgt_in[row].tolist() == [1] + t + [0] * (tgt_in.shape[1] - len(t) - 1)
        assert tgt_out[row].tolist() == t + [2] + [0] * (tgt_out.shape[1] - len(t) - 1)
