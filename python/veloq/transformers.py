"""A compressed KV cache for Hugging Face transformers models.

``VeloqCache`` is a transformers ``Cache`` whose layers live in veloq (VecInfer codes, or a
baseline's), and ``attn_implementation="veloq"`` is an attention function that attends over them
with veloq's kernels — fp16 keys are never rebuilt::

    import veloq.transformers as vt                      # registers attn_implementation="veloq"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="veloq")
    cal = vt.calibrate(model, tokenizer, text)           # once per model: the codebooks
    out = model.generate(ids, past_key_values=vt.VeloqCache(model, cal), max_new_tokens=64)

The attention function takes the step's queries, keys and values from the model, hands the keys
and values to the cache's layer (where they become codes once they leave the recent window) and
returns attention over everything the layer holds. A prompt's first chunk attends only to itself,
exactly whatever the cache stores, so torch's SDPA computes it and veloq only stores its keys and
values. A forward pass without a ``VeloqCache`` (no cache, or another cache) runs SDPA throughout.

On CUDA (a veloq built with the ``cuda`` feature) the cache lives on the model's GPU: the step's
tensors are handed to veloq's kernels by device address, in the model's dtype (float16,
bfloat16 or float32: veloq converts in the copy that reads them), and the work is ordered on
torch's current stream — nothing goes through the host.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
import weakref
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import _native
from ._native import Calibration, ConfigError, DeviceError, KvCache, ShapeError

__all__ = ["VeloqCache", "calibrate", "geometry", "kv_bytes"]

# The layer whose `update` ran last on this thread: transformers calls the attention function
# right after the cache's update for the same layer, and passes it no handle to the cache.
_current = threading.local()


def geometry(model) -> dict:
    """The cache geometry of a transformers model: layers, heads, kv heads, head dim, per-layer windows."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    window = getattr(cfg, "sliding_window", None)
    windows = [window if t == "sliding_attention" and window else None for t in types]
    return {
        "layers": layers,
        "q_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "windows": windows,
        "name": getattr(cfg, "_name_or_path", "") or cfg.model_type,
        "architecture": cfg.model_type,
    }


