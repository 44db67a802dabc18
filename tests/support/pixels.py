"""Read the pixels of an 8-bit RGB/RGBA PNG (no imaging library in the project): enough to tell a
drawn chart from a blank one."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of raw pixel bytes) of a non-interlaced 8-bit RGB or RGBA PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"{path}: unsupported PNG layout {header}"
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left, up = line[i - bpp] if i >= bpp else 0, prev[i]
            corner = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def count_color(path: Path, rgb: tuple[int, int, int], tolerance: int = 24) -> int:
    """Pixels of ``path`` within ``tolerance`` of ``rgb`` on every channel (opaque ones only)."""
    width, _, rows = png_pixels(path)
    bpp = len(rows[0]) // width
    hits = 0
    for row in rows:
        for x in range(0, len(row), bpp):
            if (bpp == 3 or row[x + 3] > 128) and all(abs(row[x + c] - rgb[c]) <= tolerance for c in range(3)):
                hits += 1
    return hits
