"""Public docstrings give a contract, not a history: at most 15 lines (``moe_front`` excepted), and no
date or commit anywhere in the package's source (figures with their date and commit belong in
docs/findings.md). Every module of moe_front_jax, its pallas and bridge subpackages included, is
imported on the CPU (the bridge imports jax-triton only when a kernel is built)."""

import importlib
import inspect
import pkgutil
import re

import pytest

import moe_front_jax
import moe_front_jax.bridge
import moe_front_jax.pallas

MOST_LINES = 15
LONG_ALLOWED = {"moe_front_jax.api.moe_front"}
"""The one public docstring that may run longer: the library's entry point, its options' guide."""
DATE = re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def module_names() -> list[str]:
    """The package and every module under it; pallas/ and bridge/ install as subpackages from
    folders of their own, so they are walked from their own paths."""
    names = {moe_front_jax.__name__}
    for package in (moe_front_jax, moe_front_jax.pallas, moe_front_jax.bridge):
        names.add(package.__name__)
        names.update(info.name for info in
                     pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."))
    return sorted(names)


def public_objects(module):
    """``(qualified name, object)`` of the module's public functions and classes, and of the public
    methods and properties of those classes, where the module defines them."""
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def history(text: str) -> list[str]:
    """The dates and commit-like hashes in ``text``."""
    return [m.group() for m in DATE.finditer(text)] + COMMIT.findall(text)


MODULES = module_names()


def test_walks_the_kernel_subpackages():
    """The walk reaches the pallas and bridge folders (installed as subpackages) and the API
    modules."""
    assert "moe_front_jax.pallas.front_gemm.kernel" in MODULES
    assert "moe_front_jax.pallas.shared_expert.tma" in MODULES
    assert "moe_front_jax.bridge.triton_mailbox" in MODULES
    assert {"moe_front_jax.api", "moe_front_jax.planner", "moe_front_jax.registry"} <= set(MODULES)


def test_the_patterns_find_what_they_look_for():
    assert history("measured 2026-12-07 at cd9c802") == ["2026-12-07", "cd9c802"]
    assert history("as of commit 2f9bfd6") == ["2f9bfd6"]
    assert history("a 7168-wide row, 0xff00, block 2048, deadbeef") == []


@pytest.mark.parametrize("name", MODULES)
def test_docstrings_are_short_and_carry_no_history(name):
    module = importlib.import_module(name)
    problems = []
    # The whole source: comments and the strings under constants (attribute docstrings) too.
    if found := history(inspect.getsource(module)):
        problems.append(f"{name} (source): {found}")
    for qualified, obj in public_objects(module):
        doc = inspect.getdoc(obj) or ""
        lines = len(doc.splitlines())
        if lines > MOST_LINES and qualified not in LONG_ALLOWED:
            problems.append(f"{qualified}: {lines} lines")
        if found := history(doc):
            problems.append(f"{qualified}: {found}")
    assert not problems, "\n".join(problems)
