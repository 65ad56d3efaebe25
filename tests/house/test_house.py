"""The house rules that keep the code readable: import arrows one way, a light ``--help``, one way to fail."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> packages it must never import, eagerly or lazily (inside a function)
FORBIDDEN = {
    "fp8rl_core": ("stages", "flows", "storage"),
    "storage": ("stages", "flows"),
    "stages": ("flows",),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_arrows_point_one_way_lazy_imports_included(package: str) -> None:
    bad = []
    for f in sorted((ROOT / package).rglob("*.py")):
        for line, mod in _imports(f):
            top = mod.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["--help"], "Commands"),
        (["run", "--help"], "Usage"),
        (["run", "--bogus"], "HEAVY"),  # a usage error is answered before any command's imports
        (["query", "--bogus"], "HEAVY"),
    ],
)
def test_help_and_usage_errors_do_not_import_torch_or_prefect(argv: list[str], shown: str) -> None:
    code = (
        f"import sys; sys.argv = ['fp8rl', *{argv!r}]\n"
        "from flows import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'prefect', 'transformers', 'duckdb') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert shown in r.stdout and "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr[-2000:]


def test_every_registered_command_module_exists_and_registers() -> None:
    """A typo in a module name must fail loudly, not silently drop its commands."""
    import importlib

    from flows import cli

    names = {c.name for c in cli.app.registered_commands}
    assert {"run", "resume", "rerun", "deploy", "query", "doctor", "report", "sweep", "config"} <= names
    for mod in cli._COMMAND_MODULES:
        assert hasattr(importlib.import_module(mod), "register"), mod


def test_one_fail_for_every_command_module() -> None:
    """Every CLI module fails the same way: flows.commands.common.fail (no private copies)."""
    copies = []
    for f in sorted((ROOT / "flows").glob("cli*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("_fail", "fail") and f.name != "cli_common.py":
                copies.append(f"{f.name}:{node.lineno}")
    assert not copies, copies


def test_fault_injection_keeps_no_module_state() -> None:
    """storage.faults parses the plan at each point; the running stage is a ContextVar, not a global dict."""
    import contextvars

    from storage import faults

    for name, value in vars(faults).items():
        if name.startswith("__") or name == "annotations" or callable(value):
            continue
        if isinstance(value, (str, tuple, type(faults))):
            continue
        assert isinstance(value, contextvars.ContextVar), f"storage.faults.{name} is module state: {value!r}"
    with faults.stage_scope("train", 3):
        with pytest.raises(OSError, match="No space left"):
            faults.at("train", 3, "mb1", env={faults.ENV: "train@3:mb1=enospc", faults.ARMED_ENV: "1"})
    with pytest.raises(ValueError, match="bad item"):
        faults.parse("train@x=kill")


# --------------------------------------------------------------------------- size, names, circles, history

SOURCE_DIRS = ("fp8rl_core", "stages", "flows", "storage", "gpu_check")
MAX_FUNCTION_LINES = 80


def _sources(dirs=SOURCE_DIRS) -> list[Path]:
    return [f for d in dirs for f in sorted((ROOT / d).rglob("*.py"))]


def test_no_function_over_80_lines_outside_benchmarks_and_tests() -> None:
    long = []
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines_outside_benchmarks_and_tests() -> None:
    sizes = {f: len(f.read_text().splitlines()) for f in _sources()}
    long = [f"{f.relative_to(ROOT)} ({n} lines)" for f, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not long, "split by concern:\n" + "\n".join(long)


MAX_PARAMETERS = 8
PARAMETER_DIRS = ("fp8rl_core", "stages", "storage", "flows")
# functions whose signature mirrors a library's, each with the library signature it mirrors (the CLI's commands
# are exempt by their registration: their parameters are the command's options)
MIRRORS = {
    "fp8rl_core/cpu_numerics/portable_mode.py:_sdpa": "torch.nn.functional.scaled_dot_product_attention, "
    "after the BF16 rule's levels",
}


def _is_command_registration(node: ast.AST) -> bool:
    """``app.command(...)``: the ``fp8rl`` CLI's command decorator (``flows/cli.py``, a module's ``register(app)``)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "command"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "app"
    )


def _wide_functions(path: Path, rel: str) -> list[str]:
    """Functions of ``path`` (``rel``: its path in the tree) with over ``MAX_PARAMETERS`` parameters, ``*args`` and
    ``**kwargs`` counted, a leading ``self``/``cls`` not; but the CLI's commands (decorated ``@app.command(...)`` or
    registered ``app.command(...)(function)``) and the ``MIRRORS``."""
    tree = ast.parse(path.read_text(), str(path))
    commands = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(_is_command_registration(d) for d in node.decorator_list)
    } | {
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _is_command_registration(node.func) and node.args
        and isinstance(node.args[0], ast.Name)
    }
    wide = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
        if params and params[0].arg in ("self", "cls"):
            params = params[1:]
        if len(params) > MAX_PARAMETERS and node.name not in commands and f"{rel}:{node.name}" not in MIRRORS:
            wide.append(f"{rel}:{node.lineno} {node.name} ({len(params)} parameters)")
    return wide


def test_no_function_over_8_parameters_but_cli_commands_and_library_mirrors() -> None:
    wide = [w for f in _sources(PARAMETER_DIRS) for w in _wide_functions(f, f.relative_to(ROOT).as_posix())]
    assert not wide, "group them in a frozen dataclass or pass a config object:\n" + "\n".join(wide)
    for name in MIRRORS:  # the allow-list names functions that are there
        rel, _, func = name.partition(":")
        assert (ROOT / rel).exists() and func in _top_level_names(ROOT / rel), f"MIRRORS names {name}, which is gone"


def test_the_parameter_rule_catches_a_planted_function(tmp_path: Path) -> None:
    """A function of 9 parameters is caught; a method of 8 besides ``self`` and the CLI's commands are not."""
    nine = "a, b, c, d, e, f, g, h, i"
    probe = tmp_path / "probe.py"
    probe.write_text(
        f"def wide({nine}):\n    pass\n\n\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n\n\n"
        f"def register(app):\n    @app.command('x')\n    def decorated({nine}):\n        pass\n\n"
        f"    def registered({nine}):\n        pass\n\n    app.command('y')(registered)\n"
    )
    assert _wide_functions(probe, "probe.py") == ["probe.py:1 wide (9 parameters)"]


def _registry_names() -> dict[str, tuple[set[str], set[str]]]:
    """Registry -> (its names, the modules allowed to spell them: where they are registered)."""
    from fp8rl_core.calibration.clip_modes import CLIP_MODES, UPDATE_BOUNDS
    from fp8rl_core.objective.advantages import ADVANTAGE_ESTIMATORS
    from fp8rl_core.registered import POLICY_LOSSES
    from fp8rl_core.tasks.kinds import TASK_KINDS

    return {
        "policy loss": (set(POLICY_LOSSES.names()), {"fp8rl_core/objective/losses.py", "fp8rl_core/objective/gspo.py"}),
        "clip mode": (
            set(CLIP_MODES.names()) | set(UPDATE_BOUNDS.names()),
            {"fp8rl_core/calibration/clip_modes.py"},
        ),
        "advantage estimator": (set(ADVANTAGE_ESTIMATORS.names()), {"fp8rl_core/objective/advantages.py"}),
        # a task kind counts where it is compared with a ``.kind`` (benchmarks and verifiers share names)
        "task kind": (set(TASK_KINDS.names()), {"fp8rl_core/tasks/kinds.py", "fp8rl_core/config/model.py"}),
    }


def test_no_caller_compares_a_string_with_a_loss_clip_mode_estimator_or_task_kind() -> None:
    """Behaviour comes from the registry entry, never from ``if cfg.loss == "gspo"`` in a caller."""
    bad = []
    registries = _registry_names()
    for f in _sources():
        rel = str(f.relative_to(ROOT))
        for node in ast.walk(ast.parse(f.read_text(), rel)):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                if not (isinstance(side, ast.Constant) and isinstance(side.value, str)):
                    continue
                sides = (node.left, *node.comparators)
                kind_attr = any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides)
                for kind, (names, home) in registries.items():
                    if kind == "task kind" and not kind_attr:
                        continue
                    if side.value in names and rel not in home:
                        bad.append(f"{rel}:{node.lineno} compares with the {kind} {side.value!r}")
    assert not bad, "\n".join(bad)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_imports(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports: eagerly, lazily, or for annotations only (``if TYPE_CHECKING:``):
    a module that names another's type depends on it as much as one that calls it."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me and not name.endswith("__init__"):
                out.add(name)
    return out


def test_no_import_circle_between_files_lazy_and_type_only_imports_included() -> None:
    files = {_module_of(f): f for f in _sources(SOURCE_DIRS)}
    known = set(files)
    graph = {m: {d for d in _project_imports(f, known) if files[d].name != "__init__.py"} for m, f in files.items()}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


ISSUE_REF = r"\b[Ii]ssues? #?\d+|(?<=[\s(])#\d{1,3}\b"


def test_no_issue_number_references_in_the_tree() -> None:
    """History is told with dates and commit ids: an issue number means nothing to the next reader."""
    import re

    pattern = re.compile(ISSUE_REF)
    bad = []
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".yaml", ".yml", ".toml", ".sql", ".txt", ".cfg")) and rel != "Makefile":
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and "ISSUE_REF" not in line:
                bad.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not bad, f"{len(bad)} line(s):\n" + "\n".join(bad[:60])


