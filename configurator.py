"""
The configurator of train.py, as nanoGPT's configurator.py: settings are the globals of the script, config
files and --key=value flags override them.
"""
import ast
import os
import sys
import traceback


def override(config, args):
    """nanoGPT's configurator, strict: config files first, each executed over the settings so far (it may
    read them, d_ff = 4 * d_model, and import), then each --key=value parsed as a Python literal. Unknown
    keys and wrong types name the key."""
    def check(key, value, where):
        if key not in config:
            sys.exit(f"{where}: unknown setting {key!r}")
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(config[key], float):
            value = float(value)
        if type(value) is not type(config[key]):
            sys.exit(f"{where}: {key} must be {type(config[key]).__name__}, got {value!r}")
        config[key] = value
    for arg in sorted(args, key=lambda a: a.startswith('--')):  # the files first, each group in its order
        if not arg.startswith('--'):
            for key, value in run_file(arg, config).items():  # any name but imports and functions: a setting
                if not key.startswith('_') and not callable(value) and not isinstance(value, type(sys)):
                    check(key, value, arg)
        else:
            key, eq, raw = arg[2:].partition('=')
            if not eq:
                sys.exit(f"{arg}: expected --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare word is a string
            if isinstance(config.get(key), str) and not isinstance(value, str):
                value = raw  # --out_dir=2024 names the folder '2024'
            check(key, value, arg)
    return config


def run_file(path, settings):
    """A config file executed over a copy of settings (it may read them) -> its namespace; a mistake of the
    file's own is one line naming its line, not a traceback through the script."""
    if not os.path.isfile(path):
        sys.exit(f"config file {path} not found")
    scope = dict(settings)
    try:
        with open(path, encoding='utf-8') as f:
            exec(compile(f.read(), path, "exec"), scope)
    except Exception as e:
        lines = [e.lineno] if isinstance(e, SyntaxError) else \
            [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        sys.exit(f"config file {path}, line {(lines or ['?'])[-1]}: {type(e).__name__}: {e}")
    return scope
