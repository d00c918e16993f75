"""Loading the MoE front's weights from safetensors checkpoints.

A checkpoint stores a layer's weights under the model's names behind a layer prefix, for example
``model.layers.3.mlp.gate.weight``. ``load_weights`` finds the keys of SPEC.md section 2 behind a prefix,
in one file, a list of files, or a directory (through its ``model.safetensors.index.json`` when there is
one), checks every shape and dtype from the files' headers before reading any data, and returns the
weights dict that ``pack_params`` and ``mf.nn.MoEFront`` take.

Example::

  cfg = mf.KIMI_K3
  weights = mf.load_weights("/ckpt/kimi-k3", cfg, prefix="model.layers.3.mlp.")
  params = mf.pack_params(weights, cfg)              # or mf.load_params(...) in one step
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open

from moe_front_jax import params as P
from moe_front_jax.config import FrontConfig

INDEX = "model.safetensors.index.json"
"""The index a sharded Hugging Face checkpoint keeps beside its files: ``{"weight_map": {key: file}}``."""

SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F32": jnp.float32}
"""safetensors' dtype names of the dtypes the front's weights have (SPEC section 2)."""

PathLike = str | os.PathLike


def checkpoint_files(paths_or_dir: PathLike | Iterable[PathLike]) -> dict[str, Path]:
    """Map every tensor key of a checkpoint to the file that holds it.

    Args:
      paths_or_dir: a ``.safetensors`` file, a list of them, or a directory: through its
        ``model.safetensors.index.json`` when there is one, else every ``*.safetensors`` in it.

    Raises:
      ValueError: a path that does not exist, a directory without safetensors files, or a key found in
        two files.
    """
    if isinstance(paths_or_dir, (str, os.PathLike)):
        root = Path(paths_or_dir)
        if root.is_dir():
            index = root / INDEX
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return {key: root / name for key, name in weight_map.items()}
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise ValueError(f"paths_or_dir={str(root)!r} holds no *.safetensors file and no {INDEX}")
        else:
            files = [root]
    else:
        files = [Path(p) for p in paths_or_dir]
        if not files:
            raise ValueError("paths_or_dir is an empty list; expected at least one .safetensors file")
    found: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise ValueError(f"paths_or_dir names {str(path)!r}, which is not a file")
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                if key in found:
                    raise ValueError(f"key {key!r} is in both {str(found[key])!r} and {str(path)!r}")
                found[key] = path
    return found


def _check_header(path: Path, key: str, shape: tuple[int, ...], dtype) -> None:
    """Raise a ValueError naming ``key`` unless the file's header gives it ``shape`` and ``dtype``."""
    with safe_open(path, framework="numpy") as f:
        if key not in f.keys():
            raise ValueError(f"checkpoint key {key!r} is missing from {str(path)!r}")
        tensor = f.get_slice(key)
        got_shape, got_dtype = tuple(tensor.get_shape()), tensor.get_dtype()
    if got_shape != shape or SAFETENSORS_DTYPES.get(got_dtype) != dtype:
        raise ValueError(
            f"checkpoint key {key!r} in {str(path)!r} is {got_shape} {got_dtype}, "
            f"expected {shape} {jnp.dtype(dtype)}"
        )


def _read(path: Path, key: str) -> np.ndarray:
    with safe_open(path, framework="numpy") as f:
        return f.get_tensor(key)


def load_weights(
    paths_or_dir: PathLike | Iterable[PathLike], cfg: FrontConfig, prefix: str = ""
) -> dict[str, jax.Array]:
    """The front's weights from a safetensors checkpoint, on the default device.

    Args:
      paths_or_dir: a ``.safetensors`` file, a list of them, or a directory (see ``checkpoint_files``).
      cfg: the model's sizes; every shape and dtype is checked against it.
      prefix: what stands before the SPEC's key names in the checkpoint, e.g. ``"model.layers.3.mlp."``.

    Returns:
      ``{name: array}`` under the keys of SPEC section 2 (``gate.weight`` ``[E, H]`` bf16, ...), with the
      shared expert's two keys exactly when the checkpoint has them; validated by ``check_weights``.

    Raises:
      ValueError: naming the checkpoint key that is missing or has the wrong shape or dtype (checked
        from the file headers, before any data is read), or only one of the shared expert's keys.
    """
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str such as 'model.layers.3.mlp.', got {prefix!r}")
    files = checkpoint_files(paths_or_dir)
    expected = P.weight_shapes(cfg)
    names = [name for name in expected if name not in P.SHARED_KEYS]
    shared_found = [name for name in P.SHARED_KEYS if prefix + name in files]
    if shared_found:
        names += P.SHARED_KEYS
    for name in names:
        key = prefix + name
        shape, dtype = expected[name]
        if key not in files:
            near = sorted(k for k in files if k.endswith(name))[:3]
            hint = f"; keys ending in {name!r}: {near}" if near else ""
            raise ValueError(
                f"checkpoint has no key {key!r} (expected {shape} {jnp.dtype(dtype)}){hint}"
            )
        _check_header(files[key], key, shape, dtype)
    weights = {name: jnp.asarray(_read(files[prefix + name], prefix + name)) for name in names}
    P.check_weights(weights, cfg)
    return weights


def load_params(
    paths_or_dir: PathLike | Iterable[PathLike],
    cfg: FrontConfig,
    prefix: str = "",
) -> P.FrontParams:
    """``pack_params(load_weights(paths_or_dir, cfg, prefix), cfg)``: a checkpoint straight to
    ``FrontParams`` for one device. Arguments and errors as ``load_weights``."""
    return P.pack_params(load_weights(paths_or_dir, cfg, prefix), cfg)

