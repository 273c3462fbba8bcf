"""
What training reads at run time from a folder that data_prep.py prepared (docs/formats.md): its
meta.json and tokenizer, the token files of a split, and the batches and updates train.py draws
from them.
"""
import base64
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tiktoken


def read_json(path):
    with open(path, encoding='utf-8') as f:
        try:
            return json.load(f)
        except ValueError as e:  # which file, not only where in it
            raise ValueError(f"{path}: {e}") from None


def tokenizer_dict(data_dir):
    """The tokenizer of a prepared folder as a dict (checkpoints embed it)."""
    return read_json(os.path.join(data_dir, 'tokenizer.json'))


def read_tokenizer(source):
    """The dict of a tokenizer given as one, as a tokenizer.json or as a prepared folder."""
    if isinstance(source, dict):
        return source
    if os.path.isdir(source):
        return tokenizer_dict(source)
    return read_json(source)


def load_tokenizer(path_or_dict):
    """tiktoken.Encoding from a tokenizer dict, a tokenizer.json, or a prepared data directory."""
    d = read_tokenizer(path_or_dict)
    ranks = {base64.b64decode(b): r for b, r in d['ranks']}
    return tiktoken.Encoding(name=d.get('name', 'data_prep'), pat_str=d['pattern'],
                             mergeable_ranks=ranks, special_tokens=dict(d['special_tokens']))


def same_tokenizer(a, b):
    """Whether two tokenizer dicts encode alike: the name is only a label (the data folder's)."""
    a_rest = {k: v for k, v in a.items() if k != 'name'}
    b_rest = {k: v for k, v in b.items() if k != 'name'}
    return a_rest == b_rest


def load_meta(data_dir):
    """meta.json: languages, vocabulary size, special ids, token dtype, split sizes."""
    return read_json(os.path.join(data_dir, 'meta.json'))


def open_prepared(data_dir):
    """A prepared folder -> (meta, tokenizer dict, tiktoken encoding, validation references: the
    text of valid's target side); a missing or damaged folder is a one-line error."""
    if not os.path.exists(os.path.join(data_dir, 'meta.json')):
        sys.exit(f"no prepared data in {data_dir}: prepare it, "
                 f"`python data_prep.py CORPUS ... --out {data_dir}`")
    try:
        meta = load_meta(data_dir)
        tokenizer = tokenizer_dict(data_dir)
        # train.py reads these: an error here, not a traceback at the first step or save
        for key in ('pad_id', 'bos_id', 'eos_id', 'vocab_size', 'splits'):
            if key not in meta:
                raise KeyError(key)
        if type(meta['vocab_size']) is not int:
            raise TypeError(f"vocab_size {meta['vocab_size']!r}")
        enc = load_tokenizer(tokenizer)
        with open(os.path.join(data_dir, f"valid.{meta['tgt']}.txt"), encoding='utf-8') as f:
            valid_ref = f.read().splitlines()
        pairs = meta['splits']['valid']['pairs']
        if len(valid_ref) != pairs:  # validation BLEU pairs them line by line
            raise ValueError(f"valid.{meta['tgt']}.txt has {len(valid_ref)} lines, valid "
                             f"{pairs} pairs")
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {data_dir} is incomplete or damaged ({type(e).__name__}: {e}): "
                 f"prepare it again")
    return meta, tokenizer, enc, valid_ref


