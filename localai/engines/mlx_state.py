"""An MLX sequence's cache as bytes: the prompt cache's state, its token blocks and its checkpoints.

A state is a little-endian header length, a JSON header describing each layer's cache (its class and its items:
arrays by dtype, shape and size, scalars by value, lists of either) and then the arrays' bytes in order. A plain
``KVCache`` holds only the used part of its buffers, so it can be cut by token; every other cache (a rotating
window, the recurrent ``ArraysCache`` of hybrids such as Qwen3.5 and Nemotron-H) is kept whole, as the "rest" of a
state: the same format holding only those layers. A checkpoint is that rest as it stood at a token, behind an
8-byte magic (the prompt cache strips 8 bytes of every engine's checkpoint).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

CHECKPOINT_MAGIC = b"MLXCKPT1"


def dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


CUTTABLE = ("KVCache", "QuantizedKVCache")


def is_cuttable(layer: Any) -> bool:
    """A plain KV cache, quantized or not: its state is cut anywhere by token. Anything else is kept whole (and
    checkpointed)."""
    return type(layer) in (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def _array_bytes(array: Any) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)  # numpy has no bfloat16: move the bits as they are
    return bytes(np.asarray(array).tobytes())


def _array_from(data: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> Any:
    if dtype == "bfloat16":
        return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(np.frombuffer(data, np.dtype(dtype)).reshape(shape))


def storage_dtype(name: str) -> Any:
    """The numpy type a serialized array's bytes are read as (bfloat16's bits travel as uint16)."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def _describe(item: Any, chunks: list[bytes]) -> dict[str, Any]:
    if isinstance(item, mx.array):
        data = _array_bytes(item)
        chunks.append(data)
        return {"dtype": dtype_name(item.dtype), "shape": list(item.shape), "bytes": len(data)}
    if isinstance(item, list | tuple):
        return {"list": [_describe(value, chunks) for value in item]}
    if item is None or isinstance(item, bool | int | float | str):
        return {"value": item}
    raise ValueError(f"an MLX cache holds a {type(item).__name__}, which the prompt cache cannot store")


def _layer_items(layer: Any) -> list[Any]:
    """A layer's items; a KV cache's token arrays (keys, values: arrays, or the quantized (data, scales, biases))
    only up to its offset, its scalars after them."""
    if type(layer) is mlx_cache.QuantizedKVCache:
        if layer.keys is None:
            return [None, None, 0, layer.group_size, layer.bits]
        return [[part[..., :layer.offset, :] for part in layer.keys],
                [part[..., :layer.offset, :] for part in layer.values], layer.offset, layer.group_size, layer.bits]
    if is_cuttable(layer):
        if layer.keys is None:
            return [None, None, 0]
        return [layer.keys[..., :layer.offset, :], layer.values[..., :layer.offset, :], layer.offset]
    return list(layer.state)


def _describe_layer(layer: Any, chunks: list[bytes]) -> dict[str, Any]:
    if isinstance(layer, mlx_cache.CacheList):
        return {"class": "CacheList", "caches": [_describe_layer(inner, chunks) for inner in layer.caches]}
    return {"class": type(layer).__name__, "meta": None,
            "items": [_describe(item, chunks) for item in _layer_items(layer)]}


def encode(layers: list[Any], n_tokens: int) -> bytes:
    """Layers of MLX caches holding ``n_tokens`` tokens, as bytes (``decode``'s inverse)."""
    chunks: list[bytes] = []
    described = [_describe_layer(layer, chunks) for layer in layers]
    return pack({"layers": described, "tokens": n_tokens}, chunks)


def pack(header: dict[str, Any], chunks: list[bytes]) -> bytes:
    data = json.dumps(header).encode()
    return struct.pack("<I", len(data)) + data + b"".join(chunks)


