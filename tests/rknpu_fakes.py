"""Stand-ins for the rknpu tests: rknn-toolkit-lite2's `rknnlite.api` with its real API (return codes, None on
error) running the .onnx a fake .rknn file names, and a converted copy of an exported folder."""

import json
import shutil
import types
from pathlib import Path

import numpy as np

CHUNK, CONTEXT = 16, 128


class FakeRKNNLite:
    NPU_CORE_AUTO, NPU_CORE_0, NPU_CORE_1, NPU_CORE_2 = 0, 1, 2, 4
    NPU_CORE_0_1, NPU_CORE_0_1_2, NPU_CORE_ALL = 3, 7, 0xFFFF
    log: list = []  # (call, argument) of every instance
    fail: set = set()  # calls that report failure: "load_rknn" / "init_runtime" -> -1, "inference" -> None

    def __init__(self, verbose=False, verbose_file=None):
        self.session = None

    def load_rknn(self, path):
        self.log.append(("load_rknn", path))
        if "load_rknn" in self.fail or not Path(path).is_file():
            return -1
        self.onnx = Path(path).parent / Path(path).read_text().strip()
        return 0

    def init_runtime(self, core_mask=NPU_CORE_AUTO):
        self.log.append(("init_runtime", core_mask))
        if "init_runtime" in self.fail or core_mask not in (0, 1, 2, 4, 3, 7, 0xFFFF):
            return -1
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(self.onnx), providers=["CPUExecutionProvider"])
        return 0

    def inference(self, inputs=None, data_type=None, data_format=None, inputs_pass_through=None, get_frame_id=False):
        self.log.append(("inference", len(inputs or [])))
        if "inference" in self.fail or self.session is None:
            return None
        if data_format != ["nchw"] * len(inputs):  # the real runtime would transpose 4-D inputs taken as NHWC
            return None
        names = [i.name for i in self.session.get_inputs()]
        if len(inputs) != len(names):
            return None
        return self.session.run(None, {n: np.asarray(x) for n, x in zip(names, inputs)})

    def release(self):
        self.log.append(("release", None))
        self.session = None


def fake_rknnlite():
    """A fresh module object shaped like `rknnlite.api`."""
    FakeRKNNLite.log, FakeRKNNLite.fail = [], set()
    return types.SimpleNamespace(RKNNLite=FakeRKNNLite)


def converted_copy(folder: Path, dest: Path) -> Path:
    """The exported folder as the converter leaves it: a .rknn file a graph, named in manifest.json (here each
    .rknn names its .onnx for the fake runtime to run)."""
    shutil.copytree(folder, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    for name, graph in manifest["graphs"].items():
        (dest / f"{name}.rknn").write_text(graph["onnx"])
        graph["rknn"] = f"{name}.rknn"
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest
