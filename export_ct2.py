"""
Export a checkpoint to a CTranslate2 model directory, for fast CPU/GPU serving (int8 on CPU, float16
on GPU); and CT2Model, with which translate.py decodes such an export.

    python export_ct2.py --ckpt out/multi30k_en_de/ckpt.pt --out out/multi30k_en_de/ct2 \
        --quantization int8
    python export_ct2.py --ckpt out/multi30k_en_de --average-last 5 --out out/multi30k_en_de/ct2_5
    python translate.py --ckpt out/multi30k_en_de/ct2 --input test.en --ref test.de  # serve it

The weights go through CTranslate2's own model specification (ctranslate2.specs.TransformerSpec),
as its fairseq and OpenNMT-py converters do; the directory holds model.bin, config.json,
shared_vocabulary.json, and besides them tokenizer.json (data_prep's format) and export_ct2.json
(our Config, the source checkpoints, the quantization), so that translate.py applies the same rules
as with the checkpoint.

Vocabulary: a token's string is its id in decimal ("0", "1", ...), except the specials, which keep
their names ("<pad>", "<s>", "</s>"); ids past the tokenizer's (vocab_size padded for speed) are
numbered too, and CT2Model suppresses them with "<pad>" and "<s>", as model.py never generates them.
To call CTranslate2 directly: tokens = [str(i) for i in enc.encode_ordinary(text)]; the export
appends "</s>" to the source itself (add_source_eos, as the fairseq converter sets) and starts the
decoder with "<s>". The byte-level BPE has no unknown token, so "<pad>" stands in as unk_token (else
CTranslate2 would append an "<unk>" entry that has no embedding row).

As CTranslate2's converters, an existing --out is refused without --force; with --force it is
replaced, but only if it is an earlier export (never, say, a training folder). The export is written
into a sibling temporary directory and renamed into place, so a half-written export never looks
finished.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import torch

import checkpoint
import dataset
import decode
import model as M
from checkpoint import fail

try:  # translate.py imports this file, and serves checkpoints without CTranslate2
    import ctranslate2
    from ctranslate2.specs import common_spec, model_spec, transformer_spec
except ImportError:
    ctranslate2 = None

CT2_MARKER = 'export_ct2.json'  # our Config and provenance, next to CTranslate2's model.bin
# An export's folder: CTranslate2's files (a shared vocabulary, or one per side) and ours.
EXPORT_FILES = {'model.bin', 'config.json', 'shared_vocabulary.json', 'source_vocabulary.json',
                'target_vocabulary.json', 'tokenizer.json', CT2_MARKER}

# -----------------------------------------------------------------------------------------------
# the export


def array(t):
    # A copy: quantization scales the arrays in place; a view would scale the caller's model too.
    return t.detach().float().cpu().numpy().copy()


def set_linear(spec, linear):
    spec.weight = array(linear.weight)
    spec.bias = array(linear.bias)


def set_norm(spec, norm):
    spec.gamma = array(norm.weight)
    spec.beta = array(norm.bias)


def set_inputs(spec, model):
    # CTranslate2 generates its sinusoids as [sin | cos] halves from position 1; ours interleave sin
    # and cos from position 0 (section 3.5), so the table goes in as explicit encodings, as a
    # learned one does.
    emb = spec.embeddings
    if isinstance(emb, list):  # the encoder's: one table per source feature
        emb = emb[0]
    emb.weight = array(model.embed.weight)
    spec.scale_embeddings = True  # x sqrt(d_model), section 3.4
    spec.position_encodings.encodings = array(model.pe)


def set_encoder_layer(s, layer):
    # qkv_proj's rows are [Q; K; V], the order of CTranslate2's fused self-attention linear[0].
    set_linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
    set_linear(s.self_attention.linear[1], layer.self_attn.out_proj)
    set_norm(s.self_attention.layer_norm, layer.norm1)
    set_linear(s.ffn.linear_0, layer.ffn.w1)
    set_linear(s.ffn.linear_1, layer.ffn.w2)
    set_norm(s.ffn.layer_norm, layer.norm2)


def set_decoder_layer(s, layer):
    set_linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
    set_linear(s.self_attention.linear[1], layer.self_attn.out_proj)
    set_norm(s.self_attention.layer_norm, layer.norm1)
    set_linear(s.attention.linear[0], layer.cross_attn.q_proj)
    set_linear(s.attention.linear[1], layer.cross_attn.kv_proj)  # rows [K; V], as CTranslate2's
    set_linear(s.attention.linear[2], layer.cross_attn.out_proj)
    set_norm(s.attention.layer_norm, layer.norm2)
    set_linear(s.ffn.linear_0, layer.ffn.w1)
    set_linear(s.ffn.linear_1, layer.ffn.w2)
    set_norm(s.ffn.layer_norm, layer.norm3)


def vocabulary(cfg):
    """The export's token strings: each id in decimal, but the specials (module docstring)."""
    names = {cfg.pad_id: '<pad>', cfg.bos_id: '<s>', cfg.eos_id: '</s>'}
    return [names.get(i, str(i)) for i in range(cfg.vocab_size)]


