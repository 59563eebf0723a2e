"""veloq: a compressed KV cache for LLM inference.

Three lines to run a GGUF model with its cache stored as 4-bit VecInfer codes::

    import veloq
    model = veloq.Model.open("smollm2-135m-instruct.q4_1.gguf")      # method "vq-4"
    print(model.generate("Why is the sky blue?", max_tokens=64))

``veloq.calibrate`` makes the codebooks a VecInfer method needs, ``Model.chat`` keeps a
conversation in the cache, ``veloq.serve`` starts the OpenAI-compatible server in this process,
``Calibration`` and ``KvCache`` expose the codec and the cache over NumPy arrays, and
``veloq.transformers`` gives Hugging Face transformers models a compressed cache.
"""

import time as _time

from ._native import (
    CalibrationError,
    Calibration,
    Chat,
    ConfigError,
    ContextOverflowError,
    DeviceError,
    Generation,
    KvCache,
    MethodError,
    Model,
    ModelError,
    OutOfMemoryError,
    Result,
    Server,
    ShapeError,
    VeloqError,
    __version__,
    calibrate,
    methods,
    serve,
)

__all__ = [
    "Calibration",
    "CalibrationError",
    "Chat",
    "ConfigError",
    "ContextOverflowError",
    "DeviceError",
    "Generation",
    "KvCache",
    "MethodError",
    "Model",
    "ModelError",
    "OutOfMemoryError",
    "Result",
    "Server",
    "ShapeError",
    "VeloqError",
    "__version__",
    "calibrate",
    "methods",
    "serve",
    "serve_forever",
]


def serve_forever(model, **options):
    """Runs ``veloq.serve(model, **options)`` until Ctrl-C, then stops it (requests in flight finish)."""
    server = serve(model, **options)
    print(f"veloq: serving {server.model} at {server.url}/v1 (Ctrl-C stops)", flush=True)
    try:
        while server.running:
            _time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
