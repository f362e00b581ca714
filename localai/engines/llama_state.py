"""Carving llama.cpp's per-sequence state into token blocks, and assembling blocks back into a state.

``llama_state_seq_get_data`` writes: u32 magic, i32 source sequence, then one *module* per memory. An attention
KV module is u32 ``n_stream``, then per stream u32 ``cell_count`` and, when non-zero, the cells (i32 pos, u32 n_seq,
a 12-byte extension where the cache keeps one (M-RoPE's 2D position and the token: Qwen3.5), i32 seq ids), u32
``v_trans``, u32 ``n_layer``, each layer's K (i32 type, u64 row size, one row per cell), then each layer's V: rows
the same way, or, transposed (no flash attention), i32 type, u32 element size, u32 ``n_embd_v_gqa`` and per
embedding row one element per cell. A module whose cells are positions 0..n-1 can be cut by token range and
rebuilt from ranges; one with extensions (M-RoPE) carries each cell's position in its blocks too, since an image
gives many cells one position (the Qwen-VL family: positions rise but skip and repeat).

What cannot be cut by token comes last: a sliding-window cache (Gemma 3, gpt-oss) holds only the window, a recurrent
layer (Qwen3.5's Gated DeltaNet, Mamba-2) one state for the whole sequence. llama.cpp writes exactly that part alone
with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, and it is the end of the whole state, so the engine says how many bytes
of tail a state has, and the tail travels whole and opaque: a *checkpoint*, valid only at the token it was taken at.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAGIC = 0xAF143CD8
CELL_EXT = 12  # llama_kv_cell_ext: i32 x, i32 y (M-RoPE's 2D position), i32 token


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
    cell_ext: int = 0  # bytes of extension per cell (carried per token in the blocks)
    has_v: bool = True  # latent attention (DeepSeek's MLA, GLM-4.7-Flash) keeps K alone: no V section
    positions: bool = False  # each cell's position carried in the blocks (M-RoPE images), else 0..n-1

    def bytes_per_token(self) -> int:
        return 4 * self.positions + self.cell_ext + sum(layer.k_row + layer.v_row for layer in self.layers)


@dataclass
class Layout:
    """The shape of one engine configuration's states: the same for every state under one fingerprint. The
    modules are cut into blocks; ``tail`` says whether a state ends with a part that travels whole."""

    source_seq: int
    modules: list[Module]
    tail: bool = False

    def bytes_per_token(self) -> int:
        return sum(m.bytes_per_token() for m in self.modules)


@dataclass
class _Parsed:
    module: Module
    start: int  # where the module begins in the state
    end: int
    n_cells: int
    positions: np.ndarray
    ext: tuple[int, int] = (0, 0)  # (offset, bytes) of the cells' extensions, gathered per cell
    cells_at: int = 0
    k: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) of each layer's K rows
    v: list[tuple[int, int]] = field(default_factory=list)


def _parse(state: bytes | bytearray | memoryview, end: int, has_v: bool = True) -> tuple[int, list[_Parsed]]:
    """The header and the modules of ``state[:end]``, which must end exactly at ``end``."""
    if len(state) < 8 or end < 8 or end > len(state):
        raise StateFormatError("state too short")
    magic, source_seq = struct.unpack_from("<Ii", state, 0)
    if magic != MAGIC:
        raise StateFormatError(f"unknown state magic {magic:#x}")
    offset = 8
    parsed: list[_Parsed] = []
    while offset < end:
        item = _read_module(state, offset, end, has_v)
        parsed.append(item)
        offset = item.end
    return source_seq, parsed


def _read_cells(state: bytes | bytearray | memoryview, offset: int, cells: int,
                end: int) -> tuple[np.ndarray, int]:
    """The cells' (pos, n_seq, seq) and the extension size: a cache with extensions writes 12 more bytes per cell
    between n_seq and the seq id. Only the reading where every cell holds one sequence at positions 0..n-1 fits
    both ways (a misread puts x or y where n_seq is): that is the only kind of module that can be cut anyway."""
    for ext in (0, CELL_EXT):
        record = 12 + ext
        if offset + record * cells > end:
            continue
        meta = np.frombuffer(state, np.int32, count=record // 4 * cells, offset=offset).reshape(cells, record // 4)
        if (meta[:, 1] == 1).all() and (meta[:, -1] == meta[0, -1]).all():
            return meta[:, [0, 1, -1]], ext
    raise StateFormatError("cells shared by several sequences, or truncated")


def _read_module(state: bytes | bytearray | memoryview, offset: int, end: int | None = None,
                 has_v: bool = True) -> _Parsed:
    """One attention module starting at ``offset``: where its parts are, and where it ends."""
    end = len(state) if end is None else end
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
            meta, ext = _read_cells(state, offset, cells, end)
            cells_at = offset
            offset += (12 + ext) * cells
            v_trans, n_layer = struct.unpack_from("<II", state, offset)
            offset += 8
            if v_trans > 1 or n_layer > 4096:
                raise StateFormatError("not an attention module")
            module = Module(n_stream=n_stream, stream=stream, seq=int(meta[0, 2]), v_trans=bool(v_trans),
                            cell_ext=ext, has_v=has_v, positions=bool(ext))
            found = _Parsed(module, start, 0, cells, meta[:, 0].copy(), cells_at=cells_at)
            k_meta = []
            for _ in range(n_layer):
                k_type, k_row = struct.unpack_from("<iQ", state, offset)
                offset += 12
                found.k.append((offset, k_row * cells))
                k_meta.append((k_type, k_row))
                offset += k_row * cells
            for index in range(n_layer):
                if not has_v:
                    module.layers.append(Layer(*k_meta[index], -1, 0))
                    found.v.append((offset, 0))
                elif v_trans:
                    v_type, v_el, v_embd = struct.unpack_from("<iII", state, offset)
                    offset += 12
                    layer = Layer(*k_meta[index], v_type, v_el * v_embd, v_el, v_embd)
                else:
                    v_type, v_row = struct.unpack_from("<iQ", state, offset)
                    offset += 12
                    layer = Layer(*k_meta[index], v_type, v_row)
                if has_v:
                    found.v.append((offset, layer.v_row * cells))
                    offset += layer.v_row * cells
                    module.layers.append(layer)
    except struct.error as exc:
        raise StateFormatError(f"truncated state: {exc}") from exc
    if found is None:
        raise StateFormatError("a module without the sequence's cells")
    if offset > end:
        raise StateFormatError("truncated state")
    found.end = offset
    return found


def split(state: bytes | bytearray | memoryview, n_tokens: int, ranges: list[tuple[int, int]],
          tail: int = 0, *, has_v: bool = True) -> tuple[Layout, list[bytes], bytes]:
    """The layout, one payload per token range, and the state's last ``tail`` bytes whole (the part that cannot
    be cut: sliding-window or recurrent layers; the engine knows its size). ``has_v``: False for a latent-attention
    model, whose cache has no V (the engine knows it from the model).

    Raises ``StateFormatError`` when the state is not what this code knows (unknown magic, cells not 0..n-1, modules
    that do not end where the tail begins)."""
    if tail < 0 or tail > len(state) - 8:
        raise StateFormatError("the tail is larger than the state")
    end = len(state) - tail
    source_seq, parsed = _parse(state, end, has_v)
    layout = Layout(source_seq, [item.module for item in parsed], tail=bool(tail))
    pieces: list[list[bytes]] = [[] for _ in ranges]
    for item in parsed:
        module = item.module
        if item.n_cells != n_tokens:
            raise StateFormatError("the sequence's cells are not one per token")
        if module.positions:
            if n_tokens and (item.positions[0] < 0 or (np.diff(item.positions) < 0).any()):
                raise StateFormatError("the sequence's cells are not in position order")
            for out, (start, stop) in zip(pieces, ranges, strict=True):
                out.append(item.positions[start:stop].astype(np.int32).tobytes())
        elif not np.array_equal(item.positions, np.arange(n_tokens, dtype=np.int32)):
            raise StateFormatError("the sequence's cells are not positions 0..n-1")
        if module.cell_ext:
            record = (12 + module.cell_ext) // 4
            cells = np.frombuffer(state, np.int32, count=record * n_tokens, offset=item.cells_at
                                  ).reshape(n_tokens, record)
            ext_rows = np.ascontiguousarray(cells[:, 2:2 + module.cell_ext // 4])
            for out, (start, stop) in zip(pieces, ranges, strict=True):
                out.append(ext_rows[start:stop].tobytes())
        for layer, (k_at, k_len), (v_at, v_len) in zip(module.layers, item.k, item.v, strict=True):
            k_rows = np.frombuffer(state, np.uint8, count=k_len, offset=k_at).reshape(n_tokens, layer.k_row)
            if not module.has_v:
                pass
            elif layer.v_el:
                v_cols = np.frombuffer(state, np.uint8, count=v_len, offset=v_at).reshape(
                    layer.v_embd, n_tokens * layer.v_el)
            else:
                v_rows = np.frombuffer(state, np.uint8, count=v_len, offset=v_at).reshape(n_tokens, layer.v_row)
            for out, (start, stop) in zip(pieces, ranges, strict=True):
                out.append(k_rows[start:stop].tobytes())
                if not module.has_v:
                    continue
                if layer.v_el:
                    out.append(v_cols[:, start * layer.v_el:stop * layer.v_el].tobytes())
                else:
                    out.append(v_rows[start:stop].tobytes())
    return layout, [b"".join(parts) for parts in pieces], bytes(memoryview(state)[end:])


def join(layout: Layout, pieces: list[bytes], lengths: list[int], rest: bytes) -> bytearray:
    """A state holding ``sum(lengths)`` tokens from consecutive block payloads, ending with ``rest`` (the tail
    taken at that token); the inverse of ``split``. Raises ``StateFormatError`` when a payload has the wrong
    size or a tail is missing or unexpected."""
    n_tokens = sum(lengths)
    per_token = layout.bytes_per_token()
    for piece, length in zip(pieces, lengths, strict=True):
        if len(piece) != per_token * length:
            raise StateFormatError("a block's payload does not match the layout")
    if bool(rest) != layout.tail:
        raise StateFormatError("the snapshot does not match the layout")
    cursors = [0] * len(pieces)  # each piece holds, per module: its cells' extensions, then per layer K rows, V
    views = [memoryview(piece) for piece in pieces]  # rows are joined once, not copied out of each piece first
    out: list[Any] = [struct.pack("<Ii", MAGIC, layout.source_seq)]
    for module in layout.modules:
        where = []  # per piece: positions' offset, extension offset, then per layer (K offset, V offset)
        for index, length in enumerate(lengths):
            at = cursors[index]
            pos_at = at
            at += 4 * module.positions * length
            ext_at = at
            at += module.cell_ext * length
            spots = []
            for layer in module.layers:
                spots.append((at, at + layer.k_row * length))
                at += (layer.k_row + layer.v_row) * length
            cursors[index] = at
            where.append((pos_at, ext_at, spots))
        out.append(struct.pack("<I", module.n_stream))
        for stream in range(module.n_stream):
            if stream != module.stream:
                out.append(struct.pack("<I", 0))
                continue
            record = (12 + module.cell_ext) // 4
            cells = np.empty((n_tokens, record), np.int32)
            if module.positions:
                cells[:, 0] = np.concatenate(
                    [np.frombuffer(piece, np.int32, count=length, offset=pos_at)
                     for piece, length, (pos_at, _, _) in zip(pieces, lengths, where, strict=True)]
                    or [np.empty(0, np.int32)])
            else:
                cells[:, 0] = np.arange(n_tokens, dtype=np.int32)
            cells[:, 1] = 1
            cells[:, -1] = module.seq
            if module.cell_ext:
                width = module.cell_ext // 4
                cells[:, 2:2 + width] = np.concatenate(
                    [np.frombuffer(piece, np.int32, count=width * length, offset=ext_at).reshape(length, width)
                     for piece, length, (_, ext_at, _) in zip(pieces, lengths, where, strict=True)]
                    or [np.empty((0, width), np.int32)])
            out += [struct.pack("<I", n_tokens), cells.tobytes(),
                    struct.pack("<II", int(module.v_trans), len(module.layers))]
            for number, layer in enumerate(module.layers):
                out.append(struct.pack("<iQ", layer.k_type, layer.k_row))
                for view, length, (_, _, spots) in zip(views, lengths, where, strict=True):
                    k_at = spots[number][0]
                    out.append(view[k_at:k_at + layer.k_row * length])
            for number, layer in enumerate(module.layers if module.has_v else []):
                if layer.v_el:
                    out.append(struct.pack("<iII", layer.v_type, layer.v_el, layer.v_embd))
                    columns = [np.frombuffer(piece, np.uint8, count=layer.v_row * length, offset=spots[number][1])
                               .reshape(layer.v_embd, length * layer.v_el)
                               for piece, length, (_, _, spots) in zip(pieces, lengths, where, strict=True)]
                    if columns:
                        out.append(np.concatenate(columns, axis=1).reshape(-1))  # joined below without a copy
                else:
                    out.append(struct.pack("<iQ", layer.v_type, layer.v_row))
                    for view, length, (_, _, spots) in zip(views, lengths, where, strict=True):
                        v_at = spots[number][1]
                        out.append(view[v_at:v_at + layer.v_row * length])
    out.append(rest)
    return bytearray().join(out)  # writable: the engine loads it without another copy


def layout_to_json(layout: Layout) -> dict[str, Any]:
    return asdict(layout)


def layout_from_json(data: dict[str, Any]) -> Layout:
    """A layout as ``layout_to_json`` wrote it, or as caches before checkpoints did: a per-module ``sliced`` list
    whose unsliced modules (a sliding window) were always the last, which is the tail's shape."""
    modules = [Module(n_stream=m["n_stream"], stream=m["stream"], seq=m["seq"], v_trans=m["v_trans"],
                      layers=[Layer(**layer) for layer in m["layers"]], cell_ext=int(m.get("cell_ext", 0)),
                      has_v=bool(m.get("has_v", True)), positions=bool(m.get("positions", False)))
               for m in data["modules"]]
    if "sliced" in data:
        sliced = [bool(cut) for cut in data["sliced"]]
        if sliced != sorted(sliced, reverse=True):
            raise StateFormatError("a layout whose uncut modules are not its last")
        return Layout(data["source_seq"], [m for m, cut in zip(modules, sliced, strict=True) if cut],
                      tail=not all(sliced))
    return Layout(source_seq=data["source_seq"], modules=modules, tail=bool(data.get("tail")))
