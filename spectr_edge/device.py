"""Where a model's KV cache lives, and the few operations speculation does on it there.

Every model call binds its cache as ONNX Runtime OrtValues on the model's device (I/O binding),
for every provider: the cache never crosses to the host; only the logits (and the guess head's
ids) do, through `fetch`, which counts the bytes.

The operations a step needs on a cache are gathers along one axis: rolling back rejected tokens
(keep positions 0..n-1), keeping the surviving candidate row, repeating a row for k candidates,
moving an accepted tree path to contiguous positions. Two implementations:

    HostDevice    the CPU: device memory is host memory, the OrtValues share NumPy arrays and the
                  gathers are NumPy indexing (in place where the layout allows)
    GraphDevice   a GPU (CUDA; TensorRT runs the models, CUDA these): each gather is one small
                  ONNX Runtime graph (one Gather node per cache tensor) run on the device itself,
                  so nothing is copied to the host. It runs on the CPU too, which is how the
                  tests check it on machines without a GPU.

The gather graph is written here as ONNX protobuf bytes (a few fields of ModelProto), so the
runtime needs no `onnx` package.
"""

from __future__ import annotations

import numpy as np

from .errors import ProviderError

_ELEM_TYPES = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(np.int64): 7}


def onnxruntime():
    """The onnxruntime module (imported when first needed, so `import spectr_edge` works without one)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ProviderError("ONNX Runtime is not installed; pip install 'spectr-edge[cpu]' (or 'spectr-edge[gpu]' "
                            "for CUDA and TensorRT)") from None
    return ort


class Transfers:
    """Bytes and calls copied from a device to the host (what the CUDA path would move over PCIe)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0


class HostDevice:
    """Caches in host memory: each tensor is a NumPy array, bound to ONNX Runtime as an OrtValue that
    shares its memory (no copy); gathers are NumPy indexing."""

    kind = "cpu"
    device_id = 0

    def __init__(self):
        self.transfers = Transfers()

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def bind(binding, name: str, tensor: np.ndarray, output: bool = False) -> None:
        """Bind a cache tensor by its address (no copy, and no OrtValue to build per call)."""
        if not tensor.flags.c_contiguous:
            raise ValueError(f"cache tensor {name} is not contiguous")
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cpu", 0, tensor.dtype, list(tensor.shape), tensor.ctypes.data)

    @staticmethod
    def to_host(tensor: np.ndarray) -> np.ndarray:
        return tensor

    @staticmethod
    def from_host(array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    @staticmethod
    def shape(tensor: np.ndarray) -> tuple:
        return tensor.shape

    def take(self, tensors: list, index: np.ndarray, axis: int) -> list:
        """New tensors: each tensor's entries at `index` along `axis` (np.take); one leading row is a
        view (a leading-axis slice stays contiguous)."""
        if axis == 0 and len(index) == 1:
            row = int(index[0])
            return [t[row:row + 1] for t in tensors]
        return [np.take(t, index, axis=axis) for t in tensors]

    def move(self, tensors: list, dst: np.ndarray, src: np.ndarray) -> list:
        """Positions src copied to positions dst along axis 2, in place (src is read first)."""
        for t in tensors:
            t[:, :, dst] = t[:, :, src]
        return tensors

    def fetch(self, value) -> np.ndarray:
        array = value.numpy()
        self.transfers.bytes += array.nbytes
        self.transfers.calls += 1
        return array


class GraphDevice:
    """Caches in a device's memory as OrtValues; each gather is one small ONNX Runtime graph on that
    device."""

    def __init__(self, kind: str = "cuda", device_id: int = 0, providers: list | None = None):
        self.kind, self.device_id = kind, device_id
        self.providers = providers or (["CUDAExecutionProvider"] if kind == "cuda" else ["CPUExecutionProvider"])
        self.transfers = Transfers()
        self._sessions: dict[tuple, object] = {}

    def zeros(self, shape, dtype) :
        if self.kind == "cpu":
            return onnxruntime().OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))
        value = onnxruntime().OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.kind, self.device_id)
        value.update_inplace(np.zeros(shape, dtype=dtype))   # once per allocation, never per step
        return value

    def empty(self, shape, dtype) :
        if self.kind == "cpu":
            return onnxruntime().OrtValue.ortvalue_from_numpy(np.empty(shape, dtype=dtype))
        return onnxruntime().OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.kind, self.device_id)

    @staticmethod
    def bind(binding, name: str, tensor, output: bool = False) -> None:
        (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, tensor)

    @staticmethod
    def to_host(tensor) -> np.ndarray:
        return tensor.numpy()

    def from_host(self, array: np.ndarray) :
        return onnxruntime().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.kind, self.device_id)

    @staticmethod
    def shape(tensor) -> tuple:
        return tuple(tensor.shape())

    def _session(self, count: int, dtype, axis: int) :
        key = (count, np.dtype(dtype), axis)
        if key not in self._sessions:
            ort = onnxruntime()
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            self._sessions[key] = ort.InferenceSession(gather_model(count, np.dtype(dtype), axis), opts,
                                                       providers=self.providers)
        return self._sessions[key]

    def take(self, tensors: list, index: np.ndarray, axis: int) -> list:
        if not tensors:
            return []
        session = self._session(len(tensors), _numpy_dtype(tensors[0].data_type()), axis)
        binding = session.io_binding()
        for i, t in enumerate(tensors):
            binding.bind_ortvalue_input(f"x{i}", t)
        binding.bind_cpu_input("index", np.ascontiguousarray(index, dtype=np.int64))   # a few ids, host -> device
        for i in range(len(tensors)):
            binding.bind_output(f"y{i}", self.kind, self.device_id)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def move(self, tensors: list, dst: np.ndarray, src: np.ndarray) -> list:
        """Positions src copied to dst along axis 2: a gather of the whole length into new tensors."""
        index = np.arange(self.shape(tensors[0])[2], dtype=np.int64)
        index[dst] = src
        return self.take(tensors, index, axis=2)

    def fetch(self, value) -> np.ndarray:
        array = value.numpy()
        self.transfers.bytes += array.nbytes
        self.transfers.calls += 1
        return array


