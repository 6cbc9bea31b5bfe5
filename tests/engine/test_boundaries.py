"""The runtime's import graph and the engine's sealed boundaries, read from the source (ast):
no import cycles, lazy imports (inside functions, under try/with/if) included; every import
points down the floors below (or along one), but for the few deliberate ones named here; the
engine's bookkeeping imports no tensors and nothing from worker/, not even lazily;
no engine module imports the worker: the executor is the one door to it;
only the engine's bookkeeping writes a Request;
the worker (and the batch descriptions it shares with the engine) never imports the engine,
directly or through another module: it gets tensors and values, never requests;
nobody outside the KV-cache manager touches block tables or changes the block pool, and
nobody outside the scheduler changes its queues."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import pytest

import quire

ROOT = Path(quire.__file__).parent
BOOKKEEPING = ["block_pool", "kv_cache_manager", "scheduler", "scheduler_output", "request",
               "beam_search", "swap_manager", "stats", "batch_builder", "step_plan",
               "features.base", "features.beam_search", "features.lora_slots"]
# The floors, lowest first: a module may import its own floor and those below it.
FLOORS = [
    # ground: plain helpers and the grammar library's wrapper
    ["quire.validation", "quire.writable_dirs", "quire.platform", "quire.cpu_threads",
     "quire.collector",
     "quire.parallel_state", "quire.structured", "quire.version", "quire.priorities"],
    # what requests and steps are made of (values, no behaviour beyond validation)
    ["quire.sampling_params", "quire.outputs", "quire.step_batch", "quire.sampling_batch",
     "quire.speculative_config", "quire.config",
     # the KV tiers and KV-cache events: stores and a publisher the engine drives, which
     # know only these values (their configs are EngineArgs')
     "quire.kv_tiers", "quire.kv_events",
     # a multimodal prompt's values, its images checked and hashed, the processor step
     "quire.multimodal"],
    ["quire.native"],                          # the C++ kernels and their wrappers
    ["quire.attention", "quire.layers"],       # attention backends, linear/norm/MoE layers
    ["quire.models", "quire.lora"],            # model families, adapters
    ["quire.worker", "quire.distributed"],     # runner, sampler, KV tensors; TP workers
    ["quire.executor", "quire.spec_decode"],   # the step's tensor side; proposers
    ["quire.engine", "quire.pooling"],         # scheduler, features, LLMEngine; pooling
    ["quire.metrics", "quire.tracing", "quire.entrypoints", "quire.router"],
    ["quire"],                                 # the package's public names
]
# Imports that run up a floor on purpose: (importer, imported) -> why
UPWARD = {}
# The modules that may write a Request's fields (the rest read it)
REQUEST_WRITERS = {"engine/request.py", "engine/scheduler.py", "engine/kv_cache_manager.py",
                   "engine/output_processor.py", "engine/beam_search.py"}
# what the engine hands the worker: neutral ground that both sides import
BATCH_DESCRIPTIONS = ["quire.step_batch", "quire.sampling_batch"]
POOL_MUTATORS = {"allocate", "touch", "free", "cache_block", "uncache", "reset_prefix_cache"}
QUEUE_MUTATORS = {"append", "appendleft", "insert", "remove", "pop", "popleft", "clear",
                  "extend"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# parsed once per session (~1.5 s of the tree's sources): the tests only read the trees
@functools.cache
def sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in ROOT.rglob("*.py")}


def every_import(tree: ast.Module, module: str, package: bool) -> list[tuple[str, list[str],
                                                                            int, str | None]]:
    """(module, names, line, enclosing function or None) of every import that can run: at
    module level and lazy ones (in functions and methods, under try/with/if/loops); only
    `if TYPE_CHECKING:` bodies are left out. Relative imports are resolved against `module`
    (a package's own name where `package`)."""
    found = []
    base = module.split(".") if package else module.split(".")[:-1]

    def visit(node, scope, lazy):
        function = ".".join(scope) if lazy else None
        if isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno, function) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                prefix = base[:len(base) - node.level + 1]
                target = ".".join(prefix + ([target] if target else []))
            found.append((target, [a.name for a in node.names], node.lineno, function))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
            lazy = lazy or not isinstance(node, ast.ClassDef)
        for child in children:
            visit(child, scope, lazy)
    visit(tree, [], False)
    return found


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {module it imports: where and how (for the failure message)}."""
    trees = sources()
    graph = {}
    for mod, tree in trees.items():
        package = (ROOT.parent / mod.replace(".", "/") / "__init__.py").exists()
        edges: dict[str, str] = {}
        for target, names, line, function in every_import(tree, mod, package):
            for candidate in [f"{target}.{n}" for n in names] + [target]:
                if candidate in trees and candidate != mod:
                    how = f"lazily, inside {function}()" if function else "at module level"
                    path = mod.replace(".", "/") + ("/__init__.py" if package else ".py")
                    edges.setdefault(candidate, f"{path}:{line} imports {candidate} {how}")
                    break
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, Iterable[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def describe_cycle(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return "\n".join(["import cycle: " + " -> ".join(cycle)]
                     + [f"  {graph[a][b]}" for a, b in zip(cycle, cycle[1:])])


def test_the_runtime_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 30 and "quire.engine.scheduler" in graph
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(graph, cycle)


def test_lazy_imports_count_and_type_checking_ones_do_not():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import a\n"
        "if TYPE_CHECKING:\n"
        "    from b import B\n"
        "try:\n"
        "    import c\n"
        "except ImportError:\n"
        "    import d\n"
        "class K:\n"
        "    def m(self):\n"
        "        with x:\n"
        "            from . import e\n"
        "        from ..f import g\n")
    found = {(t, line, fn) for t, _, line, fn in every_import(tree, "p.q.mod", package=False)}
    assert found == {("typing", 1, None), ("a", 2, None), ("c", 6, None), ("d", 8, None),
                     ("p.q", 12, "K.m"), ("p.f", 13, "K.m")}


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", BOOKKEEPING)
def test_engine_bookkeeping_imports_no_tensors_and_no_worker(name):
    tree = sources()[f"quire.engine.{name}"]
    for target, _, _, _ in every_import(tree, f"quire.engine.{name}", package=False):
        assert not target.startswith(("torch", "numpy", "quire.worker", "quire.models",
                                      "quire.attention")), (
            f"quire/engine/{name}.py imports {target}: the scheduler side is plain Python "
            "bookkeeping that never touches tensors")


def test_no_engine_module_imports_the_worker_the_executor_is_the_door():
    for mod, tree in sources().items():
        if not mod.startswith("quire.engine."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quire.worker"):
                raise AssertionError(f"{mod} imports {node.module}: go through quire.executor")


def floor_of(module: str) -> int:
    best, length = None, -1
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or (p != "quire" and module.startswith(p + "."))) and len(p) > length:
                best, length = i, len(p)
    assert best is not None, f"{module} is on no floor: add its package to FLOORS"
    return best


def upward_imports(graph) -> list[str]:
    return sorted(f"{how} (floor {floor_of(a)} -> {floor_of(b)})"
                  for a, edges in graph.items() for b, how in edges.items()
                  if floor_of(b) > floor_of(a) and (a, b) not in UPWARD)


def test_imports_point_down_the_floors():
    graph = import_graph()
    assert upward_imports(graph) == [], "an import runs up a floor"
    assert len(UPWARD) <= 3
    for (a, b) in UPWARD:  # each named one still exists, so the list can't go stale
        assert b in graph[a], f"UPWARD names {a} -> {b}, which is gone: remove it"


def test_an_upward_import_would_be_found():
    graph = {"quire.layers.norms": {"quire.models.llama": "layers/norms.py:1 imports it"},
             "quire.models.llama": {}}
    assert upward_imports(graph) == ["layers/norms.py:1 imports it (floor 3 -> 4)"]


REQUEST_FIELDS = {"request_id", "client_request_id", "sample_index", "sampling_params",
                  "eos_token_ids", "stop_token_ids", "max_tokens", "num_prompt_tokens",
                  "token_ids", "num_computed_tokens", "num_cached_tokens", "status",
                  "stop_reason", "metrics", "cumulative_logprob", "logprobs",
                  "pending_siblings", "block_hashes", "num_preemptions", "lockstep_group",
                  "lora", "cache_salt", "long_rope", "priority"}
REQUEST_MUTATORS = {"append_token", "drop_output_tokens_after", "start_running", "end"}
# names a Request goes by in the runtime's code
REQUEST_NAMES = {"seq", "req", "request", "s", "parent", "child", "root", "beam", "sibling",
                 "victim"}


def request_writes(root: Path = None) -> list[str]:
    root = root or ROOT
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in REQUEST_WRITERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                chain = attribute_chain(t)
                if len(chain) >= 2 and chain[0] in REQUEST_NAMES and chain[1] in REQUEST_FIELDS:
                    found.append(f"{rel}:{node.lineno} writes {'.'.join(chain)}")
            if isinstance(node, ast.Call):
                chain = attribute_chain(node.func)
                if (len(chain) == 2 and chain[0] in REQUEST_NAMES
                        and chain[1] in REQUEST_MUTATORS):
                    found.append(f"{rel}:{node.lineno} calls {'.'.join(chain)}")
    return sorted(found)


def test_only_the_engine_bookkeeping_writes_a_request():
    assert request_writes() == []


def test_a_request_write_would_be_found(tmp_path):
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "x.py").write_text("def f(seq, s):\n    seq.lora = 1\n"
                                            "    s.append_token(3)\n    seq.metrics.x = 2\n")
    assert request_writes(tmp_path) == ["lora/x.py:2 writes seq.lora",
                                        "lora/x.py:3 calls s.append_token",
                                        "lora/x.py:4 writes seq.metrics.x"]


def worker_side(modules) -> list[str]:
    return sorted(m for m in modules
                  if m == "quire.worker" or m.startswith("quire.worker.") or m in BATCH_DESCRIPTIONS)


def is_engine(module: str) -> bool:
    return module == "quire.engine" or module.startswith("quire.engine.")


def engine_imports(mod: str, tree: ast.Module) -> list[str]:
    """Every import of quire.engine in a module: at module level, inside functions, under
    `if TYPE_CHECKING:`, relative or absolute."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if is_engine(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = mod.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
            found += [t for t in targets if is_engine(t)][:1]
    return found


