"""The code reads plainly, as nanoGPT's does: an `if` is an if statement, one idea per line."""
import ast
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINE = 100


def python_files():
    cmd = ['git', 'ls-files', '--cached', '--others', '--exclude-standard', '*.py']
    listed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return sorted(set(listed.stdout.split()))
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        skipped = [d for d in subfolders if d.startswith('.') or d in ('data', 'out')]
        subfolders[:] = [d for d in subfolders if d not in skipped]
        for name in files:
            if name.endswith('.py'):
                found.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return sorted(found)


def dense_statements(source):
    """-> (line, what) for each expression used as a statement for its control flow, and each
    `for` over a conditional expression standing in for an if."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr):
            if isinstance(node.value, ast.IfExp):
                found.append((node.lineno, 'conditional expression as a statement'))
            elif isinstance(node.value, ast.BoolOp):
                found.append((node.lineno, '`and`/`or` as a statement'))
            elif isinstance(node.value, ast.Tuple):
                found.append((node.lineno, 'tuple as a statement'))
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.IfExp):
            found.append((node.lineno, '`for` over a conditional expression'))
    return found


def test_the_checks_see_each_dense_form():
    source = ("f() if c else None\n"
              "a and b()\n"
              "f(), g()\n"
              "for x in (xs if c else []):\n"
              "    pass\n"
              "if c:\n"
              "    f()\n")
    assert [line for line, _ in dense_statements(source)] == [1, 2, 3, 4]


def test_no_dense_statements_and_no_line_over_100_characters():
    problems = []
    for path in python_files():
        with open(os.path.join(ROOT, path), encoding='utf-8') as f:
            source = f.read()
        for n, line in enumerate(source.splitlines(), 1):
            if len(line) > MAX_LINE:
                problems.append(f'{path}:{n}: a line of {len(line)} characters')
        for n, what in dense_statements(source):
            problems.append(f'{path}:{n}: {what}')
    assert not problems, '\n'.join(problems)
