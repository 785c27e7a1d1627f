"""The package's imports point one way (docs/architecture.md): the HTTP server knows the
EngineClient protocol and nothing of the engine's implementation; the core knows nothing
above it; no model module asks for kernels on its own (the backend is handed in)."""
import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "pagedllm"

# package -> packages (or modules) of pagedllm it must never import
FORBIDDEN = {
    "core": ("engine", "serving", "server", "replicas", "models", "backends", "attention",
             "weights", "cli", "tools"),
    "engine": ("serving", "server", "replicas", "cli", "tools"),
    "serving": ("server", "replicas", "cli", "tools"),
    "server": ("engine", "models", "backends", "attention", "kernels", "weights.gguf",
               "weights.safetensors", "replicas", "serving.local", "cli", "tools"),
    "models": ("engine", "serving", "server", "replicas", "cli", "tools"),
    "tokenizer": ("core", "engine", "serving", "server", "models"),
    "reasoning": ("engine", "serving", "server", "replicas", "models", "backends", "cli", "tools"),
}


def imports_of(path: pathlib.Path) -> set[str]:
    """Every pagedllm module a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedllm"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pagedllm"))
    return found


def test_imports_point_one_way():
    wrong = []
    for package, banned in FORBIDDEN.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for module in imports_of(path):
                inner = module.removeprefix("pagedllm.")
                if any(inner == b or inner.startswith(b + ".") for b in banned):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert wrong == []


def test_the_layer_test_sees_a_wrong_import(tmp_path):
    """The check above would catch the shape it guards against."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pagedllm.engine.engine import LLMEngine\n")
    assert "pagedllm.engine.engine" in imports_of(bad)


def test_the_server_loads_without_the_engine():
    """Importing the whole HTTP server pulls in no engine, model, kernel module or torch:
    it depends on serving/client.py's protocol alone."""
    code = ("import sys\nimport pagedllm.server.app, pagedllm.server.runner\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
            "'pagedllm.engine', 'pagedllm.models', 'pagedllm.backends', 'pagedllm.attention', "
            "'pagedllm.replicas', 'pagedllm.serving.local'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_model_module_asks_for_kernels():
    """Kernels are chosen once (backends/cpu.py) and handed to the model's constructor."""
    askers = [str(path.relative_to(PACKAGE)) for folder in ("models", "attention", "engine")
              for path in (PACKAGE / folder).rglob("*.py")
              if any(name in path.read_text(encoding="utf-8")
                     for name in ("kernel_ops(", "capabilities(", "torch_ops("))]
    assert askers == []


def test_every_engine_client_has_the_whole_protocol():
    from pagedllm.serving.client import EngineClient
    from pagedllm.serving.local import LocalEngineClient

    # info, dead, restarting, stalled, loras: set by each constructor (or a class attribute, or
    # a property)
    attributes = set(EngineClient.__annotations__)
    wanted = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"submit", "abort", "figures", "make_request", "run"} <= set(wanted)
    assert attributes == {"info", "dead", "restarting", "stalled", "loras"}
    assert [name for name in wanted if name not in dir(LocalEngineClient)] == []
    for path, class_name in (("replicas/front.py", "ReplicaClient"),
                             ("serving/process_client.py", "ProcessEngineClient")):
        tree = ast.parse((PACKAGE / path).read_text(encoding="utf-8"))
        client = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
        defined = {n.name for n in client.body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assigned = {node.attr for node in ast.walk(client) if isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)}
        assert [name for name in wanted if name not in defined] == [], class_name
        assert attributes <= assigned | defined, class_name
