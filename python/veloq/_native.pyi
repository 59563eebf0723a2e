"""Type stubs of veloq's extension module (re-exported by ``veloq``)."""

from os import PathLike
from typing import Any, Callable, Iterator, Literal, Optional, Protocol, Sequence, TypeVar, Union, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import TypedDict, Unpack

__version__: str
__all__ = [
    "__version__", "VeloqError", "ModelError", "MethodError", "CalibrationError", "DeviceError",
    "ContextOverflowError", "ShapeError", "ConfigError", "OutOfMemoryError", "Model", "Generation",
    "Chat", "Result", "Calibration", "KvCache", "Server", "serve", "calibrate", "methods",
]

class VeloqError(Exception): ...
class ModelError(VeloqError): ...
class MethodError(VeloqError): ...
class CalibrationError(VeloqError): ...
class DeviceError(VeloqError): ...
class ContextOverflowError(VeloqError): ...
class ShapeError(VeloqError): ...
class ConfigError(VeloqError): ...
class OutOfMemoryError(VeloqError): ...

_Path = Union[str, PathLike]

class _CudaArray(Protocol):
    """A CUDA array of any framework (a torch CUDA tensor, CuPy): float32 or float16 (bfloat16
    too for torch tensors, read through their own attributes), C-contiguous."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

_Out = TypeVar("_Out", bound=_CudaArray)

class _Sampling(TypedDict, total=False):
    """The sampling keywords of ``Model.generate`` and ``Chat.say`` (greedy by default)."""
    max_tokens: int  # 128 for generate, 256 for say
    temperature: float  # 0: greedy
    top_p: Optional[float]
    top_k: Optional[int]
    min_p: Optional[float]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: Optional[int]

def methods(head_dim: int = 64) -> list[tuple[str, str]]:
    """The method names veloq knows, each with what it stores and at how many bits per element."""

@final
class Result:
    """What a generation produced."""
    text: str
    tokens: list[int]
    finish_reason: str  # "stop", "length", "context"
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    kv_resident_bytes: int
    kv_fp16_bytes: int
    @property
    def decode_tok_s(self) -> float: ...

@final
class Generation(Iterator[str]):
    """A streaming generation: iterate it for the text's pieces; ``result`` once exhausted."""
    def __iter__(self) -> "Generation": ...
    def __next__(self) -> str: ...
    @property
    def result(self) -> Optional[Result]: ...
    @property
    def tokens(self) -> list[int]: ...

@final
class Chat:
    """A conversation whose history stays in the cache."""
    def say(
        self, message: str, *, on_text: Optional[Callable[[str], object]] = None, **sampling: Unpack[_Sampling]
    ) -> Result: ...
    def reset(self) -> None: ...
    @property
    def history(self) -> list[int]: ...
    @property
    def kv_resident_bytes(self) -> int: ...

@final
class Model:
    """A GGUF model opened with the caches of one method."""
    @staticmethod
    def open(
        path: _Path,
        method: str = "vq-4",
        calibration: Optional[_Path] = None,
        device: str = "cpu",
        max_context: int = 8192,
        kernels: str = "auto",
        weights: str = "stored",
    ) -> "Model": ...
    @property
    def method(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def max_context(self) -> int: ...
    def info(self) -> dict[str, Union[int, float, str]]: ...
    def tokenize(self, text: str) -> list[int]: ...
    def detokenize(self, ids: Sequence[int]) -> str: ...
    def generate(
        self, prompt: str, *, chat: bool = True, stream: bool = False, **sampling: Unpack[_Sampling]
    ) -> Union[str, Generation]: ...
    def chat(self) -> Chat: ...

def calibrate(
    model: _Path,
    text: Union[str, PathLike],
    *,
    method: str = "vq-4",
    tokens: int = 8192,
    window: int = 8192,
    seed: int = 0,
    value_weights: Literal["uniform", "attention"] = "uniform",
    out: Optional[_Path] = None,
    progress: Optional[Callable[[str, int, int], object]] = None,
) -> str:
    """Trains a VecInfer method's codebooks on the model's keys and values over ``text``."""

@final
class Server:
    """A running OpenAI-compatible server; a context manager that stops it on exit."""
    url: str
    model: str
    @property
    def running(self) -> bool: ...
    def stop(self) -> None: ...
    def __enter__(self) -> "Server": ...
    def __exit__(self, *args: object) -> bool: ...

def serve(
    model: Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    name: Optional[str] = None,
    kv_budget: Union[int, str, None] = None,
    max_seqs: Optional[int] = None,
    reserve: Optional[str] = None,
    prefix_cache: bool = True,
    default_max_tokens: Optional[int] = None,
    log: bool = False,
) -> Server: ...

@final
class Calibration:
    """A VecInfer calibration: every layer's key and value codecs."""
    @staticmethod
    def load(path: _Path) -> "Calibration": ...
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def method(self) -> str: ...
    def bits_per_element(self, tokens: int = 4096) -> float: ...
    @staticmethod
    def train(
        keys: Sequence[npt.NDArray[np.float32]],
        values: Sequence[npt.NDArray[np.float32]],
        *,
        method: str = "vq-4",
        name: str = "python",
        architecture: str = "python",
        token_ids: Optional[Sequence[int]] = None,
        seed: int = 0,
        progress: Optional[Callable[[int, int], object]] = None,
    ) -> "Calibration": ...
    def save(self, path: _Path) -> None: ...
    def quantize(self, layer: int, side: str, x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]: ...
    def dequantize(self, layer: int, side: str, codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]: ...

@final
class KvCache:
    """veloq's KV cache for a model veloq does not run: codes per layer, attended by veloq's kernels
    on the CPU (NumPy arrays) or a CUDA device (CUDA arrays, written into ``out`` on ``stream``)."""
    def __new__(
        cls,
        method: str = "vq-4",
        *,
        q_heads: int,
        calibration: Union[Calibration, _Path, None] = None,
        layers: Optional[int] = None,
        kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        windows: Optional[Sequence[Optional[int]]] = None,
        max_context: int = 8192,
        batch: int = 1,
        kernels: str = "auto",
        device: str = "cpu",
        threads: Optional[int] = None,
    ) -> "KvCache": ...
    @overload
    def attend(
        self,
        layer: int,
        q: npt.NDArray[np.float32],
        k: npt.NDArray[np.float32],
        v: npt.NDArray[np.float32],
        scale: Optional[float] = None,
        *,
        out: None = None,
        stream: Optional[int] = None,
        heads_first: bool = False,
    ) -> npt.NDArray[np.float32]: ...
    @overload
    def attend(
        self,
        layer: int,
        q: _CudaArray,
        k: _CudaArray,
        v: _CudaArray,
        scale: Optional[float] = None,
        *,
        out: _Out,
        stream: Optional[int] = None,
        heads_first: bool = False,
    ) -> _Out: ...
    def append(
        self,
        layer: int,
        k: Union[npt.NDArray[np.float32], _CudaArray],
        v: Union[npt.NDArray[np.float32], _CudaArray],
        *,
        stream: Optional[int] = None,
        heads_first: bool = False,
        skip: Optional[Sequence[int]] = None,
    ) -> None: ...
    def length(self, layer: int = 0, seq: int = 0) -> int: ...
    def truncate(self, length: int = 0, *, layer: Optional[int] = None, seq: Optional[int] = None) -> None: ...
    @property
    def resident_bytes(self) -> int: ...
    @property
    def method(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def layers(self) -> int: ...
