"""The Tinker SDK's protobuf messages (`tinker.proto.tinker_public_pb2`, SDK 0.38): a `forward_backward`
request in, `ForwardBackwardOutput` and `SampleResponse` out (the two results the SDK accepts only as
protobuf).

Owns the byte layouts: tokens are int32, dense tensors their dtype's bytes, a per-datum output field one
`BatchedTensor` (the datums' bytes end to end, `offsets` the byte offset of each datum's start plus the end).
Every malformed input is a `UserError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PROTO_TYPE = "application/x-protobuf"


class UserError(ValueError):
    """A request the caller must fix (the SDK's `RequestFailedError` with category `user`)."""


def pb():
    """The SDK's generated module (the `tinker` extra)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    tokens: list[int]  # the model input, chunks joined
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs, dense


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    config: dict[str, float | str]


def _dense(name: str, msg) -> np.ndarray:
    p = pb()
    dtypes = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype} (float32 or int64)")
    dtype = np.dtype(dtypes[msg.dtype])
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise UserError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise UserError(f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor of shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense
    if len(msg.dense) % dtype.itemsize:
        raise UserError(f"loss_fn_inputs[{name!r}]: {len(msg.dense)} bytes is not a whole number of {dtype}")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {arr.size} values")
        arr = arr.reshape(shape)
    return arr


def parse_forward_backward(body: bytes) -> ForwardBackwardRequest:
    """A `ForwardBackwardRequest` from the SDK's protobuf body (zstd already undone)."""
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # NOTE: protobuf's DecodeError
        raise UserError(
            f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})"
        ) from None
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") not in (None, "encoded_text"):
                raise UserError(
                    f"data[{i}]: only encoded_text chunks are supported, got {chunk.WhichOneof('chunk')}"
                )
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        data.append(Datum(tokens, {k: _dense(k, v) for k, v in d.loss_fn_inputs.items()}))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return ForwardBackwardRequest(msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only, data, config)


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` bytes: one `ArrayRecord` whose fields are per-datum 1-D float32 arrays."""
    p = pb()
    out = p.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    for name in per_datum[0] if per_datum else {}:
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32).reshape(-1) for d in per_datum]
        bt = record.fields[name]
        bt.dtype = p.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    return out.SerializeToString()


def _topk(msg, ids: np.ndarray, logprobs: np.ndarray) -> None:
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def sample_response(
    sequences: list[Sequence],
    prompt_logprobs: list[float] | None = None,
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """`SampleResponse` bytes. `prompt_logprobs`: one per prompt token (the first is NaN: no context; the SDK
    reads NaN as None); `topk_prompt`: (ids, logprobs) `[len(prompt), k]`."""
    p = pb()
    out = p.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = p.STOP_REASON_LENGTH if s.stop_reason == "length" else p.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        _topk(out.topk_prompt_logprobs, *topk_prompt)
    return out.SerializeToString()
