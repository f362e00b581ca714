"""Images through a vision projector (an mmproj GGUF), with llama.cpp's multimodal library (mtmd) beside a loaded
llama.cpp model.

The daemon renders an image into the prompt as a mark naming its sha256 (``protocol.image_mark``) and sends the
bytes with the request; the worker keeps them by digest while an op that carries them is in flight, and recent
ones under a byte bound. Tokenizing a prompt with marks goes through ``mtmd_tokenize``: text pieces become the
model's tokens, and each image becomes the positions mtmd says it takes (with the model's own begin/end tokens
around them), written into the token list as pseudo-tokens above any vocabulary, derived from the image's digest
and the position within it. So the serving loop, the prefix reuse and the prompt cache work on token lists as
ever: the same image in a later turn is the same tokens (its positions are reused from the cache), a different
image at the same place is different tokens (recomputed).

Decoding a batch that holds image positions: the image's embeddings come from the projector (encoded once per
image, kept while it is recent) and are decoded through an embedding batch, with causal attention off where the
model wants it (Gemma 3: such an image is evaluated in one pass, ``span_end``); the text around them goes through
llama.cpp as usual, in position order.

The Qwen-VL family (Qwen3-VL, Qwen3.5/3.6: ``mrope``) gives an image of ``rows x columns`` embeddings only
``max(rows, columns)`` positions, each embedding four position components (time, row, column, unused). The token
list keeps one pseudo-token per embedding; the engine maps a token's index to its position (``Spans``) and an
image's embeddings take their components from the start position and the offsets mtmd reports.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp.llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np

from localai.engines.engine import BatchItem, DecodeFailed
from localai.protocol import IMAGE_MARK, IMAGE_MARK_START

log = logging.getLogger("localai.engine")
PSEUDO_BASE = 1 << 30  # pseudo-token ids of image positions: above every vocabulary, below int32's limit
PSEUDO_SPAN = (1 << 31) - 1 - PSEUDO_BASE
# bytes (encoded files and embeddings) of images no op in flight carries that a worker keeps by digest, for a
# later turn's cache restore; an op's own images stay however many it sends, until its final frame
KEEP_IMAGE_BYTES = 256 << 20
CHUNK_TEXT, CHUNK_IMAGE = 0, 1
_LOG_CALLBACK: Any = None


def pseudo_token(digest: str, position: int) -> int:
    """The token standing for position ``position`` of the image with this sha256: the same image always gives the
    same ids; two images share one id with probability 2**-30 (and a whole image with that to the power of its
    length)."""
    value = hashlib.sha256(f"{digest}:{position}".encode()).digest()
    return PSEUDO_BASE + int.from_bytes(value[:4], "little") % PSEUDO_SPAN


@dataclass
class Image:
    """A recent image: its bytes, and once tokenized, mtmd's chunk (to encode) and then its embeddings."""

    data: bytes
    chunk: Any = None  # an mtmd_input_chunk copy, owned here
    embeddings: np.ndarray[Any, np.dtype[np.float32]] | None = None
    non_causal: bool = False
    tokens: set[int] = field(default_factory=set)  # its pseudo-tokens, forgotten with it
    n_tokens: int = 0  # its embeddings (one pseudo-token each)
    n_pos: int = 0  # the positions it advances a sequence by (fewer than its embeddings under M-RoPE)
    offsets: np.ndarray[Any, np.dtype[np.int32]] | None = None  # M-RoPE: each embedding's (time, row, column) offset

    @property
    def size(self) -> int:
        return len(self.data) + (self.embeddings.nbytes if self.embeddings is not None else 0)


class Spans:
    """Where each sequence's M-RoPE images lie, as (first token index, embeddings, positions) in index order: a
    token's position is its index less what the images before it saved (an image of 16 embeddings in a 4x4 grid
    takes 4 positions); every embedding of an image shares its start position's time component."""

    def __init__(self) -> None:
        self.by_seq: dict[int, list[tuple[int, int, int]]] = {}

    def position(self, seq: int, index: int) -> int:
        shift = 0
        for start, count, n_pos in self.by_seq.get(seq, ()):
            if index < start:
                break
            if index < start + count:
                return start - shift  # inside an image: its start position
            shift += count - n_pos
        return index - shift

    def inside(self, seq: int, index: int) -> bool:
        """Whether ``index`` falls after an image's first embedding and before its end."""
        return any(start < index < start + count for start, count, _ in self.by_seq.get(seq, ()))

    def begin(self, seq: int, start: int, count: int, n_pos: int) -> None:
        spans = [span for span in self.by_seq.get(seq, ()) if span[0] < start]
        self.by_seq[seq] = [*spans, (start, count, n_pos)]

    def cut(self, seq: int, n_tokens: int) -> None:
        self.by_seq[seq] = [span for span in self.by_seq.get(seq, ()) if span[0] < n_tokens]


