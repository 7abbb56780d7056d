"""TensorBoard event files written by longctx.train.tfevents: the bytes TensorBoard's own protobufs produce (the
expected hex strings were serialized by tensorboardX 2.6.5's ``event_pb2``), the CRC-32C of TFRecord frames, and a
file cut short read up to its last whole record."""

from longctx.train import tfevents as T


def test_events_serialize_as_tensorboards_protobufs_do():
    assert T.encode_event(wall_time=1764252000.25, step=3, file_version="brain.Event:2").hex() == \
        "0900001058164ada4110031a0d627261696e2e4576656e743a32"
    assert T.encode_event(wall_time=1.5, step=7, session_status=T.SESSION_START).hex() == \
        "09000000000000f83f10073a020801"
    assert T.encode_event(wall_time=2.0, step=123456789, scalars={"train/loss": 1.25}).hex() == \
        "09000000000000004010959aef3a2a130a110a0a747261696e2f6c6f7373150000a03f"


def test_crc32c_check_values():
    assert T.crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert T.masked_crc32c(b"123456789") == 0xC78AB0E5  # tensorboardX's masked_crc32c of the same bytes


def test_decode_inverts_encode_and_a_cut_file_keeps_its_whole_records():
    events = [dict(wall_time=0.5, step=1, file_version="brain.Event:2"),
              dict(wall_time=1.0, step=2, session_status=T.SESSION_START),
              dict(wall_time=1.5, step=2**40, scalars={"a": 0.25, "valid/b": -3.0})]
    raw = b"".join(T.frame(T.encode_event(**e)) for e in events)
    got = [T.decode_event(r) for r in T.records(raw)]
    assert got[0] == events[0] and got[1] == events[1]
    assert got[2] == dict(wall_time=1.5, step=2**40, scalars=[("a", 0.25), ("valid/b", -3.0)])
    assert len(list(T.records(raw[:-3]))) == 2  # the last record cut short
    damaged = bytearray(raw)
    damaged[-6] ^= 1  # a flipped bit in the last record's data
    assert len(list(T.records(bytes(damaged)))) == 2
