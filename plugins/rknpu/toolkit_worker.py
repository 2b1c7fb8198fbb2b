"""The rknn-toolkit2 side of the simulator bridge: run as a script by the toolkit venv's python, it builds exported
ONNX graphs for the NPU and runs them in the toolkit's simulator, answering requests on stdin / stdout.

The toolkit pins torch <= 2.4 and numpy <= 1.26, so it cannot share flashnext's process; this file imports only the
standard library, numpy and `rknn.api`, and flashnext imports its framing (`send`, `receive`) for the other side.
A message is a JSON header and the arrays it counts, each part length-prefixed; arrays travel as .npy bytes, which
every numpy version reads. The simulator runs only a graph built in the same process (it cannot load a .rknn file),
so built graphs stay in memory for the worker's life, keyed by the caller's hash of the graph and its weights.
"""

import io
import json
import os
import struct
import sys
import time

import numpy as np

LENGTH = struct.Struct("<Q")


def send(stream, header: dict, arrays=()) -> None:
    parts = [json.dumps({**header, "arrays": len(arrays)}).encode()]
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
        parts.append(buffer.getvalue())
    for part in parts:
        stream.write(LENGTH.pack(len(part)))
        stream.write(part)
    stream.flush()


def _read(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the other side closed the pipe")
    return data


def _part(stream) -> bytes:
    return _read(stream, LENGTH.unpack(_read(stream, LENGTH.size))[0])


def receive(stream) -> tuple[dict, list]:
    header = json.loads(_part(stream))
    arrays = [np.load(io.BytesIO(_part(stream)), allow_pickle=False) for _ in range(header["arrays"])]
    return header, arrays


def build(onnx_path: str, target: str, export_to: str | None = None):
    """One graph built (fp16, do_quantization=False), written as `export_to` (a .rknn file) where given, and started
    in the simulator (init_runtime with no target). The toolkit reports failures by return code: each is checked
    and named."""
    from rknn.api import RKNN

    rknn = RKNN(verbose=False)
    steps = [
        ("config", lambda: rknn.config(target_platform=target)),
        ("load_onnx", lambda: rknn.load_onnx(model=onnx_path)),
        ("build", lambda: rknn.build(do_quantization=False)),
        ("export_rknn", lambda: rknn.export_rknn(export_to) if export_to else 0),
        ("init_runtime", lambda: rknn.init_runtime()),
    ]
    for name, call in steps:
        code = call()
        if code not in (0, None):
            rknn.release()
            raise RuntimeError(f"{name} returned {code} (its log says why)")
    return rknn


def serve(requests, replies) -> None:
    graphs = {}  # the caller's graph key -> built RKNN object in the simulator
    while True:
        try:
            header, arrays = receive(requests)
        except EOFError:
            break
        try:
            if header["op"] == "load":
                cached = header["key"] in graphs
                start = time.perf_counter()
                if not cached:
                    graphs[header["key"]] = build(header["onnx"], header["target"])
                send(replies, {"ok": True, "cached": cached, "build_s": round(time.perf_counter() - start, 2)})
            elif header["op"] == "run":
                outputs = graphs[header["key"]].inference(inputs=arrays, data_format=["nchw"] * len(arrays))
                if outputs is None:
                    raise RuntimeError("inference returned None (its log says why)")
                send(replies, {"ok": True}, outputs)
            else:
                raise RuntimeError(f"unknown request {header['op']!r}")
        except Exception as exc:  # the toolkit raises as well as returning codes; the caller names the graph
            send(replies, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for rknn in graphs.values():
        rknn.release()


def main() -> None:
    # The toolkit prints to stdout: the protocol gets its own copy of the pipe, and stdout goes to the log.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        from importlib.metadata import version

        toolkit = f"rknn-toolkit2 {version('rknn-toolkit2')}"
    except Exception:
        toolkit = "rknn-toolkit2 (version unknown)"
    import rknn.api  # noqa: F401  (fails here, before the greeting, when the venv lacks the toolkit)

    send(replies, {"ok": True, "toolkit": toolkit, "python": sys.executable})
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