class Vision:
    """An mtmd context beside a loaded model: tokenizes prompts with image marks and decodes image positions."""

    def __init__(self, model: Any, projector_path: str, n_threads: int, *, use_gpu: bool,
                 debug: bool = False) -> None:
        global _LOG_CALLBACK
        if _LOG_CALLBACK is None:  # mtmd logs through its own hook: quiet unless debugging, as llama.cpp's
            def callback(level: int, text: bytes, _user: Any) -> None:
                if debug and text:
                    log.debug("mtmd: %s", text.decode(errors="replace").rstrip())
            _LOG_CALLBACK = L.llama_log_callback(callback)
            M.mtmd_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            M.mtmd_helper_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        self.mctx = M.mtmd_init_from_file(projector_path.encode(), model, params)
        if not self.mctx:
            raise RuntimeError(f"llama.cpp's mtmd could not load the vision projector {projector_path} beside this "
                               "model (a projector made for another model, or of a type this llama.cpp does not know)")
        if not M.mtmd_support_vision(self.mctx):
            self.close()
            raise RuntimeError(f"{projector_path} is not a vision projector (it has no vision encoder)")
        self.mrope = bool(M.mtmd_decode_use_mrope(self.mctx))
        self.ctx: Any = None  # the engine's context, set once it exists (``probe`` runs before)
        # what an embedding row holds: the model's width, times 1 + its deepstack layers (Qwen3-VL)
        self.n_embd = int(L.llama_model_n_embd_inp(model))
        self.marker = M.mtmd_default_marker()
        self.images: OrderedDict[str, Image] = OrderedDict()
        self.pseudo: dict[int, tuple[str, int]] = {}  # pseudo-token -> (image digest, embedding in the image)
        self.held: dict[str, list[str]] = {}  # op id -> the digests it carries, kept until the op ends
        self.keep_bytes = KEEP_IMAGE_BYTES
        self.in_seq: dict[int, dict[int, str]] = {}  # seq -> {first token index: digest} of images its state holds
        self.spans = Spans()  # M-RoPE only
        self.encoded = 0  # images the projector encoded (one whose positions came from the cache is not)

    def close(self) -> None:
        for image in self.images.values():
            if image.chunk is not None:
                M.mtmd_input_chunk_free(image.chunk)
        self.images.clear()
        if self.mctx:
            M.mtmd_free(self.mctx)
            self.mctx = None

    def probe(self) -> tuple[bool, int]:
        """Whether this projector's images are attended non-causally, and how many embeddings a 64x64 image takes
        (Gemma 3's fixed count: the context's batch must hold one such image whole)."""
        pixels = (ctypes.c_uint8 * (64 * 64 * 3))()
        bitmap = M.mtmd_bitmap_init(64, 64, pixels)
        chunks = M.mtmd_input_chunks_init()
        try:
            spec = M.mtmd_input_text()
            spec.text = self.marker
            spec.text_len = len(self.marker)
            spec.add_special = False
            spec.parse_special = True
            array = (ctypes.c_void_p * 1)(bitmap)
            if M.mtmd_tokenize(self.mctx, chunks, ctypes.byref(spec), array, 1) != 0:
                return False, 0
            for index in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, index)
                if M.mtmd_input_chunk_get_type(chunk) == CHUNK_IMAGE:
                    return (bool(M.mtmd_decode_use_non_causal(self.mctx, chunk)),
                            int(M.mtmd_input_chunk_get_n_tokens(chunk)))
            return False, 0
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    # -- images ----------------------------------------------------------------------------------

    def hold(self, op_id: str, digests: list[str]) -> None:
        """Keep the images op ``op_id`` carries until ``release``: none is forgotten while its op may still
        tokenize or decode it (a request with more images than the bound, or queued behind others that have)."""
        self.held.setdefault(op_id, []).extend(digests)

    def release(self, op_id: str) -> None:
        """Op ``op_id`` ended (its final frame is out): its images become recent ones, forgotten oldest first."""
        if self.held.pop(op_id, None) is not None:
            self._forget_over_bound()

    def remember(self, media: dict[str, str]) -> None:
        """Keep the images a request sent (base64 by sha256 digest) for its prompt's marks."""
        for digest, data in media.items():
            if digest in self.images:
                self.images.move_to_end(digest)
                continue
            raw = base64.b64decode(data)
            if hashlib.sha256(raw).hexdigest() != digest:
                raise ValueError(f"image {digest[:16]}: its bytes do not match its digest")
            self.images[digest] = Image(raw)
        self._forget_over_bound()

    def _forget_over_bound(self) -> None:
        """Forget the oldest images no op in flight holds while those exceed ``keep_bytes``."""
        held = {digest for digests in self.held.values() for digest in digests}
        held.update(digest for images in self.in_seq.values() for digest in images.values())
        free = [(digest, image) for digest, image in self.images.items() if digest not in held]
        total = sum(image.size for _, image in free)
        for digest, old in free:
            if total <= self.keep_bytes:
                break
            total -= old.size
            del self.images[digest]
            if old.chunk is not None:
                M.mtmd_input_chunk_free(old.chunk)
            for token in old.tokens:
                self.pseudo.pop(token, None)

    def decoded(self, batch: list[BatchItem]) -> None:
        """Note the images whose positions a batch (by token index) puts into its sequences: kept while a sequence
        holds them, whatever the bound."""
        for item in batch:
            found = self.pseudo.get(item.token) if item.token >= PSEUDO_BASE else None
            if found is not None:
                self.in_seq.setdefault(item.seq, {})[item.pos - found[1]] = found[0]

    def seq_cut(self, seq: int, n_tokens: int) -> None:
        """A sequence now holds its first ``n_tokens`` tokens: the images past them may be forgotten."""
        images = self.in_seq.get(seq, {})
        self.in_seq[seq] = {start: digest for start, digest in images.items() if start < n_tokens}
        if len(self.in_seq[seq]) < len(images):
            self._forget_over_bound()

    def seq_holds(self, seq: int, tokens: list[int]) -> None:
        """A sequence's state was replaced by one holding ``tokens`` (restored from the cache)."""
        images = {}
        for index, token in enumerate(tokens):
            found = self.pseudo.get(token) if token >= PSEUDO_BASE else None
            if found is not None and found[1] == 0:
                images[index] = found[0]
        self.in_seq[seq] = images
        self._forget_over_bound()

    @staticmethod
    def marked(text: str) -> bool:
        return IMAGE_MARK_START in text

    # -- tokenizing ------------------------------------------------------------------------------

    def tokenize(self, text: str, bos_id: int) -> list[int]:
        """A prompt with image marks as tokens: text through mtmd (special tokens parsed, BOS as the model wants),
        each image as its pseudo-tokens."""
        pieces = IMAGE_MARK.split(text)  # text, digest, text, digest, ..., text
        marker = self.marker.decode()
        texts = [piece.replace(marker, marker[:-1] + "\u200b" + marker[-1:]) for piece in pieces[0::2]]
        digests = pieces[1::2]
        missing = [digest for digest in digests if digest not in self.images]
        if missing:
            raise ValueError(f"image {missing[0][:16]} is not known to this worker (send its bytes with the request)")
        prompt = marker.join(texts).encode()
        bitmaps = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for digest in digests:
                data = self.images[digest].data
                buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = M.mtmd_helper_bitmap_init_from_buf(self.mctx, buffer, len(data), False)
                if not bitmap:
                    raise ValueError(f"image {digest[:16]} could not be decoded (PNG, JPEG, GIF, BMP are read)")
                M.mtmd_bitmap_set_id(bitmap, digest.encode())
                bitmaps.append(bitmap)
            spec = M.mtmd_input_text()
            spec.text = prompt
            spec.text_len = len(prompt)
            spec.add_special = True
            spec.parse_special = True
            array = (ctypes.c_void_p * max(1, len(bitmaps)))(*bitmaps)
            status = M.mtmd_tokenize(self.mctx, chunks, ctypes.byref(spec), array, len(bitmaps))
            if status != 0:
                raise ValueError(f"mtmd could not tokenize the prompt with its images (status {status})")
            return self._tokens(chunks, bos_id)
        finally:
            M.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                M.mtmd_bitmap_free(bitmap)

    def _tokens(self, chunks: Any, bos_id: int) -> list[int]:
        tokens: list[int] = []
        for index in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, index)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == CHUNK_TEXT:
                count = ctypes.c_size_t(0)
                pointer = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens.extend(int(pointer[i]) for i in range(count.value))
            elif kind == CHUNK_IMAGE:
                digest = (M.mtmd_input_chunk_get_id(chunk) or b"").decode()
                image = self.images[digest]
                n_embd_tokens = int(M.mtmd_input_chunk_get_n_tokens(chunk))
                if image.chunk is None:
                    image.chunk = M.mtmd_input_chunk_copy(chunk)
                    image.non_causal = bool(M.mtmd_decode_use_non_causal(self.mctx, chunk))
                    image.n_tokens = n_embd_tokens
                    image.n_pos = int(M.mtmd_input_chunk_get_n_pos(chunk))
                    if self.mrope:
                        image.offsets = self._offsets(chunk, n_embd_tokens)
                    elif image.n_pos != n_embd_tokens:
                        raise ValueError("this projector's images take fewer positions than embeddings without "
                                         "M-RoPE: not supported")
                for index_in_image in range(n_embd_tokens):
                    token = pseudo_token(digest, index_in_image)
                    self.pseudo[token] = (digest, index_in_image)
                    image.tokens.add(token)
                    tokens.append(token)
            else:
                raise ValueError("audio is not supported through the projector")
        if len(tokens) > 1 and tokens[0] == tokens[1] == bos_id:
            tokens = tokens[1:]  # the template already wrote BOS
        return tokens

    @staticmethod
    def _offsets(chunk: Any, count: int) -> np.ndarray[Any, np.dtype[np.int32]]:
        """Each embedding's (time, row, column) position less the image's start, as mtmd places them."""
        image_tokens = M.mtmd_input_chunk_get_tokens_image(chunk)
        offsets = np.empty((count, 3), np.int32)
        for index in range(count):
            pos = M.mtmd_image_tokens_get_decoder_pos(image_tokens, 0, index)
            offsets[index] = (pos.t, pos.y, pos.x)
        return offsets

    def image_of(self, token: int) -> tuple[Image, int] | None:
        """The image a pseudo-token stands in, and the embedding it is; None for a token of no known image."""
        found = self.pseudo.get(token)
        if found is None or found[0] not in self.images:
            return None
        return self.images[found[0]], found[1]

    def track(self, seq: int, tokens: list[int]) -> bool:
        """Learn where a sequence's images lie from the tokens it now holds (a restored or copied state); False
        when one of them is not known here."""
        spans = []
        for index, token in enumerate(tokens):
            if token >= PSEUDO_BASE:
                found = self.image_of(token)
                if found is None:
                    return False
                image, embedding = found
                if embedding == 0:
                    spans.append((index, image.n_tokens, image.n_pos))
        self.spans.by_seq[seq] = spans
        return True

    def positioned(self, batch: list[BatchItem]) -> list[BatchItem]:
        """The batch with M-RoPE positions for its token indices: text at its position, an image's embeddings at
        the image's start position (``_decode_run`` adds each one's offsets)."""
        out = []
        for item in batch:
            index = item.pos
            if item.token >= PSEUDO_BASE:
                found = self.image_of(item.token)
                if found is None:
                    raise DecodeFailed("an image was forgotten before it was evaluated")
                image, embedding = found
                if embedding == 0:
                    self.spans.begin(item.seq, index, image.n_tokens, image.n_pos)
                index -= embedding
            out.append(item._replace(pos=self.spans.position(item.seq, index)))
        return out

    def span_end(self, tokens: list[int], index: int) -> tuple[int, int] | None:
        """The image attended non-causally (evaluated in one pass) that ``index`` falls strictly inside, as its
        (first, end) token indices; None elsewhere."""
        if not 0 < index < len(tokens) or tokens[index] < PSEUDO_BASE:
            return None
        found = self.image_of(tokens[index])
        if found is None or not found[0].non_causal or found[1] == 0:
            return None
        image, embedding = found
        start = index - embedding
        return start, start + image.n_tokens

    # -- decoding --------------------------------------------------------------------------------

    @staticmethod
    def holds_images(batch: list[BatchItem]) -> bool:
        return any(item.token >= PSEUDO_BASE for item in batch)

    def decode(self, batch: list[BatchItem], decode_text: Callable[[list[BatchItem]], None]) -> dict[int, int]:
        """Evaluate a batch holding image positions: each sequence's items up to its last image position go first,
        run by run in position order (text through ``decode_text``, images as embeddings); then every remaining
        text item in one last call. Returns where each logits row of ``batch`` is in that last call."""
        last_image: dict[int, int] = {}
        for index, item in enumerate(batch):
            if item.token >= PSEUDO_BASE:
                last_image[item.seq] = index
        early = [item for index, item in enumerate(batch) if index <= last_image.get(item.seq, -1)]
        if any(item.logits for item in early):
            raise DecodeFailed("an image position cannot end a prompt")
        run: list[BatchItem] = []
        for item in early:
            if run and (run[-1].token >= PSEUDO_BASE) != (item.token >= PSEUDO_BASE):
                self._decode_run(run, decode_text)
                run = []
            run.append(item)
        if run:
            self._decode_run(run, decode_text)
        rows: dict[int, int] = {}
        rest: list[BatchItem] = []
        for index, item in enumerate(batch):
            if index > last_image.get(item.seq, -1):
                rows[index] = len(rest)
                rest.append(item)
        if rest:
            decode_text(rest)
        return rows

    def _decode_run(self, run: list[BatchItem], decode_text: Callable[[list[BatchItem]], None]) -> None:
        if run[0].token < PSEUDO_BASE:
            decode_text(run)
            return
        count = len(run)
        native = L.llama_batch_init(count, self.n_embd, 1)
        own_pos = ctypes.cast(native.pos, ctypes.c_void_p).value or 0  # an address: a read field aliases the struct
        # M-RoPE: four components per embedding, section-major (all times, all rows, all columns, all zeros), in
        # an array of ours while the batch is decoded (llama_batch_init allocated one per embedding)
        sections = np.zeros((4, count), np.int32) if self.mrope else None
        try:
            rows = np.ctypeslib.as_array(native.embd, shape=(count * self.n_embd,)).reshape(count, self.n_embd)
            non_causal = False
            for index, item in enumerate(run):
                digest, embedding = self.pseudo[item.token]
                image = self._encoded(digest)
                non_causal = non_causal or image.non_causal
                assert image.embeddings is not None
                rows[index] = image.embeddings[embedding]
                if sections is not None:
                    assert image.offsets is not None  # item.pos is the image's start position here
                    sections[:3, index] = item.pos + image.offsets[embedding]
                else:
                    native.pos[index] = item.pos
                native.n_seq_id[index] = 1
                native.seq_id[index][0] = item.seq
                native.logits[index] = 0
            native.n_tokens = count
            if sections is not None:
                native.pos = sections.ctypes.data_as(ctypes.POINTER(L.llama_pos))
            if non_causal:
                L.llama_set_causal_attn(self.ctx, False)
            try:
                status = L.llama_decode(self.ctx, native)
            finally:
                if non_causal:
                    L.llama_set_causal_attn(self.ctx, True)
        finally:
            native.pos = ctypes.cast(own_pos, ctypes.POINTER(L.llama_pos))  # freed with the batch
            L.llama_batch_free(native)
        if status != 0:
            raise DecodeFailed(f"llama_decode failed on an image's positions with status {status}", no_room=status == 1)

    def _encoded(self, digest: str) -> Image:
        """The image with its embeddings (encoded by the projector on first use)."""
        image = self.images.get(digest)
        if image is None or image.chunk is None:
            raise DecodeFailed(f"image {digest[:16]} was forgotten before it was evaluated")
        if image.embeddings is None:
            if M.mtmd_encode_chunk(self.mctx, image.chunk) != 0:
                raise DecodeFailed(f"the projector could not encode image {digest[:16]}")
            self.encoded += 1
            count = int(M.mtmd_input_chunk_get_n_tokens(image.chunk))
            pointer = M.mtmd_get_output_embd(self.mctx)
            image.embeddings = np.ctypeslib.as_array(pointer, shape=(count * self.n_embd,)).reshape(
                count, self.n_embd).copy()
        return image