def build_spec(model):
    cfg = model.cfg
    # As from_config builds it (which takes no head_dim): post-norm has no final LayerNorm, as our
    # enc_norm/dec_norm are Identity; d_head, where set, is CTranslate2's head_dim (Table 3: A, B).
    kw = dict(pre_norm=cfg.pre_norm, activation=common_spec.Activation.RELU,
              head_dim=cfg.d_head or None)
    encoder = transformer_spec.TransformerEncoderSpec(cfg.n_enc_layers, cfg.n_heads, **kw)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.n_dec_layers, cfg.n_heads, **kw)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    enc, dec = spec.encoder, spec.decoder
    set_inputs(enc, model)
    set_inputs(dec, model)
    # The output projection is the embedding matrix (section 3.4), without bias; CTranslate2 stores
    # the two once, as an alias, when it finds them equal.
    dec.projection.weight = array(model.embed.weight)
    if cfg.pre_norm:
        set_norm(enc.layer_norm, model.enc_norm)
        set_norm(dec.layer_norm, model.dec_norm)
    for s, layer in zip(enc.layer, model.encoder):
        set_encoder_layer(s, layer)
    for s, layer in zip(dec.layer, model.decoder):
        set_decoder_layer(s, layer)
    vocab = vocabulary(cfg)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)  # identical lists: saved once, as shared_vocabulary.json
    c = spec.config
    c.unk_token = '<pad>'
    c.bos_token = '<s>'
    c.eos_token = '</s>'
    c.decoder_start_token = '<s>'
    c.add_source_eos = True
    c.layer_norm_epsilon = 1e-5  # nn.LayerNorm's; CTranslate2 would otherwise guess from the model
    return spec


def check_architecture(cfg):
    """One line where this model.py computes what CTranslate2's Transformer cannot hold (a reader
    may have changed the activation, the embedding scale or added a parameter): a small model of
    cfg's kind, every parameter random, exported in float32 must score tokens as model.py does."""
    width = cfg.d_model
    if not cfg.d_head:
        width = 8 * cfg.n_heads
    small = dataclasses.replace(cfg, n_enc_layers=1, n_dec_layers=1, d_model=width, d_ff=32,
                                vocab_size=16, tokenizer_size=0, max_len=16,
                                pad_id=0, bos_id=1, eos_id=2)
    model = M.Transformer(small).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    src = [5, 6, 7, 8, 9]
    tgt = [10, 11, 12, 13]
    tokens = vocabulary(small)
    serve = "serve the checkpoint itself, translate.py --ckpt CKPT"
    with tempfile.TemporaryDirectory() as folder:
        try:
            spec = build_spec(model)
            spec.validate()
        except (AttributeError, ValueError) as e:  # a module renamed, or of another shape
            fail(f"this model.py's modules are not those export_ct2.py maps to CTranslate2's "
                 f"Transformer ({type(e).__name__}: {e}): {serve}")
        spec.optimize(quantization=None)
        spec.save(folder)
        translator = ctranslate2.Translator(folder, device='cpu', compute_type='float32')
        # the export appends EOS to the source, and scores the target's EOS too
        theirs = translator.score_batch([[tokens[t] for t in src]], [[tokens[t] for t in tgt]])
    with torch.no_grad():
        logits = model(torch.tensor([src + [small.eos_id]]), torch.tensor([[small.bos_id] + tgt]))
    ours = logits.log_softmax(-1)[0].gather(1, torch.tensor([tgt + [small.eos_id]]).T)[:, 0]
    apart = (ours - torch.tensor(theirs[0].log_probs)).abs().max().item()
    if apart > 1e-3:
        fail(f"this model.py computes what CTranslate2's Transformer cannot hold (a test export "
             f"scores tokens {apart:.3g} nats apart from it): {serve}")


