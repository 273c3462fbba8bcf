"""
Reading a dataset that data_prep.py prepared (docs/formats.md): its meta.json and tokenizer, the token files
of a split, and the batches train.py draws from them.
"""
import base64
import json
import os
import sys

import numpy as np
import tiktoken


def read_json(path):
    with open(path, encoding='utf-8') as f:
        try:
            return json.load(f)
        except ValueError as e:  # which file, not only where in it
            raise ValueError(f"{path}: {e}") from None


def tokenizer_dict(data_dir):  # the tokenizer of a prepared directory as a dict (checkpoints embed it)
    return read_json(os.path.join(data_dir, 'tokenizer.json'))


def read_tokenizer(source):  # the dict of a tokenizer given as one, a tokenizer.json or a prepared folder
    return source if isinstance(source, dict) else tokenizer_dict(source) if os.path.isdir(source) else \
        read_json(source)


def load_tokenizer(path_or_dict):
    """tiktoken.Encoding from a tokenizer dict, a tokenizer.json, or a prepared data directory."""
    d = read_tokenizer(path_or_dict)
    return tiktoken.Encoding(name=d.get('name', 'data_prep'), pat_str=d['pattern'],
                             mergeable_ranks={base64.b64decode(b): r for b, r in d['ranks']},
                             special_tokens=dict(d['special_tokens']))


def same_tokenizer(a, b):  # the name is a label (the data folder's): pattern, merges and specials are all
    return {k: v for k, v in a.items() if k != 'name'} == {k: v for k, v in b.items() if k != 'name'}


def load_meta(data_dir):  # meta.json: languages, vocabulary size, special ids, token dtype, split sizes
    return read_json(os.path.join(data_dir, 'meta.json'))


def load_split(data_dir, split):
    """-> memory-mapped src tokens, src offsets, tgt tokens, tgt offsets; sentence i: tokens[o[i]:o[i + 1]]"""
    damaged = f'error: {data_dir} is incomplete or damaged ({split}'
    try:
        meta, sides = load_meta(data_dir), []
        for lang in (meta['src'], meta['tgt']):
            path = os.path.join(data_dir, f'{split}.{lang}.bin')  # no bytes: a side of empty lines
            sides += [np.memmap(path, dtype=meta['dtype'], mode='r') if os.path.getsize(path) else
                      np.zeros(0, meta['dtype']), np.fromfile(path[:-3] + 'idx', dtype=np.int64)]
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a dtype numpy does not know
        sys.exit(f'{damaged}: {e}): prepare it again with data_prep.py')
    for lang, tokens, offsets in ((meta['src'], *sides[:2]), (meta['tgt'], *sides[2:])):  # cut short, say
        if (len(offsets) != len(sides[1]) or len(offsets) == 0 or offsets[0] != 0
                or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any()):
            sys.exit(f'{damaged}.{lang}.idx does not match {split}.{meta["src"]}.idx or the {len(tokens)} '
                     f'tokens of {split}.{lang}.bin): prepare it again with data_prep.py')
    return tuple(sides)


def token_batches(sizes, order, max_tokens):
    """fairseq's batches: runs of `order` (indices into sizes, sorted by length) of count x largest size <=
    max_tokens, or of one item."""
    order = np.asarray(order, dtype=np.int64)
    batches, start, biggest = [], 0, 0
    for i, size in enumerate(np.asarray(sizes)[order].tolist()):
        if i > start and (i + 1 - start) * max(biggest, size) > max_tokens:
            batches.append(order[start:i])
            start, biggest = i, 0
        biggest = max(biggest, size)
    return batches + [order[start:]] if len(order) else batches


def pair_sizes(data):
    """The padded tokens a pair of a split from load_split takes per side: its longer side + EOS (or BOS)."""
    _, src_idx, _, tgt_idx = data
    return np.maximum(np.diff(src_idx), np.diff(tgt_idx)) + 1


def batch_plan(data, max_tokens, seed, epoch, shuffle=True):
    """train.py's batches of an epoch, as fairseq's: pairs shuffled, stably sorted by length, filled up to
    max_tokens padded tokens, the batches shuffled; the same on every rank."""
    size, rng = pair_sizes(data), np.random.default_rng([seed, epoch])
    order = rng.permutation(len(size)) if shuffle else np.arange(len(size))
    order = order[np.argsort(size[order], kind='stable')]
    batches = token_batches(size, order[size[order] <= max_tokens], max_tokens)  # longer ones fit no batch
    return [batches[i] for i in rng.permutation(len(batches))] if shuffle else batches


def collate(data, ids, pad_id, bos_id, eos_id):
    """Pairs ids of load_split's split -> int64 src (+ EOS), tgt_in (BOS +) padded to their longest row, the
    real tokens' rows of the B * T target positions and their targets (+ EOS); one gather per side."""
    src_tok, src_idx, tgt_tok, tgt_idx = data
    ids, rows = np.asarray(ids, dtype=np.int64), np.arange(len(ids))
    def side(tok, idx):  # each row's tokens, padded to the longest + 1; and the lengths
        start, n = idx[ids], idx[ids + 1] - idx[ids]
        cols = np.arange(n.max() + 1)
        at = np.minimum(start[:, None] + cols, max(len(tok) - 1, 0))
        return np.where(cols < n[:, None], tok[at] if len(tok) else 0, pad_id).astype(np.int64), n
    (src, n_src), (tgt, n_tgt) = side(src_tok, src_idx), side(tgt_tok, tgt_idx)
    tgt_in = np.concatenate([np.full((len(ids), 1), bos_id, np.int64), tgt[:, :-1]], axis=1)
    src[rows, n_src], tgt[rows, n_tgt] = eos_id, eos_id
    real = np.flatnonzero(np.arange(tgt.shape[1]) <= n_tgt[:, None])  # the loss sees those alone
    return src, tgt_in, real, tgt.reshape(-1)[real]