# --------------------------------------------------------------------------- one name, one meaning

# The vocabulary of ranks and collectives: the helpers that decide which ranks run what, and the
# one-process stand-ins of the collectives. Each public module-level name here means one thing.
RANK_VOCABULARY = ("stages/runtime", "stages/trainer/collective.py", "stages/context.py")


def _public_module_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and len(n) > 1}


def test_rank_and_collective_names_mean_one_thing() -> None:
    """``from_main`` (a value rank 0 computes) is not ``on_main`` (a stage rank 0 runs); the
    one-process stage comm is not the one-process trainer collective."""
    files = []
    for entry in RANK_VOCABULARY:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    homes: dict[str, list[str]] = {}
    for f in files:
        for name in _public_module_names(f):
            homes.setdefault(name, []).append(str(f.relative_to(ROOT)))
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(twice.items()))


# --------------------------------------------------------------------------- the repository stands alone

# Lines that may name a place outside the repository, and why: the Makefile's default data folder
# (FP8RL_DATA_DIR overrides it), and a host path the code sandbox must keep out of a program's sight.
OUTSIDE_ALLOWED = {
    "Makefile": "FP8RL_DATA_DIR ?=",
    "tests/stages/grade/test_sandbox_attacks.py": '"/work/',
}
OUTSIDE_REF = "|".join(["DESIGN" + r"\.md", r"\.\./" + "shared", "/work/" + "shared"])


def _tracked_text_files() -> list[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    keep = (".py", ".md", ".yaml", ".yml", ".toml", ".sql", ".txt", ".cfg", ".json", ".sh")
    return [rel for rel in tracked if (rel.endswith(keep) or rel == "Makefile") and (ROOT / rel).is_file()]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    """A clone holds everything it cites: the method's definitions are docs/method.md, and the data
    folder is named by FP8RL_DATA_DIR, never by where one copy happens to live."""
    import re

    pattern = re.compile(OUTSIDE_REF)
    bad = []
    for rel in _tracked_text_files():
        for i, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and OUTSIDE_ALLOWED.get(rel, "\0") not in line:
                bad.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not bad, f"{len(bad)} line(s):\n" + "\n".join(bad[:60])


DATA_HOME = "stages/data/benchmarks.py"  # resolve_data_dir: task.data_dir, else $FP8RL_DATA_DIR


def test_the_data_folder_is_reached_only_through_resolve_data_dir() -> None:
    """Only ``stages.data.benchmarks.resolve_data_dir`` reads the variable; every other module asks it."""
    bad = []
    for f in _sources():
        rel = str(f.relative_to(ROOT))
        if rel == DATA_HOME:
            continue
        for node in ast.walk(ast.parse(f.read_text(), rel)):
            if isinstance(node, ast.Constant) and node.value == "FP8RL_DATA_DIR":
                bad.append(f"{rel}:{node.lineno} reads FP8RL_DATA_DIR itself")
            elif isinstance(node, (ast.Name, ast.Attribute)) and "DATA_DIR_ENV" in (
                getattr(node, "id", None),
                getattr(node, "attr", None),
            ):
                bad.append(f"{rel}:{node.lineno} reads FP8RL_DATA_DIR itself")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("kind", ["math500", "deepscaler", "leetcode"])
@pytest.mark.parametrize("folder", ["unset", "empty"])
def test_a_missing_data_folder_or_file_says_what_the_folder_must_hold(kind, folder, tmp_path, monkeypatch) -> None:
    from stages.data.benchmarks import SOURCES, TRAIN_SOURCES, load_benchmark, load_train_prompts
    from stages.data.code_benchmarks import CODE_SOURCES, load_code_benchmark

    monkeypatch.delenv("FP8RL_DATA_DIR", raising=False)
    root = None if folder == "unset" else tmp_path
    loaders = {
        "math500": (lambda: load_benchmark("math500", root), SOURCES.get("math500").relpath),
        "deepscaler": (lambda: load_train_prompts("deepscaler", None, root), TRAIN_SOURCES.get("deepscaler").relpath),
        "leetcode": (lambda: load_code_benchmark("leetcode", root), CODE_SOURCES["leetcode"].relpath),
    }
    load, relpath = loaders[kind]
    with pytest.raises(FileNotFoundError) as err:
        load()
    msg = str(err.value)
    assert "FP8RL_DATA_DIR" in msg and "task.data_dir" in msg and "one subfolder per benchmark" in msg, msg
    assert relpath in msg and "shared" not in msg, msg
    assert list(tmp_path.iterdir()) == []  # nothing written


# --------------------------------------------------------------------------- names given as strings resolve

PACKAGES = ("fp8rl_core", "stages", "flows", "storage", "gpu_check")
DOTTED_PATH = r"(?<![\w./-])(?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?"
FILE_PATH = (
    r"(?<![\w./-])((?:" + "|".join((*PACKAGES, "benchmarks", "tests", "configs", "docs")) + r")"
    r"/[\w./-]*\.(?:py|yaml|md|sql|jsonl|json))(?::([A-Za-z_]\w*))?"
)
PLACEHOLDER_PATHS = {"configs/x.yaml"}  # "configs/x.yaml" in usage text stands for any preset


def _top_level_names(path: Path, cache: dict[Path, set[str]] = {}) -> set[str]:  # noqa: B006 (a cache)
    """Names a module defines or imports at its top level (``if``/``try`` blocks included)."""
    if path not in cache:
        names: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for top in tree.body:
            nodes = ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top]
            for node in nodes:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        cache[path] = names
    return cache[path]