def load_split(data_dir, split):
    """-> src tokens, src offsets, tgt tokens, tgt offsets (the tokens memory-mapped, the offsets
    read); sentence i is tokens[offsets[i]:offsets[i + 1]]."""
    damaged = f'error: {data_dir} is incomplete or damaged ({split}'
    try:
        meta = load_meta(data_dir)
        sides = []
        for lang in (meta['src'], meta['tgt']):
            path = os.path.join(data_dir, f'{split}.{lang}.bin')
            if os.path.getsize(path):
                tokens = np.memmap(path, dtype=meta['dtype'], mode='r')
            else:  # no bytes, which memmap refuses: a side of empty lines
                tokens = np.zeros(0, meta['dtype'])
            offsets = np.fromfile(path[:-3] + 'idx', dtype=np.int64)
            sides += [tokens, offsets]
    except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: a dtype unknown to numpy
        sys.exit(f'{damaged}: {e}): prepare it again with data_prep.py')
    n_offsets = len(sides[1])  # the source side's
    for i, lang in enumerate((meta['src'], meta['tgt'])):  # a file cut short, say
        tokens, offsets = sides[2 * i], sides[2 * i + 1]
        if (len(offsets) != n_offsets or len(offsets) == 0 or offsets[0] != 0
                or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any()):
            against = f'the {len(tokens)} tokens of {split}.{lang}.bin'
            if lang != meta['src']:  # the target side: also as many sentences as the source
                against = f'{split}.{meta["src"]}.idx or {against}'
            sys.exit(f'{damaged}.{lang}.idx does not match {against}): '
                     'prepare it again with data_prep.py')
        # An id past the vocabulary fails the first step (on a GPU, as a device-side assert).
        if len(tokens) and tokens.max() >= meta['vocab_size']:
            sys.exit(f'{damaged}.{lang}.bin holds ids past vocab_size {meta["vocab_size"]}): '
                     'prepare it again with data_prep.py')
    return tuple(sides)


def token_batches(sizes, order, max_tokens):
    """fairseq's batches: runs of `order` (indices into sizes, sorted by length) whose count times
    their largest size is at most max_tokens, or of one item."""
    order = np.asarray(order, dtype=np.int64)
    batches = []
    start = 0
    biggest = 0
    for i, size in enumerate(np.asarray(sizes)[order].tolist()):
        if i > start and (i + 1 - start) * max(biggest, size) > max_tokens:
            batches.append(order[start:i])
            start = i
            biggest = 0
        biggest = max(biggest, size)
    if len(order):
        batches.append(order[start:])
    return batches


def pair_sizes(data):
    """The padded tokens a pair of a split from load_split takes per side: its longer side + EOS
    (or BOS)."""
    _, src_idx, _, tgt_idx = data
    return np.maximum(np.diff(src_idx), np.diff(tgt_idx)) + 1


def check_sizes(train_data, valid_data, max_tokens, max_len, data_dir, log):
    """Pairs that fit no batch of max_tokens, and validation pairs over the model's max_len, are
    left out of training and of the validation loss, with a warning (validation BLEU leaves out
    sources over max_len); a split of which none fits, or a kept training pair over max_len, is an
    error."""
    for split, data in (('training', train_data), ('validation', valid_data)):
        sizes = pair_sizes(data)
        if len(sizes) and sizes.min() > max_tokens:
            sys.exit(f"max_tokens={max_tokens} is below every {split} pair: "
                     f"raise it to at least {sizes.min()}")
        too_long = np.zeros(len(sizes), dtype=bool)
        if split == 'validation':  # data_prep.py --max-len filters training pairs only
            too_long = sizes > max_len
        if len(sizes) and too_long.all():
            sys.exit(f"every validation pair of {data_dir} is over the model's max_len={max_len} "
                     f"tokens (with EOS)")
        if too_long.any():
            log(f"warning: {too_long.sum()} validation pairs are over the model's "
                f"max_len={max_len} tokens (with EOS) and are left out of the validation loss")
        too_big = (sizes > max_tokens) & ~too_long
        if too_big.any():
            log(f"warning: {too_big.sum()} {split} pairs need more than max_tokens={max_tokens} "
                f"padded tokens and are left out; max_tokens={sizes[~too_long].max()} would "
                f"keep them all")
        kept = sizes[~too_big & ~too_long]
        if kept.max(initial=0) > max_len:  # past it, positions have no encoding
            sys.exit(f"{data_dir} has training sentences over the model's max_len={max_len} "
                     f"tokens (with EOS): raise max_len, or leave them out "
                     f"(data_prep.py --max-len)")


