"""
The configurator of train.py, as nanoGPT's configurator.py: settings are the globals of the script,
config files and --key=value flags override them.
"""
import ast
import os
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


def override(config, args):
    """Config files first, each executed over the settings so far (it may read them,
    d_ff = 4 * d_model, and import), then each --key=value parsed as a Python literal."""
    files = [a for a in args if not a.startswith('--')]
    flags = [a for a in args if a.startswith('--')]
    for path in files:
        for key, value in run_file(path, config).items():
            # Any name but imports, functions and _private ones is a setting.
            if key.startswith('_') or callable(value) or isinstance(value, types.ModuleType):
                continue
            set_setting(config, key, value, path)
    for arg in flags:
        key, eq, raw = arg[2:].partition('=')
        if not eq:
            sys.exit(f"{arg}: expected --key=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word is a string
        if isinstance(config.get(key), str) and not isinstance(value, str):
            value = raw  # --out_dir=2024 names the folder '2024'
        set_setting(config, key, value, arg)
    return config


def run_file(path, settings):
    """A config file executed over a copy of settings (it may read them) -> its namespace; a mistake
    of the file's own is one line naming its line, not a traceback through the script."""
    if not os.path.isfile(path):
        sys.exit(f"config file {path} not found")
    scope = dict(settings)
    try:
        with open(path, encoding='utf-8') as f:
            exec(compile(f.read(), path, "exec"), scope)
    except Exception as e:
        if isinstance(e, SyntaxError):
            lines = [e.lineno]
        else:
            lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = lines[-1] if lines else '?'
        sys.exit(f"config file {path}, line {line}: {type(e).__name__}: {e}")
    return scope