def check_replaceable(out, force):
    # What --force would not replace is refused first: advising --force where it cannot help
    # only sends the user round.
    if not os.path.isfile(os.path.join(out, CT2_MARKER)):
        fail(f"{out} exists and is not an export of export_ct2.py; not replacing it")
    others = sorted(set(os.listdir(out)) - EXPORT_FILES)
    if others:  # --force replaces an export, not whatever else was put in its folder
        fail(f"{out} holds files that are not the export's ({', '.join(others[:4])}); "
             f"not replacing it")
    if not force:
        fail(f"{out} already exists; use --force to replace it")


def export(model, tokenizer, out, quantization='none', force=False, info=None):
    """Writes the CTranslate2 export of model (a model.Transformer) to the directory out."""
    # out/ names the folder, not a place inside it for the temporary one.
    out = os.path.normpath(out)
    if os.path.exists(out):
        check_replaceable(out, force)
    check_architecture(model.cfg)
    spec = build_spec(model)
    spec.validate()
    spec.optimize(quantization=None if quantization == 'none' else quantization)
    marker = {'format': 1, 'model_cfg': dataclasses.asdict(model.cfg),
              'quantization': quantization, 'ctranslate2': ctranslate2.__version__}
    if info:
        marker.update(info)
    tmp = f"{out}.tmp-{os.getpid()}"
    old = f"{out}.old-{os.getpid()}"
    try:
        os.makedirs(tmp)
        spec.save(tmp)
        with open(os.path.join(tmp, 'tokenizer.json'), 'w', encoding='utf-8') as f:
            json.dump(tokenizer, f)
        with open(os.path.join(tmp, CT2_MARKER), 'w', encoding='utf-8') as f:
            json.dump(marker, f, indent=1)
        if os.path.exists(out):  # the old export is moved aside only once the new one is complete
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException as e:  # Ctrl-C included: no half-written export, and the old one in place
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(out):
            os.rename(old, out)
        if isinstance(e, OSError):
            fail(f"cannot write {out}: {e.strerror or e}")
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


# -----------------------------------------------------------------------------------------------
# serving an export

def is_ct2_export(path):
    return os.path.isfile(os.path.join(path, CT2_MARKER))