def _resolves(name: str) -> bool:
    """``pkg.module[.attr]`` or ``pkg.module:function``: the module is a file of the tree and the
    first attribute after it is defined there (read from the source: nothing is imported)."""
    dotted, _, func = name.partition(":")
    parts = dotted.split(".") + ([func] if func else [])
    path, i = ROOT / parts[0], 1
    while i < len(parts) and ((path / parts[i]).is_dir() or (path / f"{parts[i]}.py").is_file()):
        path = path / parts[i] if (path / parts[i]).is_dir() else path / f"{parts[i]}.py"
        i += 1
    if i == len(parts):
        return True
    module = path / "__init__.py" if path.is_dir() else path
    return module.is_file() and parts[i] in _top_level_names(module)


def _strings(path: Path):
    """(line, text) of every string in a Python file, docstrings included; of every line elsewhere."""
    if path.suffix != ".py":
        yield from enumerate(path.read_text().splitlines(), 1)
        return
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_every_module_path_named_as_a_string_resolves() -> None:
    """Module paths in strings (a verifier's ``module:function``, ``:func:`` references, config
    descriptions), prefect.yaml's entrypoints and the files the docs name all exist, so a moved
    module cannot leave a dangling name behind."""
    import re

    from fp8rl_core.config.pipeline import StorageConfig

    config_keys = {f"storage.{k}" for k in StorageConfig.model_fields}  # `storage.runs_root` is a setting
    files = [*_sources(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    files += [ROOT / "README.md", ROOT / "prefect.yaml", *sorted(ROOT.glob("docs/*.md"))]
    files += sorted((ROOT / "configs").rglob("*.yaml"))
    bad = []
    for f in files:
        rel = f.relative_to(ROOT)
        for line, text in _strings(f):
            for name in re.findall(DOTTED_PATH, text):
                if name not in config_keys and not _resolves(name):
                    bad.append(f"{rel}:{line}: {name}")
            for path, func in re.findall(FILE_PATH, text):
                target = ROOT / path
                ok = path in PLACEHOLDER_PATHS or target.is_file()
                if ok and func and target.suffix == ".py":
                    ok = func in _top_level_names(target)
                if not ok:
                    bad.append(f"{rel}:{line}: {path}{':' + func if func else ''}")
    assert not bad, f"{len(bad)} dangling name(s):\n" + "\n".join(sorted(set(bad))[:60])


def test_every_registry_a_config_field_names_exists_and_holds_its_default() -> None:
    """``description="... a name in fp8rl_core.objective.losses.POLICY_LOSSES"``: that registry, with its default."""
    import importlib
    import re

    from fp8rl_core.registry import Registry

    checked = 0
    trees = [ast.parse(f.read_text()) for f in sorted((ROOT / "fp8rl_core/config").glob("*.py"))]
    for node in (n for tree in trees for n in ast.walk(tree)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field" and node.args):
            continue
        described = [k.value for k in node.keywords if k.arg == "description" and isinstance(k.value, ast.Constant)]
        desc = "".join(ast.literal_eval(v) for v in described)
        for module, attr in re.findall(r"a name in ((?:\w+\.)+)(\w+)", desc):
            registry = getattr(importlib.import_module(module.rstrip(".")), attr)
            default = ast.literal_eval(node.args[0])
            assert isinstance(registry, Registry), f"{module}{attr} is not a registry"
            assert default in registry, f"config default {default!r} is not in {module}{attr}: {registry.names()}"
            checked += 1
    assert checked >= 6, checked
