"""Small real files for the media tests, written here: PNGs, a WAV, and PDFs (with text, images only, cut short,
encrypted, a decompression bomb). PDFs are laid out by hand (objects, then the cross-reference table), so each
file is exactly what a test says it is."""

from __future__ import annotations

import base64
import io
import struct
import zlib


def png(width: int = 2, height: int = 2, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A real PNG of one colour."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgb) * width
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(row * height)) + chunk(b"IEND", b""))


def wav(samples: int = 800, rate: int = 8000) -> bytes:
    """A real WAV: a tenth of a second of silence, 16-bit mono."""
    data = b"\x00\x00" * samples
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
                                                                                     rate * 2, 2, 16)
            + b"data" + struct.pack("<I", len(data)) + data)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{b64(data)}"


def _stream(content: bytes, extra: bytes = b"", compress: bool = False) -> bytes:
    if compress:
        content = zlib.compress(content, 9)
        extra += b" /Filter /FlateDecode"
    return b"<< /Length %d%s >>\nstream\n" % (len(content), extra) + content + b"\nendstream"


def _document(pages: list[tuple[bytes, bytes]], extra: list[bytes] | None = None) -> bytes:
    """A PDF of pages, each (content stream object, resources dictionary), then ``extra`` objects; objects are
    numbered in that order (the catalog 1, the page tree 2, each page and its content next)."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b""]
    kids = []
    for content, resources in pages:
        page_number = len(objects) + 1
        kids.append(b"%d 0 R" % page_number)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R /Resources %s >>"
                       % (page_number + 1, resources))
        objects.append(content)
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(kids), len(kids))
    objects.extend(extra or [])
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.writelines(b"%010d 00000 n \n" % offset for offset in offsets)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


FONT = b"<< /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >>"


def pdf_with_text(*pages: str) -> bytes:
    """A PDF whose pages say ``pages`` (ASCII, one line each) in Helvetica."""
    def escaped(text: str) -> bytes:
        return text.encode("ascii").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")

    return _document([(_stream(b"BT /F1 12 Tf 72 712 Td (%s) Tj ET" % escaped(text)), FONT) for text in pages])


def image_only_pdf() -> bytes:
    """A PDF whose one page shows an image (a 2x2 RGB bitmap, object 5) and has no text: a scan, as far as text
    goes."""
    image = _stream(bytes([10, 200, 30] * 4), b" /Type /XObject /Subtype /Image /Width 2 /Height 2 "
                    b"/ColorSpace /DeviceRGB /BitsPerComponent 8")
    content = _stream(b"q 200 0 0 200 72 500 cm /Im1 Do Q")
    return _document([(content, b"<< /XObject << /Im1 5 0 R >> >>")], [image])


def encrypted_pdf(password: str = "secret") -> bytes:
    """``pdf_with_text`` encrypted with a user password (RC4, which pypdf writes without extra packages)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_with_text("Top secret plans."))))
    writer.encrypt(user_password=password, owner_password=password + "-owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def pdf_bomb(megabytes: int = 400) -> bytes:
    """A small PDF whose one content stream inflates to ``megabytes`` of text operators (a decompression bomb)."""
    line = b"BT /F1 12 Tf 72 712 Td (bomb) Tj ET\n"
    content = line * (megabytes * (1 << 20) // len(line))
    return _document([(_stream(content, compress=True), FONT)])


def large_pdf(megabytes: int) -> bytes:
    """A PDF of ``megabytes`` and a little more: one page of text, and an unused stream of random bytes."""
    import os

    return _document([(_stream(b"BT /F1 12 Tf 72 712 Td (Large document.) Tj ET"), FONT)],
                     [_stream(os.urandom(megabytes << 20))])
