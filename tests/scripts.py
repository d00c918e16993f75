"""The repository's scripts (examples, benchmarks) as modules, for the tests that call their
functions: loaded from their path, not imported through a package."""

import importlib.util
from pathlib import Path
from types import ModuleType


def load(path: Path, name: str) -> ModuleType:
    """The script at ``path``, run as a new module called ``name`` (its ``__name__`` is not
    ``"__main__"``, so its command line does not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
