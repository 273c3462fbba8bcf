"""
Pictures of a model's own runs: learning curves from train.py's log.jsonl, and attention heatmaps
from a checkpoint's forward pass (the paper's appendix figures).

    python plot.py curves out/multi30k_en_de -o curves.png                  # one run
    python plot.py curves out/pilot_a out/pilot_b -o curves.png --x minutes  # runs overlaid
    python plot.py attention --ckpt out/multi30k_en_de/ckpt.pt --src "A man is riding a bike." \
        -o attn.png
    python plot.py attention --ckpt out/multi30k_en_de/ckpt.pt --src "..." --tgt "..." \
        --layers 0 -1 --heads 0 1

A figure goes to the -o file; on a machine with a display it is also shown on screen, unless
--no-show.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

import checkpoint
import decode
import model as M


def fail(msg):
    raise SystemExit(f"plot.py: error: {msg}")


def pyplot(show):
    # The backend must be chosen before pyplot is imported: without a display, Agg draws to files.
    try:
        import matplotlib
    except ImportError:
        fail("plot.py needs matplotlib: pip install 'matplotlib>=3.7'")
    if not show:
        matplotlib.use('Agg')
    # A $ in a sentence, a token or a run's name is text: matplotlib would parse $...$ as TeX.
    matplotlib.rcParams['text.parse_math'] = False
    import matplotlib.pyplot as plt
    return plt


def has_display():
    if sys.platform in ('darwin', 'win32'):
        return True
    return bool(os.environ.get('DISPLAY') or os.environ.get('WAYLAND_DISPLAY'))


def figure_path(path):
    """The -o file, checked before any work: a format matplotlib writes (PNG without an extension),
    not a folder, its folder made if need be."""
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1]
    if ext[1:].lower() not in ('', *formats):
        fail(f"-o {path}: matplotlib writes {', '.join(sorted(formats))}, not {ext}")
    if os.path.isdir(path):
        fail(f"-o {path} is a folder")
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder or '.', exist_ok=True)
    except OSError as e:
        fail(f"-o {path}: cannot make the folder {folder}: {e.strerror}")
    return path


def save(fig, plt, path, show):
    # Written under a temporary name, then renamed: no reader sees half a PNG under the real name.
    kind = os.path.splitext(path)[1][1:] or 'png'
    try:
        tmp = checkpoint.temporary(path)
    except OSError as e:  # a read-only folder, a name too long
        fail(f"-o {path}: {e.strerror}")
    try:
        fig.savefig(tmp, format=kind, dpi=110, bbox_inches='tight')
        os.replace(tmp, path)
    except OSError as e:  # a full disk
        os.remove(tmp)
        fail(f"-o {path}: {e.strerror}")
    except BaseException:
        os.remove(tmp)
        raise
    print(f"plot.py: wrote {path}")
    if show:
        plt.show()
    plt.close(fig)


# -----------------------------------------------------------------------------------------------
# learning curves

# The numbers of train.py's records that read_log checks and the panels draw.
NUMBERS = ('loss', 'lr', 'tok_per_s', 'elapsed_min', 'valid_loss', 'valid_bleu')
PANELS = [  # (title, 0: training or 1: evaluation records, key)
    ('training loss (label-smoothed)', 0, 'loss'),
    ('validation loss (label-smoothed)', 1, 'valid_loss'),
    ('validation BLEU', 1, 'valid_bleu'),
    ('learning rate', 0, 'lr'),
    ('target tokens/s', 0, 'tok_per_s'),
]


def is_record(r):
    # A record of train.py: a dict with an int step, and numbers under the keys of NUMBERS.
    if not isinstance(r, dict) or type(r.get('step')) is not int:
        return False
    return all(type(r[k]) in (int, float) for k in NUMBERS if k in r)


def read_records(path):
    """train.py's records in the log at path, without their non-finite values; the lines and values
    left out are counted in a warning."""
    records = []
    bad = 0
    odd = 0
    try:
        f = open(path, encoding='utf-8', errors='replace')
    except OSError as e:  # not readable by this user
        fail(f"{path}: {e.strerror}")
    with f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                r = None  # e.g. a last line cut short by a crash
            if is_record(r):
                # train.py logs a NaN loss as NaN: left out, not drawn.
                finite = {k: v for k, v in r.items() if k not in NUMBERS or np.isfinite(v)}
                odd += len(r) - len(finite)
                records.append(finite)
            elif line.strip():
                bad += 1
    if bad:
        print(f"plot.py: warning: {path}: skipped {bad} line(s) that are not train.py's records",
              file=sys.stderr)
    if odd:
        print(f"plot.py: warning: {path}: {odd} non-finite value(s), not drawn", file=sys.stderr)
    return records


def read_log(path):
    """A run folder or its log.jsonl -> (training records, evaluation records), each record with a
    'minutes' of training time: evaluation lines have none, so theirs is interpolated by step, and
    after a resume the clock goes on (train.py keeps the training time in its state; an older
    train.py started it at zero, and then it goes on from the last step kept)."""
    if os.path.isdir(path):
        path = os.path.join(path, 'log.jsonl')
    if not os.path.isfile(path):
        fail(f"{path} not found")
    train = []
    evals = []
    offset = 0.0
    last = 0.0
    for r in read_records(path):
        if 'loss' in r:
            if train and r['step'] <= train[-1]['step']:
                # A resumed run appends to the log: what it redoes replaces what was logged.
                train = [t for t in train if t['step'] < r['step']]
                evals = [e for e in evals if e['step'] < r['step']]
            minutes = r.get('elapsed_min', last)
            kept = train[-1]['minutes'] if train else 0.0
            # A resumed process's clock goes on from the time kept in its state; one that is behind
            # the last step kept started at zero (train.py before it kept the time): it goes on from
            # that step.
            if minutes < last and offset + minutes < kept:
                offset = kept
            last = minutes
            train.append({**r, 'minutes': offset + minutes})
        elif 'valid_loss' in r:
            evals.append(dict(r))
    if not train and not evals:
        fail(f"{path} holds no training or validation records")
    steps = [t['step'] for t in train]
    minutes = [t['minutes'] for t in train]
    for e in evals:
        if train:
            e['minutes'] = float(np.interp(e['step'], steps, minutes))
        else:
            e['minutes'] = float('nan')
    return train, evals


def run_name(run):
    # The name of a run's folder (of a log.jsonl, the folder it is in).
    folder = run
    if not os.path.isdir(run):
        folder = os.path.dirname(run) or '.'
    return os.path.basename(os.path.normpath(folder))


def draw_run(ax, i, pts, label, evaluation):
    # Ten colours, then the next line style: run 10 is not drawn as run 0 again.
    color = f'C{i % 10}'
    style = ('-', '--', ':', '-.')[i // 10 % 4]
    # Evaluations are few: markers show where they were taken; so does a lone point, no line.
    marker = None
    if evaluation or len(pts) == 1:
        marker = 'o'
    xs, ys = zip(*pts)
    ax.plot(xs, ys, color=color, linestyle=style, label=label, marker=marker, markersize=3)


def plot_curves(runs, out, x='step', labels=None, show=False):
    plt = pyplot(show)
    out = figure_path(out)
    logs = [read_log(r) for r in runs]
    for run, (train, _) in zip(runs, logs):
        if x == 'minutes' and not train:  # evaluation records have no clock of their own
            fail(f"{run}: log.jsonl has no training records, so no minutes: plot it with --x step")
    if not labels:
        labels = [run_name(r) for r in runs]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    axes = axes.ravel()
    for ax, (title, which, key) in zip(axes, PANELS):
        for i, (log, label) in enumerate(zip(logs, labels)):
            pts = [(r[x], r[key]) for r in log[which] if key in r]
            if pts:
                draw_run(ax, i, pts, label, which)
        if not ax.lines:
            ax.text(0.5, 0.5, 'not in the log', ha='center', va='center', transform=ax.transAxes,
                    color='gray')
        ax.set_title(title)
        ax.set_xlabel('minutes' if x == 'minutes' else 'step')
        ax.grid(alpha=0.3)
    axes[3].ticklabel_format(axis='y', style='sci', scilimits=(-3, 3))
    # The sixth cell holds the legend: one entry per run, shared by all panels.
    axes[5].axis('off')
    # Keyed by colour and style, not label: two runs of one folder name (out/NAME in two
    # checkouts) are two entries.
    handles = {}
    for ax in axes[:5]:
        for line in ax.lines:
            handles[(line.get_color(), line.get_linestyle())] = line
    runs_drawn = list(handles.values())
    axes[5].legend(runs_drawn, [h.get_label() for h in runs_drawn], loc='center', title='run')
    fig.tight_layout()
    save(fig, plt, out, show)


# -----------------------------------------------------------------------------------------------
# attention maps

KINDS = ('encoder', 'decoder', 'cross')  # encoder and decoder self-attention, encoder-decoder


def weights_of(attn, x, memory=None, mask=None, causal=False, **_):
    """model.attention_weights of one model.MultiHeadAttention call without a cache:
    (B, h, queries, keys)."""
    if attn.cross:
        q = attn.heads(attn.q_proj(x))
        k = attn.heads(attn.kv_proj(memory).chunk(2, dim=-1)[0])
    else:
        q, k = attn.qkv_proj(x).chunk(3, dim=-1)[:2]
        q = attn.heads(q)
        k = attn.heads(k)
    if causal:  # top-left aligned, as SDPA's is_causal
        tril = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    return M.attention_weights(q, k, mask)


def attention_weights(model, src, tgt_in):
    """The weights of one teacher-forced forward pass: {kind: [per layer (B, h, queries, keys)]},
    computed from each attention's inputs, caught by a forward pre-hook."""
    mods = {'encoder': [layer.self_attn for layer in model.encoder],
            'decoder': [layer.self_attn for layer in model.decoder],
            'cross': [layer.cross_attn for layer in model.decoder]}
    found = {}

    def hook(m, args, kwargs):
        # The positional arguments, named as weights_of names them.
        named = dict(zip(('x', 'memory', 'mask', 'causal'), args))
        found[m] = weights_of(m, **named, **kwargs)

    hooks = []
    for ms in mods.values():
        for m in ms:
            hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(src, tgt_in)
    finally:
        for h in hooks:
            h.remove()
    return {kind: [found[m] for m in ms] for kind, ms in mods.items()}


