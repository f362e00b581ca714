"""Carving llama.cpp's per-sequence state into token blocks, and assembling blocks back into a state.

``llama_state_seq_get_data`` writes: u32 magic, i32 source sequence, then one *module* per KV cache (one for a
plain model; base then sliding-window for an iSWA model such as Gemma 3). A module is u32 ``n_stream``, then per
stream u32 ``cell_count`` and, when non-zero, the cells (i32 pos, u32 n_seq, i32 seq ids), u32 ``v_trans``, u32
``n_layer``, each layer's K (i32 type, u64 row size, one row per cell), then each layer's V: rows the same way,
or, transposed (no flash attention), i32 type, u32 element size, u32 ``n_embd_v_gqa`` and per embedding row one
element per cell. A module whose cells are positions 0..n-1 can be cut by token range and rebuilt from ranges;
a sliding-window module cannot (it holds only the window), so it travels whole, as a boundary snapshot.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAGIC = 0xAF143CD8


class StateFormatError(ValueError):
    """A state this code does not understand: the cache then keeps whole snapshots instead of blocks."""


@dataclass
class Layer:
    k_type: int
    k_row: int
    v_type: int
    v_row: int  # bytes per cell (transposed: element size x n_embd)
    v_el: int = 0  # transposed V only
    v_embd: int = 0


@dataclass
class Module:
    n_stream: int
    stream: int  # the stream holding the sequence's cells
    seq: int  # the seq id written in each cell
    v_trans: bool
    layers: list[Layer] = field(default_factory=list)

    def bytes_per_token(self) -> int:
        return sum(layer.k_row + layer.v_row for layer in self.layers)


@dataclass
class Layout:
    """The shape of one engine configuration's states: the same for every state under one fingerprint."""

    source_seq: int
    modules: list[Module]
    sliced: list[bool]  # per module: carved into blocks (else carried whole in the snapshot)

    def bytes_per_token(self) -> int:
        return sum(m.bytes_per_token() for m, cut in zip(self.modules, self.sliced, strict=True) if cut)


@dataclass
class _Parsed:
    module: Module
    start: int  # where the module begins in the state
    end: int
    n_cells: int
    positions: np.ndarray
    k: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) of each layer's K rows
    v: list[tuple[int, int]] = field(default_factory=list)


def _parse(state: bytes | bytearray | memoryview) -> tuple[int, list[_Parsed]]:
    if len(state) < 8:
        raise StateFormatError("state too short")
    magic, source_seq = struct.unpack_from("<Ii", state, 0)
    if magic != MAGIC:
        raise StateFormatError(f"unknown state magic {magic:#x}")
    offset = 8
    parsed: list[_Parsed] = []
    while offset < len(state):
        item = _read_module(state, offset)
        parsed.append(item)
        offset = item.end
    return source_seq, parsed


def _read_module(state: bytes | bytearray | memoryview, offset: int) -> _Parsed:
    """One module starting at ``offset``: where its parts are, and where it ends."""
    start = offset
    try:
        (n_stream,) = struct.unpack_from("<I", state, offset)
        offset += 4
        found: _Parsed | None = None
        for stream in range(n_stream):
            (cells,) = struct.unpack_from("<I", state, offset)
            offset += 4
            if not cells:
                continue
            if found is not None:
                raise StateFormatError("a sequence spread over two streams")
            if offset + 12 * cells > len(state):
                raise StateFormatError("truncated cells")
            meta = np.frombuffer(state, np.int32, count=3 * cells, offset=offset).reshape(cells, 3)
            if not (meta[:, 1] == 1).all():
                raise StateFormatError("cells shared by several sequences")
            offset += 12 * cells
            v_trans, n_layer = struct.unpack_from("<II", state, offset)
            offset += 8
            module = Module(n_stream=n_stream, stream=stream, seq=int(meta[0, 2]), v_trans=bool(v_trans))
            found = _Parsed(module, start, 0, cells, meta[:, 0].copy())
            k_meta = []
            for _ in range(n_layer):
                k_type, k_row = struct.unpack_from("<iQ", state, offset)
                offset += 12
                found.k.append((offset, k_row * cells))
                k_meta.append((k_type, k_row))
                offset += k_row * cells
            for index in range(n_layer):
                if v_trans:
                    v_type, v_el, v_embd = struct.unpack_from("<iII", state, offset)
                    offset += 12
                    layer = Layer(*k_meta[index], v_type, v_el * v_embd, v_el, v_embd)
                else:
                    v_type, v_row = struct.unpack_from("<iQ", state, offset)
                    offset += 12
                    layer = Layer(*k_meta[index], v_type, v_row)
                found.v.append((offset, layer.v_row * cells))
                offset += layer.v_row * cells
                module.layers.append(layer)
    except struct.error as exc:
        raise StateFormatError(f"truncated state: {exc}") from exc
    if found is None:
        raise StateFormatError("a module without the sequence's cells")
    if offset > len(state):
        raise StateFormatError("truncated state")
    found.end = offset
    return found


