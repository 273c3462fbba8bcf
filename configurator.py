"""
The configurator of train.py, as nanoGPT's configurator.py: settings are the globals of the script,
config files and --key=value flags override them.
"""
import ast
import math
import os
import re
import sys
import traceback
import types


def set_setting(config, key, value, where):
    # Strict: an unknown key or a value of another type (but an int for a float) names the key.
    if key not in config:
        sys.exit(f"{where}: unknown setting {key!r}")
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(config[key], float):
        value = float(value)
    if type(value) is not type(config[key]):
        sys.exit(f"{where}: {key} must be {type(config[key]).__name__}, got {value!r}")
    config[key] = value


def configure(settings, args):
    """A script's globals -> (its settings: the values of plain types whose names do not start with
    '_', its config: config files and then --key=value over them, checked against RANGES)."""
    defaults = {}
    for key, value in settings.items():
        if not key.startswith('_') and isinstance(value, (int, float, bool, str)):
            defaults[key] = value
    config = override(dict(defaults), args)
    check_ranges(config)
    return defaults, config


def override(config, args):
    """Config files first, each executed over the settings so far (it may read them,
    d_ff = 4 * d_model, and import), then each --key=value parsed as a Python literal."""
    if '-h' in args or '--help' in args:
        print_help(config)
    files = [a for a in args if not a.startswith('--')]
    flags = [a for a in args if a.startswith('--')]
    # Checked first: `--max_steps 5` would read 5 as a config file that is not there.
    for arg in flags:
        if '=' not in arg:
            sys.exit(f"{arg}: expected --key=value")
    for path in files:
        for key, value in run_file(path, config).items():
            # Any name but imports, functions and _private ones is a setting.
            if key.startswith('_') or callable(value) or isinstance(value, types.ModuleType):
                continue
            set_setting(config, key, value, path)
    for arg in flags:
        key, _, raw = arg[2:].partition('=')
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word is a string
        if isinstance(config.get(key), str) and not isinstance(value, str):
            value = raw  # --out_dir=2024 names the folder '2024'
        set_setting(config, key, value, arg)
    return config


def print_help(config):
    """The command line and every setting with its default; exit 0."""
    script = os.path.basename(sys.argv[0])
    print(f"usage: {script} [CONFIG_FILE ...] [--key=value ...]\n"
          f"Config files, then --key=value, override these defaults (what each means: the top of "
          f"{script}):")
    for key, value in config.items():
        print(f"  --{key}={value!r}")
    sys.exit(0)


def run_file(path, settings):
    """A config file executed over a copy of settings (it may read them) -> its namespace; a mistake
    of the file's own is one line naming its line, not a traceback through the script."""
    if not os.path.isfile(path):
        sys.exit(f"config file {path} not found")
    scope = dict(settings)
    try:
        with open(path, encoding='utf-8') as f:
            tree = compile(f.read(), path, 'exec', ast.PyCF_ONLY_AST)
        exec(compile(tree, path, 'exec'), scope)
    except Exception as e:
        if isinstance(e, SyntaxError):
            lines = [e.lineno]
        else:
            lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = lines[-1] if lines else '?'
        sys.exit(f"config file {path}, line {line}: {type(e).__name__}: {e}")
    # A JSON file parses as one dict expression, which sets nothing.
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Dict, ast.List)):
            sys.exit(f"config file {path}, line {node.lineno}: a bare {type(node.value).__name__} "
                     f"sets no setting: write Python, one name = value per line")
    return scope


# train.py's settings and the values each may take, checked before any work.
RANGES = [
    ('max_tokens update_freq max_steps warmup log_interval keep_last keep_state average_last '
     'bleu_beam n_enc_layers n_dec_layers d_model d_ff n_heads max_len max_bad_steps',
     lambda v: v >= 1, '>= 1'),
    ('dropout attn_dropout label_smoothing beta1 beta2', lambda v: 0 <= v < 1, 'in [0, 1)'),
    ('lr lr_scale adam_eps weight_decay clip_grad max_minutes save_minutes eval_interval '
     'save_interval bleu_lenpen seed d_head', lambda v: v >= 0, '>= 0'),
    ('bleu_interval', lambda v: v >= -1, '>= -1 (-1: never)'),
    ('cooldown', lambda v: 0 <= v <= 1, 'in [0, 1]'),
    ('schedule', lambda v: v in ('noam', 'inverse_sqrt', 'constant'),
     'noam, inverse_sqrt or constant'),
    ('positions', lambda v: v in ('sinusoidal', 'learned'), "'sinusoidal' or 'learned'"),
    ('dtype', lambda v: v in ('auto', 'float32', 'bfloat16', 'float16'),
     'auto/float32/bfloat16/float16'),
    ('device', lambda v: re.fullmatch(r'auto|cpu|cuda(:\d+)?', v), 'auto, cpu, cuda or cuda:N'),
    ('init_from', lambda v: v != '', "'auto', 'scratch', 'resume' or a checkpoint"),
]


def unread_settings(config, defaults):
    """Settings given (not their defaults) that the schedule chosen does not read."""
    unread = []
    if config['schedule'] == 'noam' and config['lr'] != defaults['lr']:
        unread.append(f"lr={config['lr']} is not read by schedule='noam', whose peak is "
                      f"lr_scale * d_model^-0.5 * warmup^-0.5 (section 5.3)")
    if config['schedule'] != 'noam' and config['lr_scale'] != defaults['lr_scale']:
        unread.append(f"lr_scale={config['lr_scale']} is read by schedule='noam' alone")
    return unread


def check_ranges(config):
    """Each of train.py's settings within its range, or one line naming it."""
    for keys, ok, what in RANGES:
        for key in keys.split():
            if not ok(config[key]):
                sys.exit(f"{key} must be {what}, got {config[key]!r}")
    if not config['d_head'] and config['d_model'] % config['n_heads']:
        sys.exit(f"n_heads must be a divisor of d_model, or d_head set, got {config['n_heads']!r}")
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):  # --lr=1e999 reads as inf
            sys.exit(f"{key} must be a finite number, got {value!r}")
    if config['average_last'] > config['keep_last']:  # else fewer are averaged than asked
        sys.exit(f"average_last must be at most keep_last, the snapshots kept, got "
                 f"{config['average_last']} > {config['keep_last']}")
