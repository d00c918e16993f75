"""Loading the MoE front's weights from safetensors checkpoints.

A checkpoint stores a layer's weights under the model's names behind a layer prefix, for example
``model.layers.3.mlp.gate.weight``. ``load_weights`` finds the keys of SPEC.md section 2 behind a prefix,
in one file, a list of files, or a directory (through its ``model.safetensors.index.json`` when there is
one), checks every shape and dtype from the files' headers before reading any data, and returns the
weights dict that ``pack_params`` and ``mf.nn.MoEFront`` take. The families' Hugging Face names behind
the prefix (``model.layers.N.mlp.`` for DeepSeek-V3, Kimi, GLM-4.5 and Qwen3-MoE,
``model.layers.N.block_sparse_moe.`` for Mixtral) are the SPEC's: ``gate.weight``,
``gate.e_score_correction_bias`` where the config has a bias, ``shared_experts.down_proj.weight``, and
the shared gate and up either fused (``shared_experts.gate_up_proj.weight``) or as DeepSeek's two keys
``shared_experts.gate_proj.weight`` and ``shared_experts.up_proj.weight``, stacked on reading.

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
import ml_dtypes  # registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open

from moe_front_jax import parallel
from moe_front_jax import params as packing
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
      ValueError: a path that does not exist, a directory without safetensors files, a key found in
        two files, an index that is not JSON or has no ``weight_map`` of names to file names (naming
        the index file), or ``paths_or_dir`` of another type than these (naming it and its type).
    """
    if isinstance(paths_or_dir, (str, os.PathLike)):
        root = Path(paths_or_dir)
        if root.is_dir():
            index = root / INDEX
            if index.is_file():
                return {key: root / name for key, name in _weight_map(index).items()}
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise ValueError(f"paths_or_dir={str(root)!r} holds no *.safetensors file and no {INDEX}")
        else:
            files = [root]
    else:
        expected = "a .safetensors file (str or os.PathLike), a list of them, or a directory"
        if isinstance(paths_or_dir, bytes) or not isinstance(paths_or_dir, Iterable):
            kind = type(paths_or_dir).__name__
            raise ValueError(f"paths_or_dir must be {expected}, got {paths_or_dir!r} of type {kind}")
        files = list(paths_or_dir)
        for path in files:
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError(
                    f"paths_or_dir must be {expected}, got an iterable holding {path!r} of type "
                    f"{type(path).__name__}"
                )
        files = [Path(p) for p in files]
        if not files:
            raise ValueError("paths_or_dir is an empty list; expected at least one .safetensors file")
    found: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise ValueError(f"paths_or_dir names {str(path)!r}, which is not a file")
        for key in _keys(path):
            if key in found:
                raise ValueError(f"key {key!r} is in both {str(found[key])!r} and {str(path)!r}")
            found[key] = path
    return found


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a checkpoint's index file, checked to map tensor names to file names.

    Raises:
      ValueError: naming the index file, when it is not JSON or has no such ``weight_map``.
    """
    try:
        content = json.loads(index.read_text())
    except (OSError, ValueError) as error:  # ValueError: json.JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{str(index)!r} is not a readable JSON index: {error}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if weight_map is None:
        raise ValueError(
            f'{str(index)!r} has no "weight_map"; expected {{"weight_map": {{tensor name: file name}}}}'
        )
    if isinstance(weight_map, dict):  # JSON keys are str; a file name may be any JSON value
        bad = next(((key, name) for key, name in weight_map.items() if not isinstance(name, str)), None)
    else:
        bad = weight_map
    if bad is not None:
        raise ValueError(
            f'{str(index)!r}: "weight_map" must map tensor names to file names (str to str), got {bad!r}'
        )
    return weight_map


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="numpy") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {error}") from None


def _check_header(path: Path, key: str, shape: tuple[int, ...], dtype) -> None:
    """Raise a ValueError naming ``key`` unless the file's header gives it ``shape`` and ``dtype``."""
    if not path.is_file() or key not in _keys(path):
        raise ValueError(f"checkpoint key {key!r} is not in {str(path)!r}, where the index puts it")
    with safe_open(path, framework="numpy") as f:
        tensor = f.get_slice(key)
        got_shape, got_dtype = tuple(tensor.get_shape()), tensor.get_dtype()
    if got_shape != shape or SAFETENSORS_DTYPES.get(got_dtype) != dtype:
        raise ValueError(
            f"checkpoint key {key!r} in {str(path)!r} is {got_shape} {got_dtype}, "
            f"expected {shape} {jnp.dtype(dtype)}"
        )


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of an index ``jax.make_array_from_callback`` passes."""
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


class CheckpointReader:
    """The front's weights in a checkpoint, checked up front and read a block at a time.

    Construction finds every key behind ``prefix`` (e.g. ``"model.layers.3.mlp."``) in
    ``paths_or_dir`` (a ``.safetensors`` file, a list, or a directory: ``checkpoint_files``) and
    checks its shape and dtype against ``cfg`` from the file headers, reading no tensor data.
    ``read`` then reads one block of a weight, so that a device loads its own shard without any
    other device or the host holding the whole weight (``params``, ``load_params``); ``weights``
    reads every weight whole.

    Attributes ``names`` (the SPEC keys found), ``has_shared`` and ``split_gate_up`` (DeepSeek's
    two keys rather than the fused one) say what the checkpoint holds. Raises ``ValueError`` naming
    the key that is missing or has the wrong shape or dtype, only one of the shared expert's, or one
    ``cfg`` has no place for (``params.absent_keys``).
    """

    def __init__(self, paths_or_dir: PathLike | Iterable[PathLike], cfg: FrontConfig, prefix: str = ""):
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str such as 'model.layers.3.mlp.', got {prefix!r}")
        self.cfg, self.prefix = cfg, prefix
        self.files = checkpoint_files(paths_or_dir)
        if why := packing.absent_keys({k.removeprefix(prefix) for k in self.files
                                       if k.startswith(prefix)}, cfg):
            raise ValueError(f"checkpoint at prefix {prefix!r}: {why}")
        shapes = packing.weight_shapes(cfg)
        names = [name for name in shapes if name not in packing.SHARED_KEYS]
        # DeepSeek's layout: gate and up as two keys, read as the rows of the fused one.
        self.split_gate_up = (prefix + packing.GATE_UP not in self.files
                              and prefix + packing.GATE_PROJ in self.files)
        fused_or_split = packing.SPLIT_GATE_UP if self.split_gate_up else (packing.GATE_UP,)
        shared_keys = (*fused_or_split, packing.DOWN)
        self.has_shared = any(prefix + name in self.files for name in shared_keys)
        checked = list(names)
        if self.has_shared:
            names += packing.SHARED_KEYS
            checked += shared_keys
            if cfg.shared:
                h, s = cfg.hidden, cfg.shared
                shapes.update({name: ((s, h), jnp.bfloat16) for name in packing.SPLIT_GATE_UP})
        for name in checked:
            key = prefix + name
            shape, dtype = shapes.get(name, (None, None))
            if shape is None:
                raise ValueError(
                    f"checkpoint has shared-expert key {key!r} but FrontConfig.shared is 0"
                )
            if key not in self.files:
                near = sorted(k for k in self.files if k.endswith(name))[:3]
                hint = f"; keys ending in {name!r}: {near}" if near else ""
                raise ValueError(
                    f"checkpoint has no key {key!r} (expected {shape} {jnp.dtype(dtype)}){hint}"
                )
            _check_header(self.files[key], key, shape, dtype)
        self.names = tuple(names)

    def read(self, name: str, bounds: list[tuple[int, int]] | None = None) -> np.ndarray:
        """Weight ``name`` (a SPEC key), or its block ``[start, stop)`` per dimension, as numpy."""
        if name == packing.GATE_UP and self.split_gate_up:
            return self._read_split_gate_up(bounds)
        key = self.prefix + name
        with safe_open(self.files[key], framework="numpy") as f:
            if bounds is None:
                return f.get_tensor(key)
            return f.get_slice(key)[tuple(slice(a, b) for a, b in bounds)]

    def _read_split_gate_up(self, bounds: list[tuple[int, int]] | None) -> np.ndarray:
        """Rows ``[r0, r1)`` of the fused ``[2S, H]`` gate/up from the gate and up keys."""
        s = self.cfg.shared
        (r0, r1), cols = bounds if bounds is not None else ((0, 2 * s), (0, self.cfg.hidden))
        blocks = [self.read(name, [(max(r0, lo) - lo, min(r1, lo + s) - lo), cols])
                  for name, lo in zip(packing.SPLIT_GATE_UP, (0, s)) if max(r0, lo) < min(r1, lo + s)]
        return np.concatenate(blocks)

    def weights(self) -> dict[str, jax.Array]:
        """Every weight found, whole, on the default device (the SPEC's weights dict)."""
        return {name: jnp.asarray(self.read(name)) for name in self.names}

    def params(self, mesh: Mesh | None = None, axis: str = "tp") -> packing.FrontParams:
        """``load_params``' ``FrontParams``: on one device, or each device of ``mesh`` reading its shard."""
        if mesh is None:
            return packing.pack_params(self.weights(), self.cfg)
        tp = parallel.mesh_tp(self.cfg, mesh, axis)
        cfg = self.cfg.with_tp(tp)
        shard, s_r, h = cfg.latent_per_rank, cfg.shared_per_rank, cfg.hidden
        split = packing.padded_split(cfg.experts_per_rank)
        specs = parallel.param_specs(axis)

        def placed(name, shape, block):
            sharding = NamedSharding(mesh, specs[name])
            return jax.make_array_from_callback(shape, sharding, lambda index: block(_bounds(index, shape)))

        def stacked(name, rows_per_rank):
            """The device's block of ``name``: its ranks' pieces of ``params.rank_rows``."""
            def block(bounds):
                (r0, r1), cols = bounds
                blocks = []
                for rank in range(r0 // rows_per_rank, r1 // rows_per_rank):
                    blocks += packing.stack_rows(
                        packing.rank_rows(cfg, rank, split)[name],
                        lambda key, lo, hi: self.read(key, [(lo, hi), cols]),
                        lambda n: np.zeros((n, cols[1] - cols[0]), ml_dtypes.bfloat16))
                return np.concatenate(blocks)
            return block

        packed_block = stacked("packed", split + shard)
        gate_up_block = stacked("gate_up", 2 * s_r)
        packed = placed("packed", (tp * (split + shard), h), packed_block)
        if cfg.bias:
            bias = placed("bias", (cfg.experts,), lambda bounds: self.read(packing.BIAS, bounds))
        else:
            bias = placed("bias", (cfg.experts,),
                          lambda bounds: np.zeros(bounds[0][1] - bounds[0][0], np.float32))
        gate_up = down = None
        if self.has_shared:
            gate_up = placed("gate_up", (2 * cfg.shared, h), gate_up_block)
            down = placed("down", (h, cfg.shared), lambda bounds: self.read(packing.DOWN, bounds))
        return packing.FrontParams(packed, bias, gate_up, down, cfg, split, mesh=mesh, axis=axis)


def load_weights(
    paths_or_dir: PathLike | Iterable[PathLike], cfg: FrontConfig, prefix: str = ""
) -> dict[str, jax.Array]:
    """The front's weights from a safetensors checkpoint, on the default device.

    ``paths_or_dir`` is a ``.safetensors`` file, a list of them, or a directory
    (``checkpoint_files``); ``prefix`` what stands before the SPEC's key names, e.g.
    ``"model.layers.3.mlp."``; every shape and dtype is checked against ``cfg``. Returns ``{name:
    array}`` under the keys of SPEC section 2, with the shared expert's exactly when the checkpoint
    has them (``check_weights`` validates it).

    Raises:
      ValueError: naming the checkpoint key that is missing or has the wrong shape or dtype (from
        the file headers, before any data is read), only one of the shared expert's keys, a source
        that is not a path, a list of paths or a directory, or a bad index file.
    """
    weights = CheckpointReader(paths_or_dir, cfg, prefix).weights()
    packing.check_weights(weights, cfg)
    return weights


def load_params(
    paths_or_dir: PathLike | Iterable[PathLike],
    cfg: FrontConfig,
    prefix: str = "",
    *,
    mesh: Mesh | None = None,
    axis: str = "tp",
) -> packing.FrontParams:
    """A checkpoint straight to ``FrontParams``: for one device, or straight into the tp shards.

    Without a mesh: ``pack_params(load_weights(paths_or_dir, cfg, prefix), cfg)``. With one: the same
    params as ``shard_params(load_weights(...), cfg, mesh, axis)``, but each device reads only its
    rank's rows from the files and packs them itself, so no device holds another rank's weights.

    Args:
      paths_or_dir, cfg, prefix: as for ``load_weights``.
      mesh: a ``jax.sharding.Mesh`` with ``axis`` (see ``shard_params``), or None.
      axis: the tensor-parallel mesh axis.

    Raises:
      ValueError: as ``load_weights``, and as ``shard_params`` for a mesh that does not fit ``cfg``.
    """
    return CheckpointReader(paths_or_dir, cfg, prefix).params(mesh=mesh, axis=axis)
