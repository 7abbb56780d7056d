"""TensorBoard event files without a TensorBoard package: the few protobuf messages a scalar log needs, and the
TFRecord framing around them.

An event file is a sequence of records ``len (uint64 LE) | masked crc32c(len) | data | masked crc32c(data)``,
each ``data`` one serialized ``tensorflow.Event``. Of its fields the trainer writes ``wall_time`` (1, double),
``step`` (2, int64), ``file_version`` (3, string), ``summary`` (5: repeated ``value`` (1) of ``tag`` (1,
string) and ``simple_value`` (2, float)) and ``session_log`` (7: ``status`` (1, enum; START = 1)); the reader
skips every other field. (tensorboardX's protobufs did this before; importing them imported torch where it was
installed, seconds at every start.)"""

from __future__ import annotations

import struct

SESSION_START = 1


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ----------------------------------------------------------------------------------------- protobuf wire format
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: negative values as their 64-bit two's complement
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(*, wall_time: float, step: int, file_version: str | None = None,
                 scalars: dict[str, float] | None = None, session_status: int | None = None) -> bytes:
    """One serialized ``Event``: its time and step and one of a file version, a summary of scalars, or a session
    log status."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars is not None:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", v))
                          for tag, v in scalars.items())
        out += _bytes_field(5, values)
    if session_status is not None:
        out += _bytes_field(7, _key(1, 0) + _varint(session_status))
    return out


def _fields(data: bytes):
    """(field number, wire type, value) of one message: ints for varints, bytes for the rest."""
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, at = _read_varint(data, at)
        elif wire == 1:
            val, at = data[at:at + 8], at + 8
        elif wire == 5:
            val, at = data[at:at + 4], at + 4
        elif wire == 2:
            n, at = _read_varint(data, at)
            val, at = data[at:at + n], at + n
        else:
            raise ValueError(f"protobuf wire type {wire} (groups) is not used by event files")
        yield field, wire, val


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[at]
        at += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, at


def decode_event(data: bytes) -> dict:
    """``{'wall_time', 'step', 'file_version'?, 'scalars'?: [(tag, value)], 'session_status'?}`` of one
    serialized ``Event``; a summary value that is not a scalar is left out."""
    ev: dict = {"wall_time": 0.0, "step": 0}
    for field, wire, val in _fields(data):
        if field == 1 and wire == 1:
            ev["wall_time"] = struct.unpack("<d", val)[0]
        elif field == 2 and wire == 0:
            ev["step"] = val - (1 << 64) if val >= 1 << 63 else val
        elif field == 3 and wire == 2:
            ev["file_version"] = val.decode()
        elif field == 5 and wire == 2:
            scalars = ev.setdefault("scalars", [])
            for f, w, value in _fields(val):
                if f != 1 or w != 2:
                    continue
                tag, simple = None, None
                for vf, vw, x in _fields(value):
                    if vf == 1 and vw == 2:
                        tag = x.decode()
                    elif vf == 2 and vw == 5:
                        simple = struct.unpack("<f", x)[0]
                if tag is not None and simple is not None:
                    scalars.append((tag, simple))
        elif field == 7 and wire == 2:
            ev["session_status"] = next((x for f, w, x in _fields(val) if f == 1 and w == 0), 0)
    return ev


def frame(data: bytes) -> bytes:
    """One TFRecord: the length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def records(raw: bytes):
    """The data of each whole record of a TFRecord file's bytes; stops at a record cut short or damaged (as
    TensorBoard waits for the rest of it)."""
    at = 0
    while at + 12 <= len(raw):
        header = raw[at:at + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", raw[at + 8:at + 12])[0] != masked_crc32c(header) or at + 16 + n > len(raw):
            return
        body = raw[at + 12:at + 12 + n]
        if struct.unpack("<I", raw[at + 12 + n:at + 16 + n])[0] != masked_crc32c(body):
            return
        yield body
        at += 16 + n