def parse(state: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """A state's header, and where the arrays' bytes begin."""
    try:
        (length,) = struct.unpack_from("<I", state)
        header = json.loads(bytes(state[4:4 + length]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"not an MLX cache state: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("layers"), list):
        raise ValueError("not an MLX cache state: no layers")
    return header, 4 + length


class _Reader:
    def __init__(self, state: bytes | bytearray | memoryview, position: int) -> None:
        self.state = memoryview(state)
        self.position = position

    def item(self, described: dict[str, Any]) -> Any:
        if "dtype" in described:
            size = int(described["bytes"])
            if self.position + size > len(self.state):
                raise ValueError("an MLX cache state ends inside an array")
            data = self.state[self.position:self.position + size]
            self.position += size
            return _array_from(data, described["dtype"], described["shape"])
        if "list" in described:
            return [self.item(value) for value in described["list"]]
        return described["value"]

    def layer(self, described: dict[str, Any]) -> Any:
        name = described["class"]
        if name == "CacheList":
            return mlx_cache.CacheList(*(self.layer(inner) for inner in described["caches"]))  # type: ignore[no-untyped-call]
        items = [self.item(value) for value in described["items"]]
        if name == "KVCache":
            restored = mlx_cache.KVCache()  # type: ignore[no-untyped-call]
            keys, values, offset = items
            if keys is not None:
                restored.keys, restored.values, restored.offset = keys, values, int(offset)
            return restored
        if name == "QuantizedKVCache":
            keys, values, offset, group_size, bits = items
            quantized: Any = mlx_cache.QuantizedKVCache(group_size=int(group_size), bits=int(bits))
            if keys is not None:
                quantized.keys, quantized.values, quantized.offset = tuple(keys), tuple(values), int(offset)
            return quantized
        kind = getattr(mlx_cache, name, None)
        from_state = getattr(kind, "from_state", None) if isinstance(kind, type) else None
        if not callable(from_state):
            raise ValueError(f"an MLX cache state names the unknown cache class {name!r}")
        if name == "ArraysCache":
            items[0] = list(items[0])
        return from_state(tuple(items))


def decode(state: bytes | bytearray | memoryview) -> tuple[list[Any], int]:
    """The caches ``encode`` wrote and the tokens they hold; raises ValueError (or KeyError/TypeError) for bytes it
    did not write."""
    header, position = parse(state)
    reader = _Reader(state, position)
    layers = [reader.layer(layer) for layer in header["layers"]]
    if reader.position != len(reader.state):
        raise ValueError("an MLX cache state has bytes after its last array")
    return layers, int(header.get("tokens", 0))


def checkpoint(layers: list[Any], n_tokens: int) -> bytes:
    """The layers that cannot be cut by token, as they are now, behind the magic."""
    return CHECKPOINT_MAGIC + encode([layer for layer in layers if not is_cuttable(layer)], n_tokens)


def rest_of(data: bytes) -> bytes:
    if data[:8] != CHECKPOINT_MAGIC:
        raise ValueError("not an MLX checkpoint")
    return data[8:]


def split(state: bytes | bytearray | memoryview, n_tokens: int,
          ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
    """Cut a state by token range: a piece holds, KV layer after KV layer, the keys and then the values of its
    tokens; the other layers (windows, recurrent state) are the rest, kept whole. None when no layer is a plain KV
    cache (a state that is all rest is kept whole by the prompt cache)."""
    header, position = parse(state)
    layers: list[dict[str, Any]] = []
    arrays: list[Any] = []
    rest_layers: list[dict[str, Any]] = []
    rest_chunks: list[bytes] = []
    mixed = not all(layer.get("class") in CUTTABLE for layer in header["layers"])
    view = memoryview(state)
    for layer in header["layers"]:
        if layer.get("class") not in CUTTABLE:
            start = position
            position = _skip(layer, position)
            rest_layers.append(layer)
            rest_chunks.append(bytes(view[start:position]))
            layers.append({"rest": True})
            continue
        keys, values = layer["items"][:2]
        if "value" in keys:
            return None  # an empty KV cache: nothing to cut
        described = []
        for item in [*keys.get("list", [keys]), *values.get("list", [values])]:
            shape = item["shape"]
            if len(shape) != 4 or shape[2] != n_tokens:
                raise ValueError(f"a KV array of shape {shape} does not hold {n_tokens} tokens on its third axis")
            dtype = storage_dtype(item["dtype"])
            arrays.append(np.frombuffer(state, dtype, count=int(np.prod(shape)), offset=position).reshape(shape))
            position += item["bytes"]
            described.append({"dtype": item["dtype"], "shape": [shape[0], shape[1], shape[3]]})
        kept: dict[str, Any] = {"meta": layer.get("meta"), "arrays": described}
        if layer["class"] != "KVCache":  # a quantized cache: (data, scales, biases) for keys, then for values
            kept.update({"class": layer["class"], "scalars": layer["items"][3:]})
        layers.append(kept)
    if position != len(state):
        raise ValueError("the MLX state has bytes after its last array")
    if not arrays:
        return None
    pieces = [b"".join(array[:, :, start:end, :].tobytes() for array in arrays) for start, end in ranges]
    rest = pack({"layers": rest_layers, "tokens": n_tokens}, rest_chunks) if mixed else b""
    return {"mlx": 2 if mixed else 1, "layers": layers}, pieces, rest


def _skip(layer: dict[str, Any], position: int) -> int:
    def size(described: dict[str, Any]) -> int:
        if "dtype" in described:
            return int(described["bytes"])
        if "list" in described:
            return sum(size(value) for value in described["list"])
        return 0

    if layer.get("class") == "CacheList":
        for inner in layer["caches"]:
            position = _skip(inner, position)
        return position
    return position + sum(size(item) for item in layer["items"])


def join(layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> bytes:
    """The state of consecutive pieces (``split``'s) and the rest, as ``encode`` writes it."""
    if not isinstance(layout, dict) or layout.get("mlx") not in (1, 2):
        raise ValueError("not an MLX block layout")
    kv_layers = [layer for layer in layout["layers"] if "arrays" in layer]
    described = [item for layer in kv_layers for item in layer["arrays"]]
    parts: list[list[Any]] = [[] for _ in described]
    for piece, length in zip(pieces, lengths, strict=True):
        position = 0
        for index, item in enumerate(described):
            batch, heads, width = item["shape"]
            dtype = storage_dtype(item["dtype"])
            count = batch * heads * length * width
            if position + count * dtype.itemsize > len(piece):
                raise ValueError("a cache block does not match the MLX layout")
            parts[index].append(np.frombuffer(piece, dtype, count=count, offset=position)
                                .reshape(batch, heads, length, width))
            position += count * dtype.itemsize
        if position != len(piece):
            raise ValueError("a cache block does not match the MLX layout")
    rest_layers: list[dict[str, Any]] = []
    rest_view = memoryview(b"")
    rest_position = 0
    if layout["mlx"] == 2:
        rest_header, rest_position = parse(rest)
        rest_layers = list(rest_header["layers"])
        rest_view = memoryview(rest)
    total = sum(lengths)
    layers, chunks = [], []
    first = 0  # the layer's first array among the pieces' arrays
    for layer in layout["layers"]:
        if "rest" in layer:
            if not rest_layers:
                raise ValueError("an MLX state's rest has fewer layers than its layout")
            kept = rest_layers.pop(0)
            end = _skip(kept, rest_position)
            chunks.append(bytes(rest_view[rest_position:end]))
            rest_position = end
            layers.append(kept)
            continue
        count = len(layer["arrays"])
        arrays: list[dict[str, Any]] = []
        for index in range(first, first + count):
            data = np.concatenate(parts[index], axis=2).tobytes() if parts[index] else b""
            batch, heads, width = described[index]["shape"]
            arrays.append({"dtype": described[index]["dtype"], "shape": [batch, heads, total, width],
                           "bytes": len(data)})
            chunks.append(data)
        first += count
        name = layer.get("class", "KVCache")
        if name == "KVCache":
            items: list[dict[str, Any]] = [*arrays, {"value": total}]
        else:
            half = count // 2
            items = [{"list": arrays[:half]}, {"list": arrays[half:]}, {"value": total}, *layer.get("scalars", [])]
        layers.append({"class": name, "meta": layer.get("meta"), "items": items})
    if rest_layers or (layout["mlx"] == 2 and rest_position != len(rest_view)):
        raise ValueError("an MLX state's rest does not match its layout")
    return pack({"layers": layers, "tokens": total}, chunks)
