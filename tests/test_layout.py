"""The package boundaries (docs/design.md's module list), checked on the imports
themselves: app/ and workers/ take from the dispatcher package only what
dispatcher/common/ shares; the dispatcher package never imports workers/ (it starts them
as processes); only workers/engine/ and the bench's in-process reference
(dispatcher/tools/reference.py) import llama_cpp; nothing in dispatcher/common/ imports
the broker, the tools, app/ or workers/."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def offenders(package: str, allowed) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {name}" for path in sources(package)
            for name in sorted(imports(path)) if not allowed(path, name)]


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", ["app", "workers"])
def test_app_and_workers_take_only_the_shared_part_of_the_dispatcher(package):
    assert offenders(package, lambda path, name: not within(name, "dispatcher")
                     or within(name, "dispatcher.common")) == []


def test_the_dispatcher_never_imports_the_workers():
    assert offenders("dispatcher", lambda path, name: not within(name, "workers")) == []


def test_only_the_engine_layer_and_the_benchs_reference_touch_llama_cpp():
    engine = ROOT / "workers" / "engine"
    reference = ROOT / "dispatcher" / "tools" / "reference.py"
    for package in ("app", "dispatcher", "workers"):
        assert offenders(package, lambda path, name: not within(name, "llama_cpp")
                         or engine in path.parents or path == reference) == []


def test_the_shared_part_stands_alone():
    assert offenders("dispatcher/common", lambda path, name: not any(
        within(name, p) for p in ("app", "workers", "dispatcher"))
        or within(name, "dispatcher.common")) == []


def test_both_engines_implement_the_engine_protocol_the_loop_relies_on():
    """workers/interface.py's Engine names what the loop uses of an engine; the fake and
    the llama engine each have every member (the llama engine's read from its source:
    loading it needs a model): its methods, class attributes and attributes it sets."""
    import re

    from workers.fake_engine import FakeEngine
    from workers.interface import Engine
    members = {n for n in vars(Engine) if not n.startswith("_")} | set(Engine.__annotations__)
    fake = FakeEngine("none", 64, 2)
    assert [m for m in sorted(members) if not hasattr(fake, m)] == []
    source = (ROOT / "workers" / "engine" / "llama.py").read_text()
    defined = set(re.findall(r"def ([a-z_]+)\(self", source)) | \
        set(re.findall(r"^    ([a-z_]+) = ", source, re.M))
    for targets in re.findall(r"^\s+((?:self\.[a-z_]+(?:, )?)+)(?:\s*:[^=\n]*)?\s*=", source,
                              re.M):
        defined |= set(re.findall(r"self\.([a-z_]+)", targets))
    assert [m for m in sorted(members) if m not in defined] == []