def test_the_worker_never_imports_the_engine():
    trees = sources()
    checked = worker_side(trees)
    assert "quire.worker.sampler" in checked and "quire.worker.model_runner" in checked
    assert set(BATCH_DESCRIPTIONS) <= set(checked)
    found = {m: engine_imports(m, trees[m]) for m in checked}
    assert not {m: f for m, f in found.items() if f}, (
        "the worker gets a StepBatch / SamplingBatch (quire/step_batch.py), never requests")


def test_nor_does_anything_the_worker_imports():
    graph = import_graph()
    for mod in worker_side(graph):
        seen, todo = set(), [mod]
        while todo:
            for nxt in set(graph[todo.pop()]) - seen:
                seen.add(nxt)
                todo.append(nxt)
        reached = sorted(m for m in seen if is_engine(m))
        assert not reached, f"{mod} imports the engine through its imports: {reached}"


def test_an_engine_import_in_the_worker_would_be_found():
    tree = ast.parse("from __future__ import annotations\n"
                     "import torch\n"
                     "def f():\n"
                     "    from quire.engine.request import Request\n"
                     "    from ..engine import scheduler\n"
                     "    from quire import engine\n"
                     "    import quire.engine.scheduler_output\n")
    assert engine_imports("quire.worker.sampler", tree) == [
        "quire.engine.request", "quire.engine", "quire.engine",
        "quire.engine.scheduler_output"]
    assert engine_imports("quire.worker.sampler",
                          ast.parse("from quire.sampling_batch import SamplingBatch")) == []