class CT2Model:
    """An export decoded by ctranslate2.Translator, with what translate_lines needs of a model: cfg,
    device, train()/eval() (no-ops), and decode(), which returns what model.beam_search returns.

    The output cap is model.py's, a * |src incl. EOS| + b per sentence, exactly: CTranslate2 takes
    one max_decoding_length per call, so a batch is decoded under its longest cap and the sentences
    whose output reached their own cap are decoded again under it. CTranslate2 ranks finished
    hypotheses by log P / |Y|^alpha, not GNMT's penalty: all beam-size hypotheses are asked for,
    log P recovered from the score, and they are re-ranked as model.py ranks them (docs/serving.md
    says what still differs)."""
    training = False

    def __init__(self, path, device='cpu', compute_type='default'):
        if ctranslate2 is None:
            fail(f"{path} is a CTranslate2 export: pip install ctranslate2")
        try:
            with open(os.path.join(path, CT2_MARKER), encoding='utf-8') as f:
                marker = json.load(f)
            self.cfg = M.Config(**marker['model_cfg'])
            self.lenpen = marker.get('lenpen', 0.6)
            with open(os.path.join(path, 'shared_vocabulary.json'), encoding='utf-8') as f:
                self.tokens = json.load(f)
            kind, _, index = device.partition(':')
            threads = 0
            if kind == 'cpu':
                threads = torch.get_num_threads()  # OMP_NUM_THREADS, as torch
            self.translator = ctranslate2.Translator(
                path, device=kind, device_index=int(index or 0), compute_type=compute_type,
                intra_threads=threads)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            reason = str(e).strip()[:200]
            fail(f"cannot load CTranslate2 export {path}: {type(e).__name__}: {reason}")
        self.path = path
        self.device = torch.device('cpu')  # for the source tensors: CTranslate2 takes token lists
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.compute_type = self.translator.compute_type

    def train(self, mode=True):  # translate_lines' switch to eval mode and back is for torch models
        return self

    def eval(self):
        return self

    def decode(self, src, beam, alpha, max_len_a, max_len_b, nbest):
        cfg = self.cfg
        # As model.py: never PAD, BOS or the ids past the tokenizer's (vocab_size rounds up).
        n_tokens = cfg.tokenizer_size or cfg.vocab_size
        never = [['<pad>'], ['<s>']] + [[t] for t in self.tokens[n_tokens:]]
        limit = decode.max_lengths(self, src, max_len_a, max_len_b).tolist()
        # The export appends EOS itself (add_source_eos, as the fairseq converter sets it).
        rows = [[self.tokens[t] for t in row if t != cfg.pad_id][:-1] for row in src.tolist()]
        out = [None] * len(rows)
        todo = [i for i in range(len(rows)) if limit[i] > 1]
        short = [i for i in range(len(rows)) if limit[i] <= 1]  # a cap of 1: room for EOS only
        if short:
            scored = self.translator.score_batch([rows[i] for i in short], [[]] * len(short),
                                                 max_input_length=0)
            for i, s in zip(short, scored):
                score = sum(s.log_probs)
                if beam > 1:
                    score = score / decode.length_penalty(1, alpha)
                out[i] = [([], score)]
        if beam == 1 or alpha != 0:
            groups = [todo]
        else:
            # Without a penalty CTranslate2 stops early, and when it stopped cannot be told:
            # one call per cap.
            caps = sorted({limit[i] for i in todo})
            groups = [[i for i in todo if limit[i] == n] for n in caps]
        while groups:
            group = groups.pop()
            if not group:
                continue
            steps = max(limit[i] for i in group) - 1  # model.py's cap includes the EOS it forces
            results = self.translator.translate_batch(
                [rows[i] for i in group], beam_size=beam, num_hypotheses=beam,
                length_penalty=alpha if beam > 1 else 0, max_decoding_length=steps,
                min_decoding_length=0, max_input_length=0, return_scores=True,
                return_end_token=True, suppress_sequences=never)
            redo = {}
            finished = []
            for i, r in zip(group, results):
                # Search finished on the step its longest hypothesis ended; before this sentence's
                # own last step, a shorter cap would have found the same.
                longest = max(map(len, r.hypotheses))
                if limit[i] - 1 < steps and longest >= limit[i] - 1:
                    redo.setdefault(limit[i], []).append(i)
                else:
                    finished.append((i, r))
            logp = self.capped_logp(rows, finished)
            for i, r in finished:
                out[i] = self.rerank(r, beam, alpha, logp.get(i, {}))[:nbest]
            groups += redo.values()
        return out

    def capped_logp(self, rows, finished):
        """{sentence: {hypothesis: log P}} of the hypotheses that the cap ended: CTranslate2 ends
        them without EOS, and their score lacks EOS's log-probability, which model.py forces there
        and counts, so score_batch scores them again, appending EOS."""
        capped = [(i, h) for i, r in finished for h in r.hypotheses if h[-1:] != ['</s>']]
        logp = {}
        if not capped:
            return logp
        scored = self.translator.score_batch([rows[i] for i, _ in capped], [h for _, h in capped],
                                             max_input_length=0)
        for (i, h), s in zip(capped, scored):
            logp.setdefault(i, {})[tuple(h)] = sum(s.log_probs)
        return logp

    def rerank(self, result, beam, alpha, capped_logp):
        hyps = []
        for toks, score in zip(result.hypotheses, result.scores):
            ids = [self.ids[t] for t in toks]
            # A beam's score is log P / |Y|^alpha (CTranslate2's penalty); greedy's is log P.
            logp = score
            if beam > 1:
                logp = score * len(ids) ** alpha
            logp = capped_logp.get(tuple(toks), logp)
            if ids and ids[-1] == self.cfg.eos_id:
                ids.pop()
            # |Y| counts EOS, also where the cap cut the hypothesis off (model.py forces EOS there).
            if beam > 1:
                logp = logp / decode.length_penalty(len(ids) + 1, alpha)
            hyps.append((ids, logp))
        return sorted(hyps, key=lambda h: -h[1])


