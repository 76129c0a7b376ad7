"""PDFs written byte by byte (no PDF library in the tests): a tiny one that reads, and the
pieces the hostile ones of tests/serving/http/test_pdf_bounds.py are made of."""

from __future__ import annotations

import zlib

HELVETICA = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def shown(text: str) -> bytes:
    """Content-stream operators that show `text` in the font `/F1`."""
    return f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET\n".encode()


def stream(content: bytes, *, compress: bool = False) -> bytes:
    """A stream object of `content`, deflated if `compress` (as most PDFs' are)."""
    if compress:
        content = zlib.compress(content, 9)
        return b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (
            len(content),
            content,
        )
    return b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content)


def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of `objects`, numbered from 1 (the first is the catalog), with a correct
    cross-reference table."""
    header = b"%PDF-1.4\n"
    parts, offsets, size = [header], [], len(header)
    for number, body in enumerate(objects, 1):
        offsets.append(size)
        parts.append(b"%d 0 obj\n%s\nendobj\n" % (number, body))
        size += len(parts[-1])
    parts.append(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    parts.extend(b"%010d 00000 n \n" % offset for offset in offsets)
    parts.append(
        b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, size)
    )
    return b"".join(parts)


def pages_pdf(
    pages: int, content: bytes, *, compress: bool = False, count: int | None = None
) -> bytes:
    """A PDF of `pages` pages that all show one content stream, `content`; its page tree
    declares `count` pages (default: `pages`)."""
    kids = b" ".join(b"%d 0 R" % (5 + page) for page in range(pages))
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
        b"/Resources << /Font << /F1 4 0 R >> >> >>"
    )
    return pdf_file(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages if count is None else count),
            stream(content, compress=compress),
            HELVETICA,
            *[page] * pages,
        ]
    )


def tiny_pdf(text: str) -> bytes:
    """A one-page PDF showing `text` (Helvetica)."""
    return pages_pdf(1, shown(text))