def attribute_chain(node: ast.AST) -> list[str]:
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        chain.append(node.id)
    return chain[::-1]


def boundary_violations() -> list[str]:
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            chain = attribute_chain(node.func) if isinstance(node, ast.Call) else []
            if (len(chain) >= 3 and chain[-2] == "pool" and chain[-1] in POOL_MUTATORS
                    and rel != "engine/kv_cache_manager.py"):
                found.append(f"{rel}:{node.lineno} changes the block pool: {'.'.join(chain)}")
            if (len(chain) >= 3 and chain[-2] in ("running", "waiting", "swapped")
                    and chain[-1] in QUEUE_MUTATORS and rel != "engine/scheduler.py"):
                found.append(f"{rel}:{node.lineno} changes a scheduler queue: {'.'.join(chain)}")
            if (isinstance(node, ast.Attribute) and node.attr in ("_tables", "req_blocks")
                    and rel != "engine/kv_cache_manager.py"):
                found.append(f"{rel}:{node.lineno} reads block tables: .{node.attr}")
    return found


def test_block_tables_and_queues_change_only_through_their_owners():
    assert boundary_violations() == []


def test_a_boundary_violation_would_be_found(tmp_path, monkeypatch):
    fake = tmp_path / "quire"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "engine.py").write_text(
        "def f(self, child):\n"
        "    self.scheduler.running.append(child)\n"
        "    self.kv_manager.pool.free([1])\n"
        "    return self.kv_manager.req_blocks\n")
    monkeypatch.setitem(boundary_violations.__globals__, "ROOT", fake)
    assert len(boundary_violations()) == 3
