"""The packages import downward only (docs/architecture.md, "Packages and imports"), checked by parsing every
module of `logo/` and `train.py` with `ast` (nothing is imported).

    config <- kernels <- model <- parallel <- run <- {train, eval, export} <- {report, analysis}

`run` is the floor that training, evaluation and export share (the run config, checkpoint folders, Hugging
Face folders, loading a model); above it the three never import each other.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("run", "train", "eval", "export", "report", "analysis")

# package -> the packages it must never import (directly, at module level or inside a function)
FORBIDDEN = {
    "config": {"kernels", "model", "parallel", *TOP},
    "kernels": {"model", "parallel", *TOP},
    "model": {"parallel", *TOP},
    "parallel": set(TOP),
    "run": {"train", "eval", "export", "report", "analysis"},
    "train": {"eval", "export", "report", "analysis"},
    "export": {"train", "eval", "report", "analysis"},
    "eval": {"train", "export", "report"},
}
# Where a project module may be imported inside a function: only to keep a heavy dependency off the import path.
LOCAL_IMPORTS_ALLOWED = {
    ("logo/__init__.py", "logo.run.load"),  # logo.load_pretrained: `import logo.config` stays free of torch
    ("logo/export/writer.py", "logo.export.remote.configuration_logo"),  # imports transformers
    ("logo/eval/lm_eval_run.py", "logo.eval.lm_eval_adapter"),  # imports lm_eval
    ("logo/kernels/flash/__init__.py", "logo.kernels.flash._fa4"),  # imports flash-attn-4 (GPU extra)
    ("logo/kernels/ops.py", "logo.kernels.flash"),
    # the Triton kernels: a machine without a working Triton still runs the reference
    ("logo/kernels/ops.py", "logo.kernels.triton"),
    ("logo/kernels/ops.py", "logo.kernels.triton._decode"),
    ("logo/kernels/ops.py", "logo.kernels.triton._fuse"),
    ("logo/kernels/ops.py", "logo.kernels.triton._rope"),
}
# where function-local imports are checked: the whole package and the entry point
LOCAL_IMPORTS_CHECKED = ("logo/", "train.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = sorted((ROOT / "logo").rglob("*.py")) + [ROOT / "train.py"]
    return {_module_name(f): f for f in files}


def _resolve(name: str, modules: dict) -> str:
    """The longest known module prefix of a dotted name ('logo.run.hf.load_into' -> 'logo.run.hf')."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name


def _imports(path: Path, module: str, modules: dict):
    """(imported project module, module level?) for every import statement of a file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    for n in tree.body:  # module level includes `if`/`try` blocks at the top of the file
        if isinstance(n, (ast.If, ast.Try)):
            top_level |= {id(c) for c in ast.walk(n) if isinstance(c, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg_parts = package.split(".")
                base = ".".join(pkg_parts[:len(pkg_parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "logo" or name.startswith("logo."):
                yield _resolve(name, modules), id(node) in top_level


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "logo" or len(parts) == 1:
        return parts[0]
    return {"parallelize": "parallel"}.get(parts[1], parts[1])


def test_packages_import_downward_only():
    modules = _modules()
    bad = []
    for module, path in modules.items():
        pkg = _package(module)
        for target, _ in _imports(path, module, modules):
            if _package(target) in FORBIDDEN.get(pkg, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(set(bad)))


def test_no_module_level_cycles():
    modules = _modules()
    graph = {m: {t for t, top in _imports(p, m, modules) if top and t in modules and t != m}
             for m, p in modules.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


def test_project_imports_at_the_top():
    modules = _modules()
    bad = []
    for module, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(LOCAL_IMPORTS_CHECKED):
            bad += [f"{rel}: {t}" for t, top in _imports(path, module, modules)
                    if not top and (rel, t) not in LOCAL_IMPORTS_ALLOWED]
    assert not bad, "function-local imports of project modules:\n" + "\n".join(sorted(set(bad)))


def test_nothing_below_the_launchers_imports_them():
    """launch/ (SLURM scripts, the study runner) sits on top: logo/, data/ and train.py never import it."""
    bad = []
    for path in sorted((ROOT / "logo").rglob("*.py")) + sorted((ROOT / "data").rglob("*.py")) + [ROOT / "train.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n == "launch" or n.startswith("launch.")]
    assert not bad, "\n".join(bad)