class VeloqLayer(CacheLayerMixin):
    """One decoder layer's slot in a ``VeloqCache``: the storage is veloq's; this object is what
    transformers' cache API talks to."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: "VeloqCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_sliding = owner.windows[index] is not None
        # A full-attention layer holds every position (rows or codes) and a cut leaves it as growth
        # to that length would; a sliding layer has forgotten what left its window.
        self.is_croppable = not self.is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner._ensure(key_states)
        _current.layer = self
        # The attention function stores them (it needs the queries too, to attend in one call).
        return key_states, value_states

    def get_seq_length(self) -> int:
        # Positions in transformers' sense: a left-padded sequence's pads count (veloq holds none).
        return self.owner.native.length(self.index) + self.owner._pads[0] if self.owner.native is not None else 0

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_context

    def reset(self) -> None:
        self.owner.reset()

    def offload(self):
        raise NotImplementedError("a VeloqCache keeps its layers in veloq's memory; there is nothing to offload")

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        """Takes back each sequence's last ``-tokens_to_remove`` positions (speculative decoding's
        rejected drafts); a positive argument, as older transformers releases pass it, is the
        length to keep."""
        if tokens_to_remove == 0 or self.owner.native is None:
            return
        if self.is_sliding:
            raise NotImplementedError("a sliding-window layer cannot take positions back: they have left its window")
        native, pads = self.owner.native, self.owner._pads
        for s in range(self.owner._batch):
            held = native.length(self.index, s)
            keep = held + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove - pads[s]
            native.truncate(max(keep, 0), layer=self.index, seq=s)

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("VeloqCache does not reorder sequences (beam search); use greedy or sampling")


class VeloqCache(Cache):
    """A KV cache kept by veloq for a transformers model.

    ``calibration`` is a ``veloq.Calibration`` or the path of one (``calibrate`` or
    ``veloq calibrate`` make them); without one, ``method`` must need none ("fp16", "kivi-2",
    "rlm-4", …). ``max_context`` bounds a sequence's positions. ``threads`` (CPU models): the
    threads veloq's kernels run decode steps on, 1 by default — torch's own threads hold the
    cores between its ops (spinning, waiting for the next one), so more for veloq only contend
    with them; a prompt's coding runs on every core.
    """

    def __init__(
        self,
        model,
        calibration: Union[Calibration, str, os.PathLike, None] = None,
        *,
        method: Optional[str] = None,
        max_context: int = 8192,
        kernels: str = "auto",
        threads: Optional[int] = None,
    ):
        g = geometry(model)
        if isinstance(calibration, (str, os.PathLike)):
            calibration = Calibration.load(calibration)
        if method is None:
            method = calibration.method if calibration is not None else "vq-4"
        self.geometry, self.windows, self.max_context = g, g["windows"], max_context
        self._spec = dict(
            method=method,
            q_heads=g["q_heads"],
            calibration=calibration,
            layers=g["layers"],
            kv_heads=g["kv_heads"],
            head_dim=g["head_dim"],
            windows=g["windows"],
            max_context=max_context,
            kernels=kernels,
        )
        device = _model_device(model)
        self.device = device
        if device.type == "cuda":
            self._spec["device"] = f"cuda:{device.index}"
        elif device.type != "cpu":
            raise DeviceError(f"veloq.transformers runs on CPU and CUDA tensors, not {device}")
        # One thread of veloq's own for CPU decode steps unless told otherwise (KvCache refuses
        # threads for a CUDA cache).
        self._spec["threads"] = 1 if threads is None and device.type == "cpu" else threads
        # Built now to fail early on a calibration of another model; rebuilt for the first step's batch.
        self.native: Optional[KvCache] = KvCache(**self._spec)
        self._batch = 1
        self._fresh = True
        self._pads = [0]  # left padding of each sequence: positions transformers counts, veloq never holds
        # id(mask) → (a weak reference to it, what it says): read once per forward pass, never keeping
        # a prompt's mask (batch × tokens² booleans) alive after its pass.
        self._masks: dict = {}
        super().__init__(layers=[VeloqLayer(self, i) for i in range(g["layers"])])

    def _ensure(self, key_states: torch.Tensor) -> None:
        if key_states.device != self.device:
            raise DeviceError(f"the cache is on {self.device}; this step's keys are on {key_states.device}")
        batch = key_states.shape[0]
        if batch != self._batch:
            if not self._fresh:
                raise ConfigError(f"the cache holds {self._batch} sequences; a step of {batch} cannot continue it")
            self.native = KvCache(**self._spec, batch=batch)
            self._batch = batch
            self._pads = [0] * batch
        self._fresh = False

    def reset(self) -> None:
        self.native.truncate(0)
        self._pads = [0] * self._batch

    @property
    def resident_bytes(self) -> int:
        """Bytes veloq holds for this cache (codes, rows, the codecs' tables) — all of its KV memory."""
        return self.native.resident_bytes

    @property
    def method(self) -> str:
        return self.native.method

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def __repr__(self) -> str:
        return f"VeloqCache(method={self.method!r}, layers={len(self.layers)}, length={self.get_seq_length()})"


def _model_device(model) -> torch.device:
    device = next(model.parameters()).device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[batch, heads, tokens, dim] → [batch, tokens, heads, dim] float32, contiguous, where it is."""
    return x.detach().transpose(1, 2).to(torch.float32).contiguous()


_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cuda_rows(x: torch.Tensor) -> torch.Tensor:
    """[batch, heads, tokens, dim] → [batch, tokens, heads, dim] in the model's dtype (veloq
    converts as it copies): a view at decode, where one token's heads are already contiguous."""
    x = x.detach().transpose(1, 2)
    if x.dtype not in _CUDA_DTYPES:
        x = x.to(torch.float32)
    return x.contiguous()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    """torch's current stream on ``device`` as a ``CUstream`` handle (the raw query where torch
    has it: building a ``torch.cuda.Stream`` object once per layer is measurable host time)."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _np(x: torch.Tensor) -> np.ndarray:
    """[batch, heads, tokens, dim] → [batch, tokens, heads, dim] float32 NumPy (host memory)."""
    return _rows(x).cpu().numpy()


def _np_heads_first(x: torch.Tensor) -> np.ndarray:
    """[batch, heads, tokens, dim] float32 NumPy over the tensor's own memory (veloq reads it heads
    first: in place where that memory is [batch, tokens, heads, dim], as projections leave it)."""
    return x.detach().to(torch.float32).numpy()


def _cuda_call(fn, *args, tensors, **kwargs):
    """``fn(*args, *tensors, heads_first=True)``: the model's own tensors, read in place by veloq
    (no torch op a layer); where their memory is not in [batch, tokens, heads, dim] order (a model
    that made them contiguous heads first), copied into it by torch first."""
    try:
        return fn(*args, *tensors, heads_first=True, **kwargs)
    except ShapeError:
        return fn(*args, *map(_cuda_rows, tensors), **kwargs)


def _mask_says(owner: "VeloqCache", mask: torch.Tensor, first_chunk: bool) -> list:
    """What a layer's mask says of each sequence, read from the device once per forward pass
    (transformers hands the layers of a kind the same mask): on a prompt's first chunk, its left
    padding (the positions no query sees, which must come first); later, how many positions its
    last query sees. Right padding (pads after a sequence's tokens) is refused."""
    said = owner._masks.get(id(mask))
    if said is not None and said[0]() is mask:
        return said[1]
    seen = mask if mask.dtype == torch.bool else mask == 0
    seen = seen[:, 0]  # [batch, queries, positions]
    if first_chunk:
        hidden = ~seen.any(dim=1)  # [batch, positions]
        # Left padding: the hidden positions are a prefix (their count equals the leading run's).
        lead = hidden.to(torch.int32).cumprod(dim=-1).sum(dim=-1)
        counts, lead = torch.stack([hidden.sum(dim=-1), lead]).tolist()
        if counts != lead:
            raise NotImplementedError("veloq attention takes left-padded batches only (tokenizer padding_side='left')")
    else:
        counts = seen[:, -1].sum(dim=-1).tolist()
    if len(owner._masks) > 4:
        owner._masks.clear()
    owner._masks[id(mask)] = (weakref.ref(mask), counts)
    return counts


def veloq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The ``attn_implementation="veloq"`` function: attention over a ``VeloqCache`` layer."""
    layer = getattr(_current, "layer", None)
    _current.layer = None
    if layer is None or layer.index != getattr(module, "layer_idx", layer.index):
        # No VeloqCache on this pass (use_cache=False, another cache): plain SDPA.
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("veloq attention has no logit soft-capping (Gemma 2); use Gemma 3 or another family")
    if dropout and module.training:
        raise NotImplementedError("veloq attention is for inference (no dropout)")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    owner = layer.owner
    native = owner.native
    cuda = query.device.type == "cuda"
    stream = {"stream": _stream(query.device)} if cuda else {}
    t = query.shape[2]
    if t > 1 and native.length(layer.index) == 0:
        # A first chunk sees only its own positions, exact in the cache too: SDPA attends, veloq
        # stores all but the left padding (masked out here, and never attended after).
        skip = None
        if attention_mask is not None:
            skip = _mask_says(owner, attention_mask, first_chunk=True)
            owner._pads = skip
        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if cuda:
            _cuda_call(native.append, layer.index, tensors=(key, value), skip=skip, **stream)
        else:
            native.append(layer.index, _np_heads_first(key), _np_heads_first(value), heads_first=True, skip=skip)
        return out, None
    if attention_mask is not None and not layer.is_sliding:
        # Every sequence's last query must see what veloq holds of it and the step's tokens.
        seen = _mask_says(owner, attention_mask, first_chunk=False)
        if any(n != native.length(layer.index, s) + t for s, n in enumerate(seen)):
            raise NotImplementedError(
                "the mask hides positions veloq holds (padding added after the prompt's first chunk); "
                "start a new VeloqCache for a new batch"
            )
    if cuda:
        b, h, t, d = query.shape
        out = torch.empty((b, t, h, d), dtype=query.dtype, device=query.device)
        _cuda_call(native.attend, layer.index, tensors=(query, key, value), scale=float(scaling), out=out, **stream)
        return out, None
    host = _np_heads_first
    out = native.attend(layer.index, host(query), host(key), host(value), float(scaling), heads_first=True)
    return torch.from_numpy(out).to(query.dtype), None


AttentionInterface.register("veloq", veloq_attention)
# The masks SDPA takes: the pass without a VeloqCache runs SDPA with them; with one, the cache is
# causal (and windowed) by construction and the mask only tells padding apart.
AttentionMaskInterface.register("veloq", sdpa_mask)


def kv_bytes(cache) -> int:
    """Bytes of KV memory a cache holds: a ``VeloqCache``'s as veloq allocated them, a transformers
    cache's from the tensors its layers hold (keys, values and any quantized storage)."""
    if isinstance(cache, VeloqCache):
        return cache.resident_bytes
    seen = set()

    def held(x) -> int:
        # Quantized layers keep their storage in tuples and dicts (HQQ: codes with a dict of scales
        # and zeros), so containers are walked; each tensor counts once.
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if isinstance(x, (tuple, list)):
            return sum(held(y) for y in x)
        if isinstance(x, dict):
            return sum(held(y) for y in x.values())
        return 0

    return sum(held(t) for layer in cache.layers for t in vars(layer).values())


def _cache_kwarg(model) -> str:
    """The name a model's forward takes its cache by: `cache` from transformers 5.2x on,
    `past_key_values` before (and still accepted, deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def calibrate(
    model,
    tokenizer,
    text: Union[str, os.PathLike, torch.Tensor, Sequence[int]],
    *,
    method: str = "vq-4",
    tokens: int = 8192,
    window: Optional[int] = None,
    seed: int = 0,
    out: Union[str, os.PathLike, None] = None,
    progress: Optional[Callable[[str, int, int], object]] = None,
) -> Calibration:
    """Calibrates ``method`` on ``model``'s own post-RoPE keys and values over ``text`` (a string, a
    file's path, or token ids — a 1-D tensor or list, with ``tokenizer`` None): the first ``tokens``
    tokens, run ``window`` positions at a time (default all at once), then k-means per layer.
    Writes the artifact to ``out`` when given (the same format ``veloq calibrate`` writes) and
    returns it."""
    if isinstance(text, os.PathLike):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    if isinstance(text, str):
        if tokenizer is None:
            raise ConfigError("calibrating on text needs the model's tokenizer (or pass token ids)")
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    else:
        ids = torch.as_tensor(text, dtype=torch.long).flatten().cpu()
    if len(ids) < tokens:
        raise ConfigError(f"calibration needs {tokens} tokens of text; this text has {len(ids)}")
    ids = ids[:tokens]
    window = window or tokens
    g = geometry(model)
    keys = [[] for _ in range(g["layers"])]
    values = [[] for _ in range(g["layers"])]

    class Recorder(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            keys[self.index].append(_np(key_states)[0])
            values[self.index].append(_np(value_states)[0])
            return super().update(key_states, value_states, *args, **kwargs)

    device = next(model.parameters()).device
    done = 0
    with torch.no_grad():
        for start in range(0, tokens, window):
            layers = []
            for i in range(g["layers"]):
                layer = Recorder()
                layer.index = i
                layers.append(layer)
            chunk = ids[start : start + window][None].to(device)
            model(chunk, use_cache=True, **{_cache_kwarg(model): Cache(layers=layers)})
            done += chunk.shape[1]
            if progress is not None:
                progress("collecting", done, tokens)
    cal = Calibration.train(
        [np.concatenate(k) for k in keys],
        [np.concatenate(v) for v in values],
        method=method,
        name=g["name"],
        architecture=g["architecture"],
        token_ids=ids.tolist(),
        seed=seed,
        progress=None if progress is None else (lambda done, total: progress("training", done, total)),
    )
    if out is not None:
        cal.save(out)
    return cal