def split(state: bytes | bytearray | memoryview, n_tokens: int, ranges: list[tuple[int, int]],
          keep_whole: set[int] | None = None) -> tuple[Layout, list[bytes], bytes]:
    """The layout, one payload per token range (sliceable modules only) and the unsliceable modules whole.

    ``keep_whole``: module indexes never sliced (a sliding-window cache). Raises ``StateFormatError`` when the
    state is not what this code knows (cells not 0..n-1 in a module that should be sliced, unknown magic)."""
    source_seq, parsed = _parse(state)
    keep_whole = keep_whole or set()
    sliced = [index not in keep_whole for index in range(len(parsed))]
    layout = Layout(source_seq, [item.module for item in parsed], sliced)
    pieces: list[list[bytes]] = [[] for _ in ranges]
    rest = bytearray()
    buffer = memoryview(state)
    for index, item in enumerate(parsed):
        if not sliced[index]:
            rest += buffer[item.start:item.end]
            continue
        if item.n_cells != n_tokens or not np.array_equal(item.positions, np.arange(n_tokens, dtype=np.int32)):
            raise StateFormatError("the sequence's cells are not positions 0..n-1")
        for layer, (k_at, k_len), (v_at, v_len) in zip(item.module.layers, item.k, item.v, strict=True):
            k_rows = np.frombuffer(state, np.uint8, count=k_len, offset=k_at).reshape(n_tokens, layer.k_row)
            if layer.v_el:
                v_cols = np.frombuffer(state, np.uint8, count=v_len, offset=v_at).reshape(
                    layer.v_embd, n_tokens * layer.v_el)
            else:
                v_rows = np.frombuffer(state, np.uint8, count=v_len, offset=v_at).reshape(n_tokens, layer.v_row)
            for out, (start, end) in zip(pieces, ranges, strict=True):
                out.append(k_rows[start:end].tobytes())
                if layer.v_el:
                    out.append(v_cols[:, start * layer.v_el:end * layer.v_el].tobytes())
                else:
                    out.append(v_rows[start:end].tobytes())
    return layout, [b"".join(parts) for parts in pieces], bytes(rest)


def join(layout: Layout, pieces: list[bytes], lengths: list[int], rest: bytes) -> bytearray:
    """A state holding ``sum(lengths)`` tokens from consecutive block payloads (and the whole modules in
    ``rest``); the inverse of ``split``. Raises ``StateFormatError`` when a payload has the wrong size."""
    n_tokens = sum(lengths)
    per_token = layout.bytes_per_token()
    for piece, length in zip(pieces, lengths, strict=True):
        if len(piece) != per_token * length:
            raise StateFormatError("a block's payload does not match the layout")
    cursors = [0] * len(pieces)  # each piece holds, per sliced module and layer, K rows then V
    views = [memoryview(piece) for piece in pieces]  # rows are joined once, not copied out of each piece first
    out: list[Any] = [struct.pack("<Ii", MAGIC, layout.source_seq)]
    rest_at = 0
    for module, cut in zip(layout.modules, layout.sliced, strict=True):
        if not cut:
            end = _read_module(rest, rest_at).end
            out.append(rest[rest_at:end])
            rest_at = end
            continue
        where = []  # per piece, per layer: (K offset, V offset)
        for index, length in enumerate(lengths):
            at, spots = cursors[index], []
            for layer in module.layers:
                spots.append((at, at + layer.k_row * length))
                at += (layer.k_row + layer.v_row) * length
            cursors[index] = at
            where.append(spots)
        out.append(struct.pack("<I", module.n_stream))
        for stream in range(module.n_stream):
            if stream != module.stream:
                out.append(struct.pack("<I", 0))
                continue
            cells = np.empty((n_tokens, 3), np.int32)
            cells[:, 0] = np.arange(n_tokens, dtype=np.int32)
            cells[:, 1] = 1
            cells[:, 2] = module.seq
            out += [struct.pack("<I", n_tokens), cells.tobytes(),
                    struct.pack("<II", int(module.v_trans), len(module.layers))]
            for number, layer in enumerate(module.layers):
                out.append(struct.pack("<iQ", layer.k_type, layer.k_row))
                for view, length, spots in zip(views, lengths, where, strict=True):
                    k_at = spots[number][0]
                    out.append(view[k_at:k_at + layer.k_row * length])
            for number, layer in enumerate(module.layers):
                if layer.v_el:
                    out.append(struct.pack("<iII", layer.v_type, layer.v_el, layer.v_embd))
                    columns = [np.frombuffer(piece, np.uint8, count=layer.v_row * length, offset=spots[number][1])
                               .reshape(layer.v_embd, length * layer.v_el)
                               for piece, length, spots in zip(pieces, lengths, where, strict=True)]
                    if columns:
                        out.append(np.concatenate(columns, axis=1).reshape(-1))  # joined below without a copy
                else:
                    out.append(struct.pack("<iQ", layer.v_type, layer.v_row))
                    for view, length, spots in zip(views, lengths, where, strict=True):
                        v_at = spots[number][1]
                        out.append(view[v_at:v_at + layer.v_row * length])
    if rest_at != len(rest):
        raise StateFormatError("the snapshot does not match the layout")
    return bytearray().join(out)  # writable: the engine loads it without another copy


def layout_to_json(layout: Layout) -> dict[str, Any]:
    return asdict(layout)


def layout_from_json(data: dict[str, Any]) -> Layout:
    modules = [Module(n_stream=m["n_stream"], stream=m["stream"], seq=m["seq"], v_trans=m["v_trans"],
                      layers=[Layer(**layer) for layer in m["layers"]]) for m in data["modules"]]
    return Layout(source_seq=data["source_seq"], modules=modules, sliced=list(data["sliced"]))