def load_ct2(path, device='cpu', compute_type='default'):
    """-> (CT2Model, tiktoken Encoding) of an export_ct2.py directory."""
    model = CT2Model(path, device, compute_type)
    try:
        enc = dataset.load_tokenizer(os.path.join(path, 'tokenizer.json'))
    except Exception as e:
        fail(f"{path}: cannot load its tokenizer: {type(e).__name__}: {e}")
    checkpoint.check_tokenizer(path, model.cfg, enc)
    return model, enc


# -----------------------------------------------------------------------------------------------
# command line

def main(argv=None):
    if ctranslate2 is None:
        fail("CTranslate2 is not installed: pip install ctranslate2")
    p = argparse.ArgumentParser(description="Export a checkpoint to a CTranslate2 model directory.")
    p.add_argument('--ckpt', required=True,
                   help="checkpoint file (with --average-last, a file or folder)")
    p.add_argument('--out', required=True, help="the CTranslate2 model directory to write")
    p.add_argument('--quantization', default='none',
                   choices=['none', *model_spec.ACCEPTED_MODEL_TYPES],
                   help="weight type: int8 for CPU, float16 for GPU; none keeps float32")
    p.add_argument('--average-last', type=int, default=0,
                   help="export the average of the newest N ckpt_STEP.pt")
    p.add_argument('--force', action='store_true',
                   help="replace --out if it holds an earlier export")
    args = p.parse_args(argv)
    if args.average_last:
        paths = checkpoint.newest_checkpoints(args.ckpt, args.average_last)
        averaged = checkpoint.average_checkpoints(paths)
        model, _, ckpt = checkpoint.load_checkpoint(paths[-1], 'cpu', averaged)
    else:
        if os.path.isdir(args.ckpt):
            checkpoint.fail(f"--ckpt {args.ckpt} is a folder: give a checkpoint file in it, or "
                            f"--average-last N to export the average of its newest ckpt_STEP.pt")
        paths = [args.ckpt]
        model, _, ckpt = checkpoint.load_checkpoint(args.ckpt, 'cpu')
    # load_checkpoint has just read the tokenizer: it resolves.
    tok = checkpoint.checkpoint_tokenizer(paths[-1], ckpt)
    info = {'checkpoints': [os.path.abspath(q) for q in paths], 'step': ckpt.get('step'),
            'lenpen': checkpoint.default_lenpen(ckpt)}
    out = export(model, tok, args.out, args.quantization, args.force, info)
    sources = ', '.join(os.path.basename(q) for q in paths)
    print(f"export_ct2.py: wrote {out} ({args.quantization}, "
          f"{model.num_params() / 1e6:.1f}M parameters, from {sources})", file=sys.stderr)


if __name__ == '__main__':
    checkpoint.stop_on_signals()
    try:
        main()
    except KeyboardInterrupt:  # a partial output is removed on the way out
        sys.exit("export_ct2.py: interrupted")