def batch_plan(data, max_tokens, seed, epoch, shuffle=True, max_len=None):
    """train.py's batches of an epoch, as fairseq's: pairs shuffled, stably sorted by length, filled
    up to max_tokens padded tokens, the batches shuffled; the same on every rank. max_len: pairs
    over it are left out too (validation's, see check_sizes)."""
    size = pair_sizes(data)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(size)) if shuffle else np.arange(len(size))
    order = order[np.argsort(size[order], kind='stable')]
    longest = max_tokens  # a longer pair fits no batch
    if max_len is not None:
        longest = min(max_tokens, max_len)
    fits = size[order] <= longest
    batches = token_batches(size, order[fits], max_tokens)
    if not shuffle:
        return batches
    return [batches[i] for i in rng.permutation(len(batches))]


def updates(data, max_tokens, seed, rank, world, update_freq, epoch, batch_idx, make_batch):
    """-> the updates from batch batch_idx of epoch on, of world x update_freq batches each from
    batch_plan's epochs: each the epoch, the next batch_idx, the update's target tokens (+ EOS:
    what the loss counts) and this rank's batches, made by make_batch(ids) in a background thread
    while the step before runs. Micro-step m takes batch m * world + rank. The last batches of an
    epoch that do not fill an update are left out. A training set too small for one update is
    refused here, before any work, not in that thread."""
    plan = batch_plan(data, max_tokens, seed, epoch)
    n = world * update_freq
    if n > len(plan):
        sys.exit(f"the training set makes {len(plan)} batches of max_tokens={max_tokens}, "
                 f"fewer than the {n} an update needs ({world} process(es) x update_freq "
                 f"{update_freq})")
    tgt_len = np.diff(data[3]) + 1

    def each_update(plan, epoch, batch_idx):
        while True:
            for start in range(batch_idx, len(plan) - n + 1, n):
                update = plan[start:start + n]
                ntok = sum(int(tgt_len[ids].sum()) for ids in update)
                yield epoch, start + n, ntok, [make_batch(ids) for ids in update[rank::world]]
            epoch += 1
            batch_idx = 0
            plan = batch_plan(data, max_tokens, seed, epoch)

    return prefetched(each_update(plan, epoch, batch_idx))


def sources(data, rank, world, max_len, eos_id):
    """{pair index: source ids + EOS} of every world-th pair from rank on, but the empty ones and
    those over max_len: what validation BLEU translates."""
    tok, idx = data[0], data[1]
    srcs = {}
    for i in range(rank, len(idx) - 1, world):
        n = idx[i + 1] - idx[i]
        if 0 < n < max_len:
            srcs[i] = tok[idx[i]:idx[i + 1]].tolist() + [eos_id]
    return srcs


def padded_side(tok, idx, ids, pad_id):
    """One side of pairs ids: a row of int64 tokens per pair, padded to the longest + 1; and the
    lengths."""
    start = idx[ids]
    n = idx[ids + 1] - start
    cols = np.arange(n.max() + 1)
    at = np.minimum(start[:, None] + cols, max(len(tok) - 1, 0))  # padding reads a real token
    if len(tok):
        picked = tok[at]
    else:  # a side of empty lines has no token to read
        picked = 0
    return np.where(cols < n[:, None], picked, pad_id).astype(np.int64), n


def collate(data, ids, pad_id, bos_id, eos_id):
    """Pairs ids of load_split's split -> int64 src (+ EOS), tgt_in (BOS +) padded to their longest
    row, the real tokens' rows of the B * T target positions and their targets (+ EOS); one gather
    per side."""
    src_tok, src_idx, tgt_tok, tgt_idx = data
    ids = np.asarray(ids, dtype=np.int64)
    rows = np.arange(len(ids))
    src, n_src = padded_side(src_tok, src_idx, ids, pad_id)
    tgt, n_tgt = padded_side(tgt_tok, tgt_idx, ids, pad_id)
    bos = np.full((len(ids), 1), bos_id, np.int64)
    tgt_in = np.concatenate([bos, tgt[:, :-1]], axis=1)
    src[rows, n_src] = eos_id
    tgt[rows, n_tgt] = eos_id
    real = np.flatnonzero(np.arange(tgt.shape[1]) <= n_tgt[:, None])  # the loss sees those alone
    return src, tgt_in, real, tgt.reshape(-1)[real]


def prefetched(items):
    """The next item is made by a background thread while this one is used (a training step)."""
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(next, items)
        while True:
            item = job.result()
            job = pool.submit(next, items)
            yield item