def _numpy_dtype(ort_type: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}[ort_type]


# -- the gather graph as ONNX protobuf bytes ------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, value) -> bytes:
    """One protobuf field: an int as a varint, bytes/str length-delimited."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _tensor_info(name: str, elem_type: int, rank: int) -> bytes:
    """ValueInfoProto: a tensor of `rank` symbolic dimensions."""
    shape = b"".join(_field(1, _field(2, f"{name}_d{i}")) for i in range(rank))       # Dimension.dim_param
    tensor = _field(1, elem_type) + _field(2, shape)                                   # TypeProto.Tensor
    return _field(1, name) + _field(2, _field(1, tensor))                              # name, TypeProto


def gather_model(count: int, dtype, axis: int, rank: int = 4) -> bytes:
    """ModelProto bytes: y_i = Gather(x_i, index, axis) for i < count; x_i of `dtype`, index int64 [m]."""
    elem = _ELEM_TYPES[np.dtype(dtype)]
    nodes = b"".join(
        _field(1, _field(1, f"x{i}") + _field(1, "index") + _field(2, f"y{i}") + _field(3, f"gather{i}")
               + _field(4, "Gather") + _field(5, _field(1, "axis") + _field(3, axis) + _field(20, 2)))
        for i in range(count))
    inputs = b"".join(_field(11, _tensor_info(f"x{i}", elem, rank)) for i in range(count))
    inputs += _field(11, _tensor_info("index", 7, 1))
    outputs = b"".join(_field(12, _tensor_info(f"y{i}", elem, rank)) for i in range(count))
    graph = nodes + _field(2, "cache_gather") + inputs + outputs
    return _field(1, 8) + _field(2, "spectr-edge") + _field(7, graph) + _field(8, _field(1, "") + _field(2, 13))


def device_for(provider: str, providers: list) -> HostDevice | GraphDevice:
    """The device of a model run by `provider` (our spelling: cpu, cuda, tensorrt)."""
    if provider == "cpu":
        return HostDevice()
    return GraphDevice("cuda", 0, [p for p in providers if p != "TensorrtExecutionProvider"])