def escaped(text):
    """text with each character that no font draws (a control character, say) written as repr
    writes it: '\\x07'."""
    out = []
    for c in text:
        if c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])
    return ''.join(out)


def token_labels(enc, tokens):
    # Byte-level BPE pieces as text, '▁' for a leading space so that word starts show.
    names = {enc.encode_single_token(s): s for s in enc.special_tokens_set}
    labels = []
    for t in tokens:
        if t in names:
            labels.append(names[t])
        else:
            piece = enc.decode_single_token_bytes(t).decode('utf-8', 'replace')
            labels.append(escaped(piece.replace(' ', '▁')))
    return labels


def heatmap(ax, w, rows, cols, title, colorbar=False):
    im = ax.imshow(w, cmap='viridis', vmin=0.0, aspect='equal')
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(title, fontsize=8)
    if colorbar:  # on an axis of the image's own height, whatever the figure's shape
        from mpl_toolkits.axes_grid1 import make_axes_locatable
        cax = make_axes_locatable(ax).append_axes('right', size=0.15, pad=0.1)
        ax.figure.colorbar(im, cax=cax)


def check_choices(ckpt, cfg, n_layers, layers, heads, kinds):
    for h in heads:
        if not -cfg.n_heads <= h < cfg.n_heads:
            fail(f"--heads {h}: {ckpt} has {cfg.n_heads} heads")
    for L in layers:
        if not all(-n_layers[k] <= L < n_layers[k] for k in kinds):
            fail(f"--layers {L}: {ckpt} has {cfg.n_enc_layers} encoder and "
                 f"{cfg.n_dec_layers} decoder layers")


def plot_attention(ckpt, src_text, out, tgt_text=None, layers=(-1,), heads=None, kinds=KINDS,
                   beam=4, show=False):
    plt = pyplot(show)
    out = figure_path(out)
    model, enc, saved = checkpoint.load_checkpoint(ckpt, 'cpu')
    cfg = model.cfg
    n_layers = {'encoder': cfg.n_enc_layers, 'decoder': cfg.n_dec_layers, 'cross': cfg.n_dec_layers}
    if heads is None:
        heads = list(range(cfg.n_heads))
    check_choices(ckpt, cfg, n_layers, layers, heads, kinds)
    if not src_text.strip():
        fail("--src is empty")
    src_tok = enc.encode_ordinary(src_text.strip()) + [cfg.eos_id]
    if len(src_tok) >= cfg.max_len:
        fail(f"--src has {len(src_tok)} tokens; {ckpt} allows at most {cfg.max_len - 1}")
    src = torch.tensor([src_tok])
    if tgt_text is None:
        # The model's own translation, token for token as it was decoded, by translate.py's search:
        # its default stopping rule, the checkpoint's length penalty.
        alpha = checkpoint.default_lenpen(saved)
        tgt_tok = decode.beam_search(model, src, beam=beam, alpha=alpha)[0][0][0]
        tgt_text = enc.decode(tgt_tok)
        print(f"plot.py: translation: {tgt_text}")
    else:
        tgt_tok = enc.encode_ordinary(tgt_text.strip())[:cfg.max_len - 1]
    weights = attention_weights(model, src, torch.tensor([[cfg.bos_id] + tgt_tok]))
    src_lab = token_labels(enc, src_tok)
    dec_in = token_labels(enc, [cfg.bos_id] + tgt_tok)
    # Cross-attention at a position is what produces the next token: its rows are labelled with the
    # token predicted there, so the map reads as a source-target alignment.
    dec_out = token_labels(enc, tgt_tok + [cfg.eos_id])
    axis = {'encoder': (src_lab, src_lab), 'decoder': (dec_in, dec_in), 'cross': (dec_out, src_lab)}
    grid = []  # (kind, layer) per row of maps, in the order data flows
    for kind in KINDS:
        if kind in kinds:
            for L in layers:
                grid.append((kind, L % n_layers[kind]))
    side = 0.22 * max(len(src_lab), len(dec_in)) + 1.2
    fig = plt.figure(figsize=(side * len(heads), side * (len(grid) + 1.6)))
    gs = fig.add_gridspec(len(grid) + 2, len(heads))
    for r, (kind, L) in enumerate(grid):
        for c, h in enumerate(heads):
            rows, cols = axis[kind]
            title = f"{kind} layer {L} head {h % cfg.n_heads}"
            heatmap(fig.add_subplot(gs[r, c]), weights[kind][L][0, h].numpy(), rows, cols, title)
    # Source-target alignment: one head rarely aligns alone, so all heads of the chosen layers
    # are averaged.
    n = cfg.n_dec_layers
    cross_layers = sorted({L % n for L in layers if -n <= L < n})
    if not cross_layers:
        cross_layers = [n - 1]
    mean = torch.stack([weights['cross'][L][0] for L in cross_layers]).mean((0, 1)).numpy()
    span = min(2, len(heads))
    start = (len(heads) - span) // 2
    title = ("alignment: cross-attention, mean over heads\n"
             f"of layer(s) {', '.join(map(str, cross_layers))}")
    heatmap(fig.add_subplot(gs[len(grid):, start:start + span]), mean, dec_out, src_lab, title,
            colorbar=True)
    fig.suptitle(f"{escaped(src_text.strip())}  →  {escaped(tgt_text.strip())}\n"
                 "(rows sum to 1; each map is scaled to its own largest weight)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))  # room for the two-line title
    save(fig, plt, out, show)


# -----------------------------------------------------------------------------------------------
# command line

def main(argv=None):
    p = argparse.ArgumentParser(description="Learning curves and attention maps.")
    sub = p.add_subparsers(dest='cmd', required=True)
    c = sub.add_parser('curves', help="plot runs' log.jsonl, overlaid")
    c.add_argument('runs', nargs='+', help="run folders (out/NAME) or log.jsonl files")
    c.add_argument('-o', '--out', default='curves.png')
    c.add_argument('--x', choices=['step', 'minutes'], default='step')
    c.add_argument('--labels', nargs='+',
                   help="legend names, one per run (default: the folder names)")
    a = sub.add_parser('attention', help="attention heatmaps of one sentence")
    a.add_argument('--ckpt', required=True)
    a.add_argument('--src', required=True, help="source sentence")
    a.add_argument('--tgt',
                   help="target sentence (default: the model's own beam-search translation)")
    a.add_argument('--layers', type=int, nargs='+', default=[-1], help="layer indices, -1 = last")
    a.add_argument('--heads', type=int, nargs='+', help="head indices (default: all)")
    a.add_argument('--kinds', nargs='+', choices=KINDS, default=list(KINDS),
                   help="which attentions (default: all)")
    a.add_argument('--beam', type=int, default=4)
    a.add_argument('-o', '--out', default='attention.png')
    for q in (c, a):
        q.add_argument('--no-show', action='store_true',
                       help="do not open a window even with a display")
    args = p.parse_args(argv)
    if args.cmd == 'attention' and args.beam < 1:
        p.error("--beam must be at least 1")
    show = has_display() and not args.no_show
    if args.cmd == 'curves':
        if args.labels and len(args.labels) != len(args.runs):
            p.error(f"{len(args.labels)} labels for {len(args.runs)} runs")
        plot_curves(args.runs, args.out, args.x, args.labels, show)
    else:
        plot_attention(args.ckpt, args.src, args.out, args.tgt, args.layers, args.heads,
                       args.kinds, args.beam, show)


if __name__ == '__main__':
    checkpoint.stop_on_signals()
    try:
        main()
    except KeyboardInterrupt:  # a partial output is removed on the way out
        sys.exit("plot.py: interrupted")
